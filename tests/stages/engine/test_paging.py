"""Paged KV equivalences: chunking, imported prefixes, batching, page export/import."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import Engine, InvalidRequestError, RequestOutput, SamplingParams
from tests.stages.engine.conftest import open_engine

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, 300, (n,), generator=gen)]


def _run(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def _tokens_logits(outs: list[RequestOutput]) -> tuple[list[int], list[torch.Tensor]]:
    tokens = [t for o in outs for t in o.new_token_ids]
    logits = [o.logits[0] for o in outs if o.logits is not None]
    return tokens, logits


def _single(
    engine: Engine, tokens: list[int], **kw: object
) -> tuple[list[int], list[torch.Tensor]]:
    engine.add_request("r", tokens, GREEDY, **kw)  # type: ignore[arg-type]
    return _tokens_logits(_run(engine)["r"])


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert float((x - y).abs().max()) <= tol


@pytest.mark.parametrize("chunk", [1, 5, 8, 13])
def test_chunked_prefill_equals_one_shot(llama_dir: Path, chunk: int) -> None:
    prompt = _prompt(45)
    ref_tokens, ref_logits = _single(open_engine(llama_dir, prefill_chunk=512), prompt)
    tokens, logits = _single(open_engine(llama_dir, prefill_chunk=chunk), prompt)
    assert tokens == ref_tokens
    # Different row counts take different fp32 GEMM kernels: ~1e-5 apart on logits of ~3.
    _close(logits, ref_logits, 5e-5)


@pytest.mark.parametrize("num_prefix", [8, 20, 39])
def test_imported_prefix_equals_full_prefill(llama_dir: Path, num_prefix: int) -> None:
    prompt = _prompt(40, seed=1)
    source = open_engine(llama_dir)
    source.add_request("src", prompt, SamplingParams(max_tokens=1), retain_pages=True)
    _run(source)
    n_pages = -(-num_prefix // source.block_size)
    pages = [source.export_page_bytes("src", i) for i in range(n_pages)]
    ref_tokens, ref_logits = _single(open_engine(llama_dir), prompt)
    target = open_engine(llama_dir)
    tokens, logits = _single(target, prompt, prefix_pages=pages, num_prefix_tokens=num_prefix)
    assert tokens == ref_tokens
    _close(logits, ref_logits, 1e-5)


def test_page_tensor_export_imports_into_second_engine(llama_dir: Path) -> None:
    prompt = _prompt(24, seed=2)
    first = open_engine(llama_dir)
    first.add_request("a", prompt, GREEDY, retain_pages=True)
    outs = _run(first)["a"]
    pages = [first.export_page("a", i).clone() for i in range(3)]
    assert all(p.is_contiguous() and tuple(p.shape) == first.page_shape for p in pages)
    assert all(p.dtype == first.page_dtype for p in pages)
    second = open_engine(llama_dir, num_pages=16)
    # Decode side of a disaggregated pair: prompt KV imported, the first token given.
    expected, expected_logits = _tokens_logits(outs)
    second.add_request(
        "b",
        [*prompt, expected[0]],
        SamplingParams(max_tokens=len(expected) - 1, ignore_eos=True),
        prefix_pages=pages,
        num_prefix_tokens=len(prompt),
    )
    tokens, logits = _tokens_logits(_run(second)["b"])
    assert tokens == expected[1:]
    for got, want in zip(logits, expected_logits[1:], strict=True):
        assert torch.equal(got, want)  # same KV bytes, same kernels: bit-identical
    first.release("a")
    assert first.num_free_pages == first.num_pages


def test_export_pages_on_the_cpu_are_the_pools_own_pages(llama_dir: Path) -> None:
    """`export_pages` (what the serving stages store and stream) hands out views into
    `host_pool`, which on the CPU is the pool itself: no copy."""
    engine = open_engine(llama_dir)
    assert engine.host_pool is engine.pool_tensor
    engine.add_request("a", _prompt(20, seed=4), GREEDY, retain_pages=True)
    _run(engine)
    pages = engine.export_pages("a", [2, 0])
    assert list(pages) == [2, 0]
    for b, view in pages.items():
        assert view.data_ptr() == engine.export_page("a", b).data_ptr()
    assert engine.export_pages("a", []) == {}
    with pytest.raises(InvalidRequestError, match="block_index 9 is out of range"):
        engine.export_pages("a", [0, 9])


def test_batched_decode_equals_one_at_a_time(llama_dir: Path) -> None:
    prompts = [_prompt(n, seed=10 + n) for n in (5, 17, 30, 9)]
    alone = [_single(open_engine(llama_dir), p) for p in prompts]
    engine = open_engine(llama_dir, prefill_chunk=16, max_batch=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    outs = _run(engine)
    for i, (ref_tokens, ref_logits) in enumerate(alone):
        tokens, logits = _tokens_logits(outs[f"r{i}"])
        assert tokens == ref_tokens
        _close(logits, ref_logits, 1e-4)


def test_requests_join_and_leave_between_steps(llama_dir: Path) -> None:
    engine = open_engine(llama_dir)
    engine.add_request("long", _prompt(10), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request("short", _prompt(6, 3), SamplingParams(max_tokens=2, ignore_eos=True))
    seen: list[set[str]] = []
    while engine.has_unfinished():
        seen.append({o.request_id for o in engine.step()})
    assert seen[0] == {"long", "short"}
    assert "short" not in set().union(*seen[2:])
    assert all("long" in s for s in seen)
    assert engine.num_free_pages == engine.num_pages


def test_completed_blocks_reported_once_each(tiny_dir: Path) -> None:
    engine = open_engine(tiny_dir, prefill_chunk=5)
    engine.add_request(
        "r", list(range(3, 23)), SamplingParams(max_tokens=10, ignore_eos=True), retain_pages=True
    )
    completed: list[int] = []
    last = 0
    for out in _run(engine)["r"]:
        completed.extend(out.completed_blocks)
        for b in out.completed_blocks:
            assert (b + 1) * 8 <= out.num_computed_tokens
            assert (b + 1) * 8 > last
        last = out.num_computed_tokens
    assert last == 29  # 20 prompt + 10 generated - the last one
    assert completed == [0, 1, 2]


def test_partial_imported_page_completes_later(tiny_dir: Path) -> None:
    src = open_engine(tiny_dir)
    prompt = list(range(3, 23))
    src.add_request("s", prompt, SamplingParams(max_tokens=1), retain_pages=True)
    _run(src)
    pages = [src.export_page_bytes("s", i) for i in range(2)]
    dst = open_engine(tiny_dir)
    dst.add_request(
        "d", prompt, SamplingParams(max_tokens=1), prefix_pages=pages, num_prefix_tokens=12
    )
    (out,) = _run(dst)["d"]
    assert out.completed_blocks == (1,)
    assert out.num_computed_tokens == 20


def test_exported_bytes_roundtrip_exactly(tiny_dir: Path) -> None:
    engine = open_engine(tiny_dir)
    engine.add_request("r", list(range(3, 20)), SamplingParams(max_tokens=1), retain_pages=True)
    _run(engine)
    raw = engine.export_page_bytes("r", 1)
    assert len(raw) == engine.page_nbytes
    view = engine.export_page("r", 1)
    rebuilt = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(view.dtype).view(view.shape)
    assert torch.equal(rebuilt, view)
    layer0 = view[0]
    assert layer0.is_contiguous()
    assert layer0.data_ptr() == view.data_ptr()
