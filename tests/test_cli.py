"""The command line: the demo and the bench run end to end and print what they promise."""

from __future__ import annotations

from jaxpaged.__main__ import main


def test_demo_prints_tokens_text_and_kv_stats(capsys):
    main(["demo", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert "tokens: [" in out and "text:" in out
    assert "KV cache statistics" in out and "prefix cache:" in out
    assert "24 from the prefix cache" in out  # later requests reuse the shared system prompt's blocks


def test_bench_on_the_tiny_model_with_its_defaults(capsys):
    main(["bench", "--model", "tiny"])
    out = capsys.readouterr().out
    assert "16 requests" in out and "output tok/s" in out and "preemptions 0" in out


def test_generate_on_a_checkpoint_folder(capsys):
    from jaxpaged.models.tiny import tiny_checkpoint_path

    main(["generate", "--model", str(tiny_checkpoint_path("qwen2")), "--prompt", "Hello", "--prompt", "Once upon",
          "--max-tokens", "3", "--dtype", "float32", "--block-size", "8", "--max-model-len", "64"])
    out = capsys.readouterr().out
    assert out.count("finish=length") == 2
