"""Structured outputs through the server with the ``openai`` client: OpenAI's ``response_format``
(``json_schema``, ``json_object``) and vLLM's ``structured_outputs`` / ``guided_*`` fields; a constraint that
cannot be compiled, or two of them, is a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from jaxpaged import LLM
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.serve.limits import ServerLimits

from conftest import live_server  # noqa: E402  (tests/serve/conftest.py)

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M"]}},
          "required": ["ok", "size"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # (compact JSON: random weights love whitespace)


@pytest.fixture(scope="module")
def base():
    with LLM(tiny_checkpoint_path("qwen3"), dtype="float32", max_model_len=128, num_blocks=64,
             max_num_seqs=8) as llm, live_server(llm, ServerLimits()) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def test_response_format_and_vllm_fields(client):
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give JSON"}], max_tokens=48, temperature=1.0, seed=2, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    for c in chat.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Pick"}], max_tokens=16, stream=True, temperature=1.0,
        seed=1, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) in ("red", "green", "blue")
    out = client.completions.create(model="tiny", prompt="Code:", max_tokens=16, temperature=1.0, seed=3,
                                    extra_body={"guided_regex": r"[xy]{3}\d"})
    assert re.fullmatch(r"[xy]{3}\d", out.choices[0].text), out.choices[0].text
    out = client.completions.create(model="tiny", prompt="Yes?", max_tokens=16, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no") and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}}, "guided_json"),
    ({"structured_outputs": {"regex": "(oops"}}, "structured_outputs"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": ["x" * 2000]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_bad_constraints_are_400_naming_the_field(base, body, field):
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                        "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field or field in err["message"], err
    assert httpx.get(f"{base}/health").status_code == 200
