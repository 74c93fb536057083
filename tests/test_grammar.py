"""The grammar engine and decoding under it: masks against a reference, JSON that validates.

The tiny random decoder (byte tokenizer) is the model, so every constraint here is doing all the
work: its unconstrained output is noise.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import torch

from agent.adapters.base import ModelAdapter
from agent.adapters.loading import load_adapter
from agent.engine.chat import ByteTokenizer
from agent.engine.generation import SamplingParams, decode
from agent.grammar import GrammarEngine, GrammarError, json_schema_grammar, unpack_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny() -> ModelAdapter:
    return load_adapter("tiny:llama-gqa", tokenizer=ByteTokenizer())


@pytest.fixture(scope="module")
def engine(tiny: ModelAdapter) -> GrammarEngine:
    return GrammarEngine(ByteTokenizer(), tiny.eos_ids, tiny.vocab_size)


def test_unpack_bitmask_matches_bit_by_bit_reference() -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (5,), dtype=torch.int32, generator=g)
    got = unpack_bitmask(mask, 150)
    ref = [bool((int(mask[i // 32]) >> (i % 32)) & 1) for i in range(150)]
    assert got.tolist() == ref
    padded = unpack_bitmask(mask, 200)  # a vocabulary wider than the mask: the rest refused
    assert padded[:160].tolist() == [bool((int(mask[i // 32]) >> (i % 32)) & 1) for i in range(160)]
    assert not padded[160:].any()


def test_mask_follows_a_lark_grammar(engine: GrammarEngine) -> None:
    tok = ByteTokenizer()
    c = engine.constraint('start: "click(" /[0-9]{1,3}/ ", " /[0-9]{1,3}/ ")"')
    first = c.allowed(engine.vocab).nonzero().flatten().tolist()
    assert first == tok.encode("c")
    for t in tok.encode("click(12, 345"):
        assert c.allowed(engine.vocab)[t]
        c.advance(t)
    assert c.allowed(engine.vocab).nonzero().flatten().tolist() == tok.encode(")")
    c.advance(tok.encode(")")[0])
    assert c.finished
    assert c.accepting
    with pytest.raises(GrammarError):
        engine.constraint('start: "a"').advance(tok.encode("b")[0])


def test_bad_schema_is_a_grammar_error_naming_the_problem(engine: GrammarEngine) -> None:
    with pytest.raises(GrammarError, match="strin"):
        engine.check(json_schema_grammar({"type": "object", "properties": {"a": {"type": "strin"}}}, True))
    unknown = {"type": "object", "properties": {"a": {"type": "string", "format": "zz"}}}
    with pytest.raises(GrammarError, match="format"):
        engine.check(json_schema_grammar(unknown, strict=True))
    engine.check(json_schema_grammar(unknown, strict=False))  # lenient: the keyword is ignored


@pytest.mark.parametrize("seed", range(4))
def test_random_model_decodes_valid_json_under_a_schema(
    tiny: object, engine: GrammarEngine, seed: int
) -> None:
    adapter = tiny
    prompt = adapter.text(ByteTokenizer().encode("<|im_start|>user\njson please<|im_end|>\n"))  # type: ignore[attr-defined]
    cache = adapter.empty_cache()  # type: ignore[attr-defined]
    with torch.inference_mode():
        logits = adapter.next_logits(prompt, cache, 0)  # type: ignore[attr-defined]
        params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, logprobs=True, top_logprobs=3)
        out = decode(
            adapter,  # type: ignore[arg-type]
            logits,
            cache,
            prompt.n_tokens,
            params,
            threading.Event(),
            constraint=engine.constraint(json_schema_grammar(SCHEMA, strict=True)),
        )
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len(out.logprobs) == len(out.tokens)
    for lp in out.logprobs:  # the model's own distribution: the top list is sorted and normalised
        values = [v for _, v in lp.top]
        assert len(values) == 3
        assert values == sorted(values, reverse=True)
        assert lp.logprob <= values[0] + 1e-6


def test_a_tokenizer_llguidance_cannot_read_is_a_grammar_error() -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
    )
    with pytest.raises(GrammarError, match="no grammar support"):
        GrammarEngine(words, [0], 2)
