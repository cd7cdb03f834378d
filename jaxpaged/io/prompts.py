"""Prompts at the boundary: what users may pass, checked before anything is queued.

A prompt is one of (vLLM's forms):
* ``str``: text, tokenized with the checkpoint's tokenizer;
* a list (or tuple, or 1-D numpy array) of token ids: Python or numpy integers, never ``bool``;
* ``{"prompt": str}`` or ``{"prompt_token_ids": [ids]}`` (vLLM's ``TextPrompt`` / ``TokensPrompt``).

``generate`` takes one prompt or a list of them (a list of ints is one prompt). Anything else is a
``TypeError`` / ``ValueError`` naming the prompt's index and what was wrong, raised before any request
is queued, so a bad batch leaves the engine untouched.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A checked prompt: ``text`` (None for token-id prompts) and/or ``token_ids`` (None until tokenized)."""

    text: str | None
    token_ids: list[int] | None


def _is_token(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _token_list(value: Any, where: str) -> list[int]:
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise TypeError(f"{where}: token ids must be a 1-D integer array, got {value.dtype}{list(value.shape)}")
        return [int(t) for t in value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: token ids must be a list of ints, got {type(value).__name__}")
    if all(type(t) is int for t in value) and (not value or min(value) >= 0):
        return list(value)  # the usual case, without a per-token isinstance (bool is not type int)
    for pos, t in enumerate(value):
        if not _is_token(t):
            raise TypeError(f"{where}: token id at position {pos} is {type(t).__name__} {t!r}, not an int")
        if t < 0:
            raise ValueError(f"{where}: token id at position {pos} is negative ({t})")
    return [int(t) for t in value]


def parse_prompt(prompt: Any, where: str = "prompt") -> Prompt:
    """One prompt in any accepted form -> ``Prompt``; ``where`` names it in errors ("prompt 3")."""
    if isinstance(prompt, str):
        return Prompt(prompt, None)
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"{where}: 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            return Prompt(prompt["prompt"], None)
        if keys == {"prompt_token_ids"}:
            return Prompt(None, _token_list(prompt["prompt_token_ids"], where))
        raise ValueError(f"{where}: a dict prompt must have exactly one key, 'prompt' (text) or "
                         f"'prompt_token_ids' (ids); got keys {sorted(map(str, keys))}")
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return Prompt(None, _token_list(prompt, where))
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"{where}: got bytes; decode them to a str first")
    raise TypeError(f"{where}: must be a str, a list of token ids or a dict with 'prompt' / 'prompt_token_ids', "
                    f"got {type(prompt).__name__} {prompt!r:.60}")


def parse_prompts(prompts: Any) -> list[Prompt]:
    """One prompt or a list of prompts -> checked ``Prompt``s (a flat list of ints is one prompt)."""
    if prompts is None:
        raise TypeError("prompts must be a str, a list of token ids, a dict, or a list of these; got None")
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts)]
    if isinstance(prompts, np.ndarray):
        if prompts.ndim == 1:
            return [parse_prompt(prompts)]
        if prompts.ndim == 2:
            return [parse_prompt(row, f"prompt {i}") for i, row in enumerate(prompts)]
        raise TypeError(f"prompts: a numpy array must be 1-D (one prompt) or 2-D, got {prompts.ndim}-D")
    if isinstance(prompts, (list, tuple)):
        if prompts and all(_is_token(t) for t in prompts):
            return [parse_prompt(list(prompts))]
        if prompts and any(_is_token(t) for t in prompts):
            i = next(i for i, t in enumerate(prompts) if not _is_token(t))
            raise TypeError(f"prompts: a list mixing token ids and other things (item {i} is "
                            f"{type(prompts[i]).__name__} {prompts[i]!r:.40}); pass a list of ints for one prompt")
        return [parse_prompt(p, f"prompt {i}") for i, p in enumerate(prompts)]
    return [parse_prompt(prompts)]


def broadcast_sampling_params(sampling_params: Any, num_prompts: int, cls) -> list:
    """One ``SamplingParams`` for every prompt, or a list with one per prompt (checked)."""
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts")
        return [cls.from_optional(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]
    sp = cls.from_optional(sampling_params)
    return [sp] * num_prompts


def chat_prompts(tokenizer, messages, chat_template: str | None = None, add_generation_prompt: bool = True,
                 chat_template_kwargs: dict | None = None) -> list[str]:
    """The prompt text of each conversation through ``tokenizer``'s chat template (``LLM.chat``, the server).
    ``messages``: one conversation (a list of ``{'role', 'content'}`` dicts) or a list of them."""
    if tokenizer is None:
        raise ValueError("chat() needs the checkpoint's tokenizer (tokenizer.json)")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts (one conversation) "
                        f"or a list of such lists, got {messages!r:.80}")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for i, conv in enumerate(conversations):
        if not isinstance(conv, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in conv):
            raise TypeError(f"conversation {i}: must be a list of dicts with 'role' and 'content'")
    return [tokenizer.apply_chat_template(list(c), chat_template, add_generation_prompt, **(chat_template_kwargs or {}))
            for c in conversations]
