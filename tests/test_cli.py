"""The command line: every subcommand takes the model and the engine flags the same way, answers --help
without loading JAX, reports a problem as one line (exit status 2), and prints what it promises."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from jaxpaged.__main__ import add_engine_arguments, build_parser, main

COMMANDS = ("demo", "generate", "bench", "serve")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_does_not_import_jax():
    code = ("import sys; from jaxpaged.__main__ import build_parser; build_parser(); "
            "print(sorted(m for m in ('jax', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for cmd in COMMANDS:
        result = subprocess.run([sys.executable, "-m", "jaxpaged", cmd, "--help"], capture_output=True, text=True)
        assert result.returncode == 0 and "--gpu-memory-utilization" in result.stdout, result.stderr


def test_every_subcommand_shares_the_model_and_engine_flags_with_help_on_each():
    engine = argparse.ArgumentParser()
    add_engine_arguments(engine)
    engine_flags = {s for a in engine._actions for s in a.option_strings} - {"-h", "--help"}
    assert {"--gpu-memory-utilization", "--max-model-len", "--dtype", "--block-size", "--kv-cache-dtype",
            "--tensor-parallel-size", "--no-enable-prefix-caching"} <= engine_flags
    for name, parser in subparsers().items():
        flags = {s for a in parser._actions for s in a.option_strings}
        assert engine_flags <= flags and "--model" in flags, name
        assert any(a.dest == "model" and not a.option_strings for a in parser._actions), name
        for action in parser._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            if action.choices is None and action.option_strings and action.nargs != 0 and action.type is None:
                assert action.dest in ("prompt", "model_flag", "host", "api_key", "served_model_name"), \
                    f"{name} {action.option_strings}: neither choices nor a checked type"


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x"],  # no model
                                  ["serve", "tiny", "--block-size", "3"],
                                  ["demo", "--gpu-memory-utilization", "1.5"],
                                  ["bench", "--kv-cache-dtype", "int4"],
                                  ["serve", "a", "--model", "b"]])
def test_usage_errors_are_one_line_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err


def test_a_missing_model_is_one_line_naming_it_and_debug_shows_the_traceback(capsys, tmp_path):
    missing = str(tmp_path / "no-such-folder")
    for cmd in COMMANDS:
        extra = ["--prompt", "x"] if cmd == "generate" else []
        assert main([cmd, missing, *extra]) == 2, cmd
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and missing in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="no-such-folder"):
        main(["generate", missing, "--prompt", "x", "--debug"])


def test_serve_takes_the_model_either_way():
    from jaxpaged.__main__ import parse_args, serve_llm_args

    for argv in (["serve", "tiny"], ["serve", "--model", "tiny"], ["serve", "tiny", "--model", "tiny"]):
        args = parse_args(argv)
        assert args.model == "tiny" and serve_llm_args(args)["model"].endswith("qwen3"), argv


def test_demo_prints_tokens_text_and_kv_stats(capsys):
    import jax

    assert main(["demo", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "tokens: [" in out and "text:" in out
    assert "KV cache statistics" in out and "prefix cache:" in out
    assert "24 from the prefix cache" in out  # later requests reuse the shared system prompt's blocks
    assert "(cached now: 3 device)" in out
    if jax.default_backend() == "cpu":  # no warm-up there: the message says so
        assert "compiling steps on first use" in out and "start-up" not in out


def test_bench_on_the_tiny_model_with_its_defaults(capsys):
    assert main(["bench", "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "16 requests" in out and "output tok/s" in out and "preemptions 0" in out


def test_generate_on_tiny_and_on_a_checkpoint_folder(capsys):
    from jaxpaged.models.tiny import tiny_checkpoint_path

    assert main(["generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("finish=length") == 1
    assert main(["generate", str(tiny_checkpoint_path("qwen2")), "--prompt", "Hello", "--prompt", "Once upon",
                 "--max-tokens", "3", "--dtype", "float32", "--block-size", "8", "--max-model-len", "64"]) == 0
    assert capsys.readouterr().out.count("finish=length") == 2
