"""The checkpoint's tokenizer (``tokenizer.json``, fast ``tokenizers`` library) and its chat template.

The chat template comes from ``tokenizer_config.json`` (``chat_template``) or ``chat_template.jinja``
and is rendered by transformers' ``apply_chat_template`` (the same Jinja environment Hugging Face and
vLLM use), so an instruct checkpoint's prompts are formatted exactly as it was trained.
"""

from __future__ import annotations

import logging

import json
from pathlib import Path

from ..models.config import CheckpointError


class Tokenizer:
    """Text <-> token ids; special tokens are skipped when decoding unless asked otherwise."""

    def __init__(self, path: str | Path, chat_template: str | None = None):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a bad file
            raise CheckpointError(f"{path}: cannot be read as a tokenizer ({err})") from err
        self.chat_template = chat_template
        self._hf = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text, without padding or truncation (what a grammar backend
        reads to learn each token's bytes)."""
        import copy

        tok = copy.copy(self._tok)
        tok.no_padding()
        tok.no_truncation()
        return tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers (its vocabulary string's length in
        bytes; a byte-level token's characters stand for one byte each, so this overestimates): a text of
        more than ``n * max_token_bytes()`` bytes cannot be ``n`` tokens or fewer."""
        return max((len(t.encode()) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def apply_chat_template(self, conversation: list[dict], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for ``conversation`` (a list of ``{"role", "content"}`` dicts)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json "
                             "nor chat_template.jinja): pass chat_template=... to chat()")
        if self._hf is None:
            self._hf = _hf_tokenizer(self._tok)
        return self._hf.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **kwargs)


def _no_torch_notice(record: logging.LogRecord) -> bool:
    return "PyTorch was not found" not in record.getMessage()


def _hf_tokenizer(tok):
    """transformers' tokenizer around ``tok``, for its chat-template rendering. Without PyTorch,
    transformers announces at import that models are unavailable, which reads as a missing dependency
    here (only its tokenizer utilities are used): that one message is filtered out at its logger. (A
    level set around the import does not hold: transformers sets its logger's level while importing.)"""
    hf_logger = logging.getLogger("transformers")
    if _no_torch_notice not in hf_logger.filters:
        hf_logger.addFilter(_no_torch_notice)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _read_chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        template = json.loads(cfg.read_text()).get("chat_template")
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{cfg} is not valid JSON: {err}") from err
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def load_tokenizer(model_path: str | Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint folder (with its chat template), or ``None`` if it has no
    ``tokenizer.json``. Accepts a Hub id whose files are in the local Hugging Face cache."""
    from ..models.hub import resolve_model_path

    folder = resolve_model_path(model_path)
    path = folder / "tokenizer.json"
    return Tokenizer(path, _read_chat_template(folder)) if path.is_file() else None
