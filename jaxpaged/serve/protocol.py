"""OpenAI's request bodies for ``/v1/completions`` and ``/v1/chat/completions`` (with vLLM's extra
sampling fields), their mapping to ``SamplingParams``, and OpenAI's error body.

Fields a client sends that are not listed here are ignored (as vLLM does); a listed field of the wrong
type is a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import SamplingParams

# Sampling fields whose default comes from the checkpoint's generation_config.json when a request omits them.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    return_token_ids: bool = False  # each choice also carries its (new) tokens' ids as ``token_ids``

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None,
                        streaming: bool) -> SamplingParams:
        """The request's ``SamplingParams``: its own fields, else the checkpoint's defaults
        (``GENERATION_DEFAULTS``), else ``SamplingParams``'. Raises what ``SamplingParams`` raises."""
        from ..sampling import RequestOutputKind

        given = {k: getattr(self, k) for k in GENERATION_DEFAULTS}
        chosen = {k: (v if v is not None else getattr(defaults, k)) for k, v in given.items()}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY, **chosen)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as ``LLM.chat`` takes them (list content parts joined as text)."""
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
            out.append({"role": m.role, "content": content or ""})
        return out


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "server_error"]


def error_body(message: str, type_: ErrorType = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
