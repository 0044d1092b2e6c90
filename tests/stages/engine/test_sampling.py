"""Sampling parameters, seeded sampling and stop conditions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import EngineConfig, SamplingParams
from kvflow.stages.engine.sampler import (
    argmax_rows,
    draw,
    plain_greedy,
    plain_sampled,
    sample,
    sample_rows,
)
from tests.stages.engine.conftest import open_engine


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**64}, "seed"),  # overflowed torch's manual_seed deep in a step (a 500)
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"dtype": "int3"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"num_pages": -1}, "num_pages"),
        ({"prefill_chunk": 0}, "prefill_chunk"),
        ({"max_batch": 0}, "max_batch"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"device": "nonsense"}, "device"),
    ],
)
def test_engine_config_validation(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_engine_devices_are_the_servers() -> None:
    """The server's torch-free device check and the engine's accept the same names; the
    engine's also refuses, in one line, a CUDA device this process does not have."""
    from kvflow.stages.engine.config import DEVICE_FORM, require_device
    from kvflow.stages.serve.config import DEVICE_PATTERN

    assert DEVICE_FORM.pattern == DEVICE_PATTERN.pattern
    assert require_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'tpu': an engine runs on 'cpu' or 'cuda"):
        require_device("tpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"'cuda:{count}'"):
        require_device(f"cuda:{count}")


def test_top_k_one_is_greedy_and_top_p_keeps_head() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    greedy = logits.argmax(-1).tolist()
    top1 = [SamplingParams(temperature=1.0, top_k=1)] * 4
    assert sample(logits, top1, [torch.Generator().manual_seed(i) for i in range(4)]) == greedy
    tiny_p = [SamplingParams(temperature=2.0, top_p=1e-6)] * 4
    assert sample(logits, tiny_p, [torch.Generator().manual_seed(i) for i in range(4)]) == greedy


def test_top_k_restricts_support() -> None:
    logits = torch.arange(10, dtype=torch.float32)[None]
    params = [SamplingParams(temperature=5.0, top_k=3)]
    gen = torch.Generator().manual_seed(1)
    seen = {sample(logits, params, [gen])[0] for _ in range(200)}
    assert seen == {7, 8, 9}


def test_seeded_sampling_reproducible(tiny_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9, seed=7, ignore_eos=True)
    first = open_engine(tiny_dir).generate([[3, 4, 5]], params)
    again = open_engine(tiny_dir).generate([[3, 4, 5]], params)
    other = open_engine(tiny_dir).generate(
        [[3, 4, 5]],
        SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9, seed=8, ignore_eos=True),
    )
    assert first == again
    assert first != other


def test_stop_token_and_length(llama_dir: Path) -> None:
    engine = open_engine(llama_dir)
    (greedy,) = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(greedy) == 5 and greedy[1] != greedy[0]
    engine.add_request("s", [3, 4, 5], SamplingParams(max_tokens=5, stop_token_ids=(greedy[1],)))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert [t for o in outs for t in o.new_token_ids] == greedy[:2]
    assert outs[-1].finish_reason == "stop"


def test_eos_stops_unless_ignored(tiny_dir: Path) -> None:
    engine = open_engine(tiny_dir)
    (greedy,) = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    # Make the first greedy token the EOS by opening the same weights with a patched spec.
    engine.spec = engine.spec.__class__(**{**engine.spec.__dict__, "eos_token_ids": (greedy[0],)})
    assert engine.eos_token_id == greedy[0]
    assert engine.generate([[3, 4, 5]], SamplingParams(max_tokens=3)) == [[greedy[0]]]
    assert engine.generate([[3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True)) == [greedy]


def test_max_model_len_ends_generation(tiny_dir: Path) -> None:
    engine = open_engine(tiny_dir, max_model_len=12)
    engine.add_request("r", list(range(3, 13)), SamplingParams(max_tokens=50, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    assert sum(len(o.new_token_ids) for o in outs) == 2
    assert outs[-1].finish_reason == "length"


def test_argmax_rows_is_what_sample_picks_for_plain_greedy_rows() -> None:
    """The decode batch's one reduction (argmax_rows) against `sample` row by row: NaN rows,
    ties (the lowest id), -inf and a row that is all NaN."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen)
    logits[1, 7] = logits[1, 30] = 9.0  # a tie: the lowest id
    logits[2, 4] = float("nan")
    logits[3, :] = float("nan")
    logits[4, 11] = float("-inf")
    logits[5, 20] = float("inf")
    greedy = SamplingParams()
    assert plain_greedy(greedy, None)
    assert not plain_greedy(SamplingParams(temperature=0.5), None)
    assert not plain_greedy(SamplingParams(repetition_penalty=1.2), None)
    assert not plain_greedy(SamplingParams(logit_bias=((3, 1.0),)), None)
    want = sample(logits, [greedy] * 6, [None] * 6)
    assert argmax_rows(logits) == want and want[1] == 7 and want[5] == 20


def test_draw_follows_the_distribution_and_never_draws_a_zero() -> None:
    """One uniform number a row: the frequencies of 20,000 draws are the probabilities
    (within 5 standard errors), a token of probability 0 never comes, and the first and
    last tokens can."""
    probs = torch.tensor([0.1, 0.0, 0.45, 0.0, 0.3, 0.15])
    gen = torch.Generator().manual_seed(5)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]), minlength=6)
    assert counts[1] == counts[3] == 0
    stderr = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 5 * stderr + 1e-9).all(), counts
    edges = torch.tensor([0.5, 0.0, 0.5])
    assert {draw(edges, gen) for _ in range(200)} == {0, 2}


def test_sample_rows_draws_what_sample_draws_row_by_row() -> None:
    """The decode batch's sampled rows at once (sample_rows) against `sample` row by row,
    each row with its own temperature and seeded generator: the same tokens, and the
    generators left in the same states (a row that is not finite falls back to its argmax
    and draws nothing, as one by one)."""
    n, vocab = 12, 3000
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(4)) * 4
    logits[3, :] = float("nan")
    logits[5, :] = float("-inf")
    logits[7, 9] = float("nan")
    temps = [0.2 + 0.15 * i for i in range(n)]

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(n)]

    batch, alone = gens(), gens()
    got = sample_rows(logits, temps, batch)
    want = [
        sample(logits[r : r + 1], [SamplingParams(temperature=temps[r])], [alone[r]])[0]
        for r in range(n)
    ]
    assert got == want
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(batch, alone, strict=True))
    assert len(set(sample_rows(logits[:1].expand(64, vocab), [1.0] * 64, (gens() * 6)[:64]))) > 1
    assert plain_sampled(SamplingParams(temperature=0.7), None)
    assert not plain_sampled(SamplingParams(), None)  # greedy
    for fields in ({"top_k": 5}, {"top_p": 0.9}, {"presence_penalty": 0.5}):
        assert not plain_sampled(SamplingParams(temperature=0.7, **fields), None)


def test_a_decode_batch_samples_each_row_as_alone(tiny_dir: Path) -> None:
    """Seeded requests at a temperature decoded together (their rows drawn at once) give
    each the tokens it gets alone, beside a greedy row and a top-p row."""
    prompts = [[3, 4, 5], [9, 8, 7, 6], [11, 12], [20, 21, 22], [5, 5, 5, 5, 5]]
    params = [
        SamplingParams(max_tokens=10, temperature=0.8 + 0.1 * i, seed=40 + i, ignore_eos=True)
        for i in range(3)
    ]
    params.append(SamplingParams(max_tokens=10, ignore_eos=True))
    params.append(
        SamplingParams(max_tokens=10, temperature=1.2, top_p=0.8, seed=3, ignore_eos=True)
    )
    engine = open_engine(tiny_dir)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    together: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    batches = []
    while engine.has_unfinished():
        outs = engine.step()
        batches.append(sum(1 for o in outs if o.new_token_ids))
        for o in outs:
            together[o.request_id] += o.new_token_ids
    assert max(batches) == len(prompts)  # they decoded in one batch
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        assert together[f"r{i}"] == open_engine(tiny_dir).generate([prompt], p)[0]
