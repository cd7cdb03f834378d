"""The checkpoint's tokenizer (``tokenizer.json``), through the fast ``tokenizers`` library."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """Text <-> token ids; special tokens are skipped when decoding."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


def load_tokenizer(model_path: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder, or ``None`` if it has no ``tokenizer.json``."""
    path = Path(model_path) / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
