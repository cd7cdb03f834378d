"""OpenAI's request bodies for ``/v1/completions`` and ``/v1/chat/completions`` (with vLLM's extra
sampling fields), their mapping to ``SamplingParams``, and OpenAI's error body.

Every field is bounded here, so ``/openapi.json`` states each bound and a value out of range is a 400
naming the field before anything reaches the engine: numbers by the engine's ranges
(``jaxpaged.sampling.params``), integers strict (``true`` is not a token id, ``1.0`` not a count),
floats finite, strings and lists by length. The bounds here are the hard ones; a deployment may set
tighter limits (``ServerLimits``), checked by the server. Fields a client sends that are not listed are
ignored (as vLLM does); OpenAI fields jaxpaged does not implement are listed and refused with a 400
naming them when they ask for something (``unsupported``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from ..sampling import SamplingParams
from ..sampling.params import MAX_COUNT, MAX_FLOAT32, MAX_LOGPROBS, MAX_SEED, MAX_TOP_K
from .limits import MAX_N, MAX_STOP_STRINGS, ServerLimits  # noqa: F401  (ServerLimits: re-exported)

# Sampling fields whose default comes from the checkpoint's generation_config.json when a request omits them.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# Hard bounds of the request bodies (a deployment's ServerLimits may be tighter, never looser).
MAX_STOP_CHARS = 1024  # one stop string
MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32; the engine checks them against the vocabulary
MAX_PROMPTS = 1024  # prompts in one completions request
MAX_MESSAGES = 4096
MAX_NAME_CHARS = 1024  # model names, user, cache_salt, message names
MAX_TEMPLATE_KWARGS_DEPTH = 8

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_TOKEN_ID)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    include_usage: Bool = False


class SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Strict(), Field(allow_inf_nan=False, ge=0, le=MAX_FLOAT32)] | None = None
    top_p: Annotated[float, Strict(), Field(allow_inf_nan=False, gt=0, le=1)] | None = None
    seed: Annotated[int, Strict(), Field(ge=0, le=MAX_SEED)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: Annotated[float, Strict(), Field(allow_inf_nan=False, ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Strict(), Field(allow_inf_nan=False, ge=-2, le=2)] = 0.0
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None  # accepted, not used
    logit_bias: dict[str, Any] | None = None  # unsupported when not empty
    # vLLM's extra parameters
    top_k: Annotated[int, Strict(), Field(ge=-1, le=MAX_TOP_K)] | None = None
    min_p: Annotated[float, Strict(), Field(allow_inf_nan=False, ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Strict(), Field(allow_inf_nan=False, gt=0, le=MAX_FLOAT32)] | None = None
    min_tokens: Annotated[int, Strict(), Field(ge=0, le=MAX_COUNT)] = 0
    ignore_eos: Bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    cache_salt: Name | None = None
    return_token_ids: Bool = False  # each choice also carries its (new) tokens' ids as ``token_ids``

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, message)`` for an OpenAI field that asks for what jaxpaged does not do, else None."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

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


MaxTokens = Annotated[int, Strict(), Field(ge=1, le=MAX_COUNT)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: (str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: MaxTokens | None = 16
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Bool = False
    suffix: str | None = None  # unsupported when given
    best_of: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] | None = None  # unsupported above n

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (use n)"
        if self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs is not supported (it needs the prompt's logprobs)"
        return super().unsupported()


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None


def _deeper_than(value: Any, limit: int) -> bool:
    """True if ``value`` nests dicts / lists more than ``limit`` levels (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (v.values() if isinstance(v, dict) else v))
    return False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None  # unsupported unless "text"
    tools: list[dict[str, Any]] | None = None  # unsupported when not empty
    tool_choice: str | dict[str, Any] | None = None  # "none" / "auto" without tools: accepted
    parallel_tool_calls: Bool | None = None  # accepted, not used

    @field_validator("chat_template_kwargs")
    @classmethod
    def _shallow(cls, value: dict | None) -> dict | None:
        if value is not None and _deeper_than(value, MAX_TEMPLATE_KWARGS_DEPTH):
            raise ValueError(f"nested deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools are not supported"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice", "tool_choice is not supported"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", f"response_format {self.response_format.type!r} is not supported"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().unsupported()

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as ``LLM.chat`` takes them (list content parts joined as text)."""
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            out.append({"role": m.role, "content": content or ""})
        return out


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
                    "server_error"]


def error_body(message: str, type_: ErrorType = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
