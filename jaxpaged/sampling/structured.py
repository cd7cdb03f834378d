"""StructuredOutputsParams: constrain a request's output to a JSON schema, a regex, a choice of strings or
a grammar (vLLM's names and meanings).

Exactly one of ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (a list of
strings), ``grammar`` (a Lark / EBNF grammar) or ``json_object=True`` (any JSON object) is set;
anything else is a ``ValueError`` / ``TypeError`` naming the field. The grammar itself is compiled by
the engine's grammar backend (``grammar.py``), off the engine loop; a grammar it cannot compile is a
``ValueError`` naming the field too.

Sizes are bounded here (``MAX_SPEC_BYTES`` for a schema, regex or grammar; ``MAX_CHOICES`` strings of
at most ``MAX_CHOICE_CHARS`` characters), so one request cannot make the compiler work without end.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

MAX_SPEC_BYTES = 64 << 10  # a JSON schema's text, a regex or a grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass
class StructuredOutputsParams:
    """What a request's output must match (one field set; see the module docstring)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond the separators (", " and ": ")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks the fields (``TypeError`` / ``ValueError`` naming the field)."""
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError("StructuredOutputsParams.disable_any_whitespace must be True or False")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams: exactly one of json, regex, choice, grammar or json_object "
                             f"must be set, got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, dict):
                text = _json_text(value)
            elif isinstance(value, str):
                text = value
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError as err:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {err}") from None
                if not isinstance(parsed, (dict, bool)):
                    raise ValueError("StructuredOutputsParams.json must be a JSON schema (an object)")
            else:
                raise TypeError(f"StructuredOutputsParams.json must be a dict or a JSON string, got "
                                f"{type(value).__name__}")
            _bounded("json", text)
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str):
                raise TypeError(f"StructuredOutputsParams.{kind} must be a string, got {type(value).__name__}")
            if not value:
                raise ValueError(f"StructuredOutputsParams.{kind} must not be empty")
            _bounded(kind, value)
        elif kind == "choice":
            if isinstance(value, str) or not isinstance(value, (list, tuple)):
                raise TypeError(f"StructuredOutputsParams.choice must be a list of strings, got {type(value).__name__}")
            if not 1 <= len(value) <= MAX_CHOICES:
                raise ValueError(f"StructuredOutputsParams.choice must hold 1 to {MAX_CHOICES} strings, "
                                 f"got {len(value)}")
            if not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in value):
                raise ValueError(f"StructuredOutputsParams.choice must hold non-empty strings of at most "
                                 f"{MAX_CHOICE_CHARS} characters")
            self.choice = list(value)
        elif value is not True:
            raise TypeError(f"StructuredOutputsParams.json_object must be True or None, got {value!r}")

    @property
    def kind(self) -> str:
        """The field that is set (one of ``KINDS``)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """``(kind, text)``: what the grammar is compiled from, canonical (a schema dict as compact JSON, its
        keys in their order: properties are generated in it), so equal constraints share one compiled
        grammar."""
        kind = self.kind
        if kind == "json":
            return kind, _json_text(self.json) if isinstance(self.json, dict) else self.json
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return "json", '{"type": "object"}'
        return kind, getattr(self, kind)


def _json_text(schema: Any) -> str:
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"StructuredOutputsParams.json cannot be written as JSON: {err}") from None


def _bounded(name: str, text: str) -> None:
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise ValueError(f"StructuredOutputsParams.{name} is {len(text.encode())} bytes, more than {MAX_SPEC_BYTES}")
