"""Tiny random Qwen2 / Qwen3 checkpoints in real Hugging Face format, written without torch.

Nothing can be downloaded in this project's environments, so tests, the demo and the transformers
comparisons run on checkpoints written here: config.json, model.safetensors, generation_config.json
and a working byte-level BPE tokenizer.json trained on a small built-in text. The packaged copies
under ``models/tiny/{qwen2,qwen3}`` were written by ``write_tiny_checkpoint`` and are the defaults.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import QwenConfig
from .convert import name_table
from .safetensors_io import write_safetensors

TINY_DIR = Path(__file__).parent / "tiny"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML, as Qwen2.5 / Qwen3 instruct checkpoints use (without their tool-calling branches).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

_CORPUS = """\
PagedAttention stores the key and value cache in fixed-size blocks, like pages of virtual memory.
A block table maps each sequence's logical blocks to physical blocks in one shared pool.
Prefix caching lets requests that share a system prompt reuse the blocks that hold it.
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
Once upon a time there was a small language model that lived inside a unit test.
It predicted the next token, then the next, until it reached the end of the text.
Continuous batching adds new requests as soon as others finish, keeping the GPU busy.
JAX compiles the whole step with XLA; Pallas writes custom kernels for the hot loop.
0 1 2 3 4 5 6 7 8 9 10 100 1000 2026 3.14159 + - * / = ( ) [ ] { } < > , . ; : ! ?
"""


def tiny_config(model_type: str, vocab_size: int) -> dict:
    """A small but complete config.json for ``qwen2`` (untied, q/k/v bias) or ``qwen3`` (tied, q/k norm)."""
    common = {
        "vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": 0, "eos_token_id": 0, "dtype": "float32", "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None,
    }
    if model_type == "qwen2":
        return {**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "num_hidden_layers": 2, "tie_word_embeddings": False, "rope_theta": 10000.0}
    if model_type == "qwen3":
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "num_hidden_layers": 3, "head_dim": 32, "tie_word_embeddings": True,
                "attention_bias": False, "rope_theta": 1000000.0}
    raise ValueError(f"no tiny config for model_type {model_type!r}")


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (any text round-trips) trained on the built-in corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Qwen's own pre-tokenizer (transformers' Qwen2Tokenizer installs it too): split words, single
    # digits and punctuation by regex, then map bytes to printable characters.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    return tok


def random_hf_tensors(cfg: QwenConfig, seed: int = 0, std: float = 0.15) -> dict[str, np.ndarray]:
    """Random fp32 tensors under Hugging Face names and shapes (norm weights near 1, biases small).

    The spread is larger than a trained model's init so that logits are peaked and greedy decoding
    has clear winners (near-ties would make token-exact comparisons depend on rounding).
    """
    rng = np.random.default_rng(seed)
    tensors = {}
    for rule in name_table(cfg):
        for name, shape in rule.sources:
            if "norm" in name:
                value = 1.0 + 0.1 * rng.standard_normal(shape)
            elif name.endswith(".bias"):
                value = 0.1 * rng.standard_normal(shape)
            else:
                value = std * rng.standard_normal(shape)
            tensors[name] = value.astype(np.float32)
    return tensors


def write_tiny_checkpoint(out_dir: str | Path, model_type: str = "qwen3", seed: int = 0,
                          vocab_size: int = 512) -> Path:
    """Writes a tiny random checkpoint folder that transformers' ``from_pretrained`` can load."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    raw = tiny_config(model_type, vocab_size)
    eos = tok.token_to_id("<|endoftext|>")
    raw["eos_token_id"] = raw["bos_token_id"] = eos
    cfg = QwenConfig.from_dict(raw)
    write_safetensors(out / "model.safetensors", random_hf_tensors(cfg, seed))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": eos, "do_sample": False}, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": raw["max_position_embeddings"],
        "add_bos_token": False, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE},
        indent=2) + "\n")
    return out


def tiny_checkpoint_path(model_type: str = "qwen3") -> Path:
    """The packaged tiny checkpoint folder for ``qwen2`` or ``qwen3``."""
    path = TINY_DIR / model_type
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"packaged tiny checkpoint {path} is missing; run "
                                f"`python -m jaxpaged.models.tiny` to write it")
    return path


if __name__ == "__main__":
    for mt in ("qwen2", "qwen3"):
        print("wrote", write_tiny_checkpoint(TINY_DIR / mt, mt, seed={"qwen2": 2, "qwen3": 3}[mt]))
