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

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, field_validator

from ..sampling import SamplingParams, StructuredOutputsParams
from ..sampling.params import MAX_COUNT, MAX_FLOAT32, MAX_LOGPROBS, MAX_SEED, MAX_TOP_K
from ..sampling.structured import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_SPEC_BYTES
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
MAX_SCHEMA_DEPTH = 32  # a JSON schema's nesting (its size is bounded by MAX_SPEC_BYTES)

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
TokenId = Annotated[int, Strict(), Field(ge=0, le=MAX_TOKEN_ID)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class FieldError(ValueError):
    """A request field's value the models accept but the request cannot use (``field``: its name)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class StreamOptions(BaseModel):
    include_usage: Bool = False


Spec = Annotated[str, Field(min_length=1, max_length=MAX_SPEC_BYTES)]  # a regex or a grammar (chars <= bytes)
Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICES)]


def _bounded_schema(value: dict | str | None) -> dict | str | None:
    """A JSON schema (a dict, or its text) of at most ``MAX_SPEC_BYTES`` and ``MAX_SCHEMA_DEPTH`` levels."""
    if value is None:
        return value
    if isinstance(value, dict) and _deeper_than(value, MAX_SCHEMA_DEPTH):
        raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    size = len(value.encode()) if isinstance(value, str) else len(json.dumps(value).encode())
    if size > MAX_SPEC_BYTES:
        raise ValueError(f"{size} bytes, more than {MAX_SPEC_BYTES}")
    return value


Schema = Annotated[dict[str, Any] | str, AfterValidator(_bounded_schema)]


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs`` object: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``."""

    model_config = ConfigDict(extra="forbid")

    json_: Schema | None = Field(None, alias="json")
    regex: Spec | None = None
    choice: Choices | None = None
    grammar: Spec | None = None
    json_object: Bool | None = None
    disable_any_whitespace: Bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: ``name``, ``schema``, ``strict`` (the schema's own
    ``additionalProperties`` / ``required`` are what the output follows, strict or not)."""

    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(max_length=MAX_NAME_CHARS)] = "schema"
    description: Annotated[str, Field(max_length=MAX_SPEC_BYTES)] | None = None
    schema_: Schema | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: Schema | None = None
    guided_regex: Spec | None = None
    guided_choice: Choices | None = None
    guided_grammar: Spec | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, message)`` for an OpenAI field that asks for what jaxpaged does not do, else None."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    def structured(self) -> tuple[str, StructuredOutputsParams] | None:
        """``(field, params)``: the request's structured output and the field that asked for it, else None.
        More than one such field, or a bad one, is a ``FieldError`` naming it."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", dict(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise FieldError("response_format", "json_schema.schema is required for type 'json_schema'")
            given.append(("response_format", dict(json=rf.json_schema.schema_)))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", dict(json=so.json_, regex=so.regex, choice=so.choice,
                                                     grammar=so.grammar, json_object=so.json_object,
                                                     disable_any_whitespace=so.disable_any_whitespace)))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {kind: getattr(self, name)}))
        if not given:
            return None
        if len(given) > 1:
            raise FieldError(given[1][0], f"only one structured output may be given (also {given[0][0]})")
        field, kwargs = given[0]
        try:
            return field, StructuredOutputsParams(**kwargs)
        except (ValueError, TypeError) as err:
            raise FieldError(field, str(err)) from None

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None,
                        streaming: bool, structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's ``SamplingParams``: its own fields, else the checkpoint's defaults
        (``GENERATION_DEFAULTS``), else ``SamplingParams``'; ``structured``: its structured output
        (``structured()``). Raises what ``SamplingParams`` raises."""
        from ..sampling import RequestOutputKind

        given = {k: getattr(self, k) for k in GENERATION_DEFAULTS}
        chosen = {k: (v if v is not None else getattr(defaults, k)) for k, v in given.items()}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if streaming else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured, **chosen)


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


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
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
