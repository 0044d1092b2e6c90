"""Penalties change what is sampled by their rules; output and prompt logprobs are the model's
raw log-softmax, and prompt logprobs cover what the engine computes (not an imported prefix)."""

from __future__ import annotations

import pytest
import torch

from kvflow.stages.engine import SamplingParams
from kvflow.stages.engine.sampler import apply_penalties
from tests.stages.engine.conftest import open_engine


def _run(engine, rid, prompt, sampling, **kw):
    engine.add_request(rid, prompt, sampling, **kw)
    outs = []
    while engine.has_unfinished():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs


def test_apply_penalties_rules() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # prompt [0, 1]; generated [2, 2, 4]
    out = apply_penalties(logits, [0, 1, 2, 2, 4], 2, p)
    expected = torch.tensor(
        [2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.5 * 2 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25]
    )
    assert torch.allclose(out, expected)
    assert torch.equal(logits, torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0]))  # not modified


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
    ],
)
def test_engine_samples_from_penalized_logits(llama_dir, params) -> None:
    prompt = [5, 6, 7, 8, 9, 5, 6]
    plain = _run(open_engine(llama_dir), "a", prompt, SamplingParams(max_tokens=24))
    engine = open_engine(llama_dir)
    outs = _run(engine, "b", prompt, SamplingParams(max_tokens=24, **params))
    tokens = [o.new_token_ids[0] for o in outs]
    assert tokens != [o.new_token_ids[0] for o in plain]
    history = list(prompt)
    p = SamplingParams(**params)
    for out, tok in zip(outs, tokens, strict=True):
        assert int(apply_penalties(out.logits[0], history, len(prompt), p).argmax()) == tok
        history.append(tok)


def test_output_logprobs(llama_dir) -> None:
    engine = open_engine(llama_dir)
    outs = _run(engine, "a", [5, 6, 7, 8], SamplingParams(max_tokens=6, logprobs=3))
    for out in outs:
        (lp,) = out.logprobs
        ref = torch.log_softmax(out.logits[0], -1)
        assert lp.token_id == out.new_token_ids[0]
        assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-6)
        assert lp.rank == 1  # greedy without penalties takes the most likely token
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
        assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
    none = _run(open_engine(llama_dir), "b", [5, 6, 7, 8], SamplingParams(max_tokens=2))
    assert all(o.logprobs == () and o.prompt_logprobs == () for o in none)


def _hf_prompt_logprobs(model_dir, prompt) -> list[float]:
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]


def test_prompt_logprobs_over_chunks_and_after_a_prefix(llama_dir) -> None:
    prompt = [(7 * i + 3) % 290 + 3 for i in range(40)]
    ref = _hf_prompt_logprobs(llama_dir, prompt)
    sampling = SamplingParams(max_tokens=2, prompt_logprobs=2)
    engine = open_engine(llama_dir, prefill_chunk=16)  # 3 chunks of the 40-token prompt
    outs = _run(engine, "a", prompt, sampling, retain_pages=True)
    got: dict[int, float] = {}
    for out in outs:
        for i, lp in enumerate(out.prompt_logprobs):
            pos = out.prompt_logprobs_start + i
            assert lp.token_id == prompt[pos] and pos not in got
            assert len(lp.top) == 2
            got[pos] = lp.logprob
    assert sorted(got) == list(range(1, 40))
    assert max(abs(got[p] - ref[p - 1]) for p in got) < 1e-4
    # An imported prefix of 16 tokens (2 pages of 8): positions 17.. only.
    pages = [engine.export_page_bytes("a", i) for i in range(2)]
    engine.release("a")
    outs = _run(engine, "b", prompt, sampling, prefix_pages=pages, num_prefix_tokens=16)
    positions = [o.prompt_logprobs_start + i for o in outs for i in range(len(o.prompt_logprobs))]
    assert positions == list(range(17, 40))
    lps = [lp.logprob for o in outs for lp in o.prompt_logprobs]
    assert max(abs(a - ref[p - 1]) for a, p in zip(lps, positions, strict=True)) < 1e-4


def test_sampling_params_validation() -> None:
    for bad in (
        {"repetition_penalty": 0.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
        {"logprobs": True},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
