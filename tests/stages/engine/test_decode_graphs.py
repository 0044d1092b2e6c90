"""Decode steps in fixed shapes (decode_graphs.py) against the eager decode path.

On the CPU the "static" mode runs the padded forward that a CUDA graph captures, so these
tests check the buckets, the padding rows and the spare page in the default run. With
``KVFLOW_TEST_DEVICE=cuda`` the same tests also run "auto" (captured graphs, replayed) on the
GPU, and the replay is compared with the static forward it captured.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import Engine, EngineConfig, SamplingParams, decode_graphs
from kvflow.stages.engine.decode_graphs import DecodeGraphs, bucket
from kvflow.stages.engine.sequence import RequestOutput
from tests.stages.engine.conftest import open_engine
from tests.stages.engine.hf_models import make_hf_model
from tests.stages.engine.test_paging import _prompt, _run

DEVICE = os.environ.get("KVFLOW_TEST_DEVICE", "cpu")
MODES = ["static", "auto"] if DEVICE.startswith("cuda") else ["static"]

pytestmark = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False)",
)


def _tokens_logits(outs: list[RequestOutput]) -> tuple[list[int], list[torch.Tensor]]:
    tokens = [t for o in outs for t in o.new_token_ids]
    return tokens, [o.logits[0].float().cpu() for o in outs if o.logits is not None]


def _serve(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, tuple]:
    """Requests arriving over the first steps (the batch grows, then shrinks as they end)."""
    outs: dict[str, list[RequestOutput]] = {}
    pending = list(enumerate(zip(prompts, max_tokens, strict=True)))
    while pending or engine.has_unfinished():
        if pending:
            i, (prompt, n) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return {rid: _tokens_logits(o) for rid, o in outs.items()}


def _agree(got: dict[str, tuple], ref: dict[str, tuple], tol: float) -> None:
    assert got.keys() == ref.keys()
    for rid, (tokens, logits) in ref.items():
        assert got[rid][0] == tokens, rid
        assert len(got[rid][1]) == len(logits)
        diff = max(float((a - b).abs().max()) for a, b in zip(got[rid][1], logits, strict=True))
        assert diff <= tol, (rid, diff)


def test_bucket_is_the_next_power_of_two_within_the_limit() -> None:
    assert [bucket(n, 32) for n in (1, 2, 3, 4, 5, 17, 32)] == [1, 2, 4, 4, 8, 32, 32]
    assert bucket(3, 3) == 3 and bucket(5, 6) == 6


def test_unknown_mode_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"decode_graphs must be one of .*'static'.*'bogus'"):
        EngineConfig(decode_graphs="bogus")


@pytest.mark.parametrize("mode", MODES)
def test_growing_and_shrinking_batches_equal_eager_decode(llama_dir: Path, mode: str) -> None:
    """Batches of 1-3 rows (max_batch 3: a bucket that is no power of two) whose page lists
    cross the 1, 2, 4 and 8 page buckets, requests joining and finishing at different steps."""
    prompts = [_prompt(n, seed=40 + n) for n in (5, 17, 30, 9)]
    lengths = [60, 12, 25, 20]  # r0 decodes alone at the end
    ref = _serve(
        open_engine(llama_dir, device=DEVICE, decode_graphs="off", max_batch=3), prompts, lengths
    )
    engine = open_engine(llama_dir, device=DEVICE, decode_graphs=mode, max_batch=3)
    _agree(_serve(engine, prompts, lengths), ref, tol=1e-4)
    buckets = engine.decode_graph_buckets
    assert {b for b, _ in buckets} == {1, 2, 3}
    assert {p for _, p in buckets} >= {4, 8}  # prompts of 17-30 tokens: 3-8 pages of 8


@pytest.mark.parametrize("mode", MODES)
def test_sliding_window_and_shared_prefix_equal_eager_decode(tmp_path: Path, mode: str) -> None:
    """A Mistral with an 8-token window (the mask hides early keys) over prompts that import
    the same two prefix pages by key: the rows hold the same page ids."""
    model_dir = make_hf_model(tmp_path, "mistral", seed=3, sliding_window=8, head_dim=32)
    prefix = _prompt(16, seed=4)
    source = open_engine(model_dir, device=DEVICE)
    source.add_request("src", prefix, SamplingParams(max_tokens=1), retain_pages=True)
    _run(source)
    pages = [source.export_page_bytes("src", i) for i in range(2)]
    prompts = [prefix + _prompt(5 + i, seed=20 + i) for i in range(3)]

    def run(decode_graphs: str) -> dict[str, tuple]:
        engine = open_engine(model_dir, device=DEVICE, decode_graphs=decode_graphs)
        for i, prompt in enumerate(prompts):
            keys = [("block", tuple(prompt[: (b + 1) * 8])) for b in range(len(prompt) // 8)]
            sampling = SamplingParams(max_tokens=14, ignore_eos=True)
            engine.add_request(
                f"s{i}", prompt, sampling, prefix_pages=pages, num_prefix_tokens=16, block_keys=keys
            )
        assert engine.num_shared_pages == 2
        return {rid: _tokens_logits(o) for rid, o in _run(engine).items()}

    _agree(run(mode), run("off"), tol=1e-4)


def test_padding_rows_write_only_the_spare_page(llama_dir: Path) -> None:
    """Three rows in a bucket of four: the padding row writes its K/V into the spare page
    after the pool's pages, never into a page a request could hold."""
    engine = open_engine(llama_dir, device=DEVICE, decode_graphs="static", max_batch=4)
    pool = engine._pool.tensor
    assert pool.shape[0] == engine.num_pages + 1
    for i in range(3):
        engine.add_request(f"r{i}", _prompt(6, seed=i), SamplingParams(max_tokens=3))
    _run(engine)
    assert (4, 1) in engine.decode_graph_buckets
    spare = pool[engine.num_pages]
    assert bool(spare[:, :, :, 0].ne(0).any())  # the padding row's slot 0, every layer
    assert not bool(spare[:, :, :, 1:].ne(0).any())  # nothing else of it
    assert not bool(pool[3 : engine.num_pages].ne(0).any())  # pages no request took: untouched


def test_off_and_eager_devices_build_no_buckets(llama_dir: Path) -> None:
    engine = open_engine(llama_dir, device=DEVICE, decode_graphs="off")
    engine.add_request("r", _prompt(6), SamplingParams(max_tokens=3))
    _run(engine)
    assert engine.decode_graph_buckets == [] and engine._pool.tensor.shape[0] == engine.num_pages


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="graphs are captured on CUDA only")
def test_replayed_graphs_equal_the_forward_they_captured(llama_dir: Path) -> None:
    """A graph replays exactly the static forward's kernels: the same tokens, the same logits
    to float32 rounding of identical kernels."""
    prompts = [_prompt(n, seed=60 + n) for n in (7, 19, 26)]
    lengths = [30, 20, 24]
    ref = _serve(open_engine(llama_dir, device=DEVICE, decode_graphs="static"), prompts, lengths)
    engine = open_engine(llama_dir, device=DEVICE, decode_graphs="auto")
    _agree(_serve(engine, prompts, lengths), ref, tol=1e-6)
    assert engine.decode_graph_buckets
    assert all(b.graph is not None for b in engine._runner.graphs._buckets.values())


def test_a_bucket_that_cannot_be_built_leaves_decode_eager(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket whose build fails (out of device memory, an op the installed torch cannot
    capture) fails no request: it is logged once and its steps decode eagerly, with the
    eager path's tokens."""
    prompts = [_prompt(n, seed=70 + n) for n in (6, 13)]
    ref = _serve(open_engine(llama_dir, device=DEVICE, decode_graphs="off"), prompts, [9, 9])

    def refuse(self: DecodeGraphs, batch: int, pages: int) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_build", refuse)
    engine = open_engine(llama_dir, device=DEVICE, decode_graphs="static")
    with caplog.at_level(logging.WARNING, logger="kvflow.stages.engine.decode_graphs"):
        _agree(_serve(engine, prompts, [9, 9]), ref, tol=1e-4)
    warned = [r.getMessage() for r in caplog.records if "not built, eager" in r.getMessage()]
    assert warned and len(set(warned)) == len(warned)  # each bucket once, not once a step
    assert all("not permitted" in w for w in warned)
    assert engine.decode_graph_buckets == []


def test_rows_past_the_capture_length_decode_eagerly(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CAPTURE_TOKENS at 16 (2 pages of 8), a batch with a row past 16 tokens decodes
    eagerly; the tokens are the eager path's all along."""
    monkeypatch.setattr(decode_graphs, "CAPTURE_TOKENS", 16)
    prompts = [_prompt(n, seed=80 + n) for n in (4, 11)]
    ref = _serve(open_engine(llama_dir, device=DEVICE, decode_graphs="off"), prompts, [20, 20])
    engine = open_engine(llama_dir, device=DEVICE, decode_graphs="static")
    _agree(_serve(engine, prompts, [20, 20]), ref, tol=1e-4)
    assert engine.decode_graph_buckets and all(p <= 2 for _, p in engine.decode_graph_buckets)
