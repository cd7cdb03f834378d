"""Structured outputs without a model: the device's bitmask against a numpy reference, the params' checks,
and the grammar backend (llguidance) over the tiny checkpoint's tokenizer: a matcher driven by random
allowed tokens produces text that matches its constraint."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import StructuredOutputsParams, load_tokenizer
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.sampling.bitmask import apply_token_bitmask, unpack_bitmask

llguidance = pytest.importorskip("llguidance")
from jaxpaged.sampling.grammar import GrammarCompiler, bitmask_width, fill_bitmasks  # noqa: E402

VOCAB = 512


def reference_allowed(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """numpy: bit ``j % 32`` of word ``j // 32``, little-endian within the word."""
    bits = np.unpackbits(bitmask.astype("<i4").view(np.uint8), axis=1, bitorder="little")
    out = np.zeros((bitmask.shape[0], vocab), bool)
    n = min(vocab, bits.shape[1])
    out[:, :n] = bits[:, :n].astype(bool)
    return out


@pytest.mark.parametrize("vocab,width", [(64, 2), (70, 3), (100, 3)])  # exact, padded words, words short
def test_bitmask_unpack_and_apply_match_numpy(vocab, width):
    rng = np.random.default_rng(vocab)
    bitmask = rng.integers(-2**31, 2**31, (5, width), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # an unconstrained row: everything passes
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    want = reference_allowed(bitmask, vocab)
    if 32 * width >= vocab:
        np.testing.assert_array_equal(np.asarray(unpack_bitmask(jnp.asarray(bitmask), vocab)), want)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, np.where(want, logits, -np.inf))
    if 32 * width >= vocab:
        np.testing.assert_array_equal(got[0], logits[0])


@pytest.mark.parametrize("kwargs,field", [
    (dict(), "exactly one"), (dict(regex="a", choice=["a"]), "exactly one"), (dict(json=3), "json"),
    (dict(json="{not json"), "json"), (dict(regex=""), "regex"), (dict(choice="ab"), "choice"),
    (dict(choice=[]), "choice"), (dict(grammar="x" * (65 << 10)), "grammar"), (dict(json_object=1), "json_object")])
def test_params_are_checked(kwargs, field):
    with pytest.raises((TypeError, ValueError), match=field):
        StructuredOutputsParams(**kwargs)


@pytest.fixture(scope="module")
def compiler():
    tok = load_tokenizer(tiny_checkpoint_path("qwen3"))
    return GrammarCompiler(tok.to_json(), VOCAB, (0,)), tok


def drive(matchers, seed, max_tokens=64):
    """Samples uniformly among each matcher's allowed tokens (one batched mask per step) until every
    matcher is terminated; returns each one's tokens."""
    rng = np.random.default_rng(seed)
    out = [[] for _ in matchers]
    bitmask = np.full((len(matchers), bitmask_width(VOCAB)), -1, np.int32)
    for _ in range(max_tokens):
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if not live:
            break
        fill_bitmasks([(matchers[i], i) for i in live], bitmask)
        allowed = reference_allowed(bitmask, VOCAB)
        for i in live:
            token = int(rng.choice(np.flatnonzero(allowed[i])))
            assert matchers[i].accept(token)
            out[i].append(token)
    assert all(m.is_terminated() for m in matchers)
    return out


def test_matchers_follow_regex_choice_and_schema(compiler):
    comp, tok = compiler
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M"]}},
              "required": ["ok", "size"], "additionalProperties": False}
    specs = [StructuredOutputsParams(regex=r"[ab]{2}\d"), StructuredOutputsParams(choice=["yes", "no"]),
             StructuredOutputsParams(json=schema, disable_any_whitespace=True)]
    matchers = [comp.submit(s).result().matcher() for s in specs]
    for seed in range(3):
        fresh = [comp.submit(s).result().matcher() for s in specs]  # (cached grammars, new matchers)
        texts = [tok.decode([t for t in ids if t != 0]) for ids in drive(fresh, seed)]
        assert re.fullmatch(r"[ab]{2}\d", texts[0]), texts
        assert texts[1] in ("yes", "no"), texts
        value = json.loads(texts[2])
        assert set(value) == {"ok", "size"} and isinstance(value["ok"], bool) and value["size"] in ("S", "M")
    assert comp.submit(specs[0]) is comp.submit(StructuredOutputsParams(regex=r"[ab]{2}\d"))  # cached by text
    assert not matchers[0].is_terminated()
    # EOS (token 0) is allowed only where the grammar may end; a refused token puts the matcher in error
    m = matchers[1]
    assert not m.accept(0) and m.error


def test_uncompilable_names_its_field(compiler):
    comp, _ = compiler
    for kwargs, field in ((dict(json={"type": "foo"}), "json"), (dict(regex="a(b"), "regex"),
                          (dict(grammar="start: undefined_rule"), "grammar")):
        with pytest.raises(ValueError, match=f"StructuredOutputsParams.{field} cannot be compiled"):
            comp.submit(StructuredOutputsParams(**kwargs)).result()
