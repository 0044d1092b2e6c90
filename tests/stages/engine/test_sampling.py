"""Sampling parameters, seeded sampling and stop conditions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import EngineConfig, SamplingParams
from kvflow.stages.engine.sampler import argmax_rows, plain_greedy, sample
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
