"""Grammars and logit_bias in the engine's sampler, on the tiny demo model (its random
weights would never write a phone number or JSON by chance: every match is the mask's doing),
plus the grammar spec's and compiler's contracts."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from kvflow.stages.engine import (
    Engine,
    GrammarError,
    GrammarSpec,
    InvalidRequestError,
    SamplingParams,
)
from kvflow.stages.engine.grammar import MAX_GRAMMAR_CHARS
from tests.stages.engine.conftest import open_engine

PHONE = r"[0-9]{3}-[0-9]{4}"


def run(engine: Engine, rid: str, prompt: list[int], sampling: SamplingParams, **kw: object):
    engine.add_request(rid, prompt, sampling, **kw)  # type: ignore[arg-type]
    tokens, finish = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                finish = out.finish_reason or finish
    return tokens, finish


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Engine:
    return open_engine(tiny_dir)


def prompt_of(engine: Engine) -> list[int]:
    return engine.tokenizer.encode("Call me at ")


@pytest.mark.parametrize("seed", range(4))
def test_regex_output_matches_for_every_seed(engine: Engine, seed: int) -> None:
    sampling = SamplingParams(
        max_tokens=32, temperature=1.0, seed=seed, grammar=GrammarSpec("regex", PHONE)
    )
    tokens, finish = run(engine, f"phone-{seed}", prompt_of(engine), sampling)
    text = engine.tokenizer.decode(tokens)
    assert re.fullmatch(PHONE, text), text
    assert finish == "stop"  # the grammar ended it, not max_tokens


def test_json_schema_output_validates(engine: Engine) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    sampling = SamplingParams(
        max_tokens=256,  # the schema allows whitespace, which the tiny model writes a lot of
        temperature=0.8,
        seed=1,
        grammar=GrammarSpec("json_schema", json.dumps(schema)),
    )
    tokens, finish = run(engine, "json", prompt_of(engine), sampling)
    assert finish == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(tokens)), schema)


def test_without_a_grammar_the_tiny_model_writes_no_phone_number(engine: Engine) -> None:
    tokens, _ = run(engine, "free", prompt_of(engine), SamplingParams(max_tokens=8, seed=0))
    assert not re.fullmatch(PHONE, engine.tokenizer.decode(tokens))


def test_a_disaggregated_decode_continues_the_grammar_after_the_first_token(
    engine: Engine,
) -> None:
    spec = GrammarSpec("regex", PHONE)
    prompt = prompt_of(engine)
    first, _ = run(engine, "p", prompt, SamplingParams(max_tokens=1, grammar=spec))
    rest, finish = run(
        engine,
        "d",
        prompt + first,
        SamplingParams(max_tokens=31, grammar=spec),
        num_output_tokens=1,
    )
    assert re.fullmatch(PHONE, engine.tokenizer.decode(first + rest))
    assert finish == "stop"
    bad = engine.tokenizer.encode("x")
    with pytest.raises(InvalidRequestError, match="does not match its grammar"):
        engine.add_request("bad", prompt + bad, SamplingParams(grammar=spec), num_output_tokens=1)


def test_logit_bias_bans_and_forces(engine: Engine) -> None:
    prompt = prompt_of(engine)
    greedy, _ = run(engine, "g", prompt, SamplingParams(max_tokens=1))
    banned, _ = run(
        engine, "b", prompt, SamplingParams(max_tokens=1, logit_bias=((greedy[0], -100.0),))
    )
    assert banned != greedy
    forced, _ = run(engine, "f", prompt, SamplingParams(max_tokens=4, logit_bias=((7, 100.0),)))
    assert forced == [7, 7, 7, 7]


def test_bad_input_is_refused_before_any_page_is_taken(engine: Engine) -> None:
    vocab = engine.spec.vocab_size
    free_before = engine.num_free_pages
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("v", [1, 2], SamplingParams(logit_bias=((vocab, 1.0),)))
    with pytest.raises(GrammarError, match="invalid regex"):
        engine.add_request("r", [1, 2], SamplingParams(grammar=GrammarSpec("regex", "(")))
    with pytest.raises(GrammarError, match="invalid json_schema"):
        engine.add_request("j", [1, 2], SamplingParams(grammar=GrammarSpec("json_schema", "{")))
    assert not engine.has_unfinished()
    assert engine.num_free_pages == free_before


def test_spec_and_bias_validation() -> None:
    with pytest.raises(ValueError, match="grammar kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(ValueError, match="needs its source"):
        GrammarSpec("regex", "")
    with pytest.raises(ValueError, match="at most"):
        GrammarSpec("regex", "a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias=((1, 101.0),))
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias=((-1, 1.0),))
    assert SamplingParams(logit_bias=((3, 1),)).logit_bias == ((3, 1.0),)


def test_the_compiler_caches_and_is_thread_safe(engine: Engine) -> None:
    compiler = engine.grammars
    specs = [GrammarSpec("regex", f"[a-z]{{{i}}}") for i in range(1, 9)]
    errors: list[BaseException] = []

    def compile_all() -> None:
        try:
            for s in specs:
                compiler.compile(s)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=compile_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert compiler.compile(specs[0]) is compiler.compile(specs[0])
