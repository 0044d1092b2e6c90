"""Prompt blocks shared by key: requests with the same block keys hold the same pool pages,
a decode batch attends to its shared pages once (cascade), and the answers are those of
private copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.stages.engine import Engine, InvalidRequestError, SamplingParams
from kvflow.stages.engine.attention import PagedDecode, gather_context, shared_groups
from kvflow.stages.engine.cpu_attn import ENV_ATTN
from tests.stages.engine.conftest import open_engine

BS = 8
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, 300, (n,), generator=gen)]


def _keys(tokens: list[int]) -> list[tuple[int, ...]]:
    """Chained keys: key i names every token up to the end of block i."""
    return [tuple(tokens[: (i + 1) * BS]) for i in range(len(tokens) // BS)]


def _prefix_pages(engine: Engine, prefix: list[int]) -> list[torch.Tensor]:
    """The prefix's pages, computed by a request of its own (then released)."""
    engine.add_request("p", [*prefix, 5], SamplingParams(max_tokens=1), retain_pages=True)
    while engine.has_unfinished():
        engine.step()
    pages = [engine.export_page("p", b).clone() for b in range(len(prefix) // BS)]
    engine.release("p")
    return pages


def _serve(engine: Engine, prompts: list[list[int]], pages: list[torch.Tensor], keyed: bool):
    """Every prompt with the imported prefix, all in one decode batch; tokens and logits."""
    n = len(pages) * BS
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"r{i}",
            prompt,
            GREEDY,
            prefix_pages=pages,
            num_prefix_tokens=n,
            block_keys=_keys(prompt) if keyed else (),
        )
    shared = engine.num_shared_pages
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.logits is not None:
                logits.setdefault(out.request_id, []).append(out.logits[0])
    return shared, tokens, logits


def test_shared_prefix_pages_answer_as_private_copies(llama_dir: Path) -> None:
    prefix = _tokens(3 * BS, seed=1)
    prompts = [prefix + _tokens(5 + i, seed=10 + i) for i in range(4)]
    engine = open_engine(llama_dir)
    pages = _prefix_pages(engine, prefix)
    free = engine.num_free_pages
    shared, tokens, logits = _serve(engine, prompts, pages, keyed=True)
    assert shared == 3  # the first request's copies, held by all four
    assert engine.num_free_pages == free and engine.num_shared_pages == 0
    _, private_tokens, private_logits = _serve(engine, prompts, pages, keyed=False)
    assert tokens == private_tokens
    for rid, mine in logits.items():
        for a, b in zip(mine, private_logits[rid], strict=True):
            assert float((a - b).abs().max()) < 1e-4


def test_shared_pages_stay_until_their_last_holder_leaves(llama_dir: Path) -> None:
    prefix = _tokens(2 * BS, seed=2)
    engine = open_engine(llama_dir)
    pages = _prefix_pages(engine, prefix)
    free = engine.num_free_pages
    long = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(3):
        prompt = prefix + _tokens(3, seed=20 + i)
        engine.add_request(
            f"r{i}",
            prompt,
            long,
            prefix_pages=pages,
            num_prefix_tokens=2 * BS,
            block_keys=_keys(prompt),
        )
    # 2 shared pages, and each request's own 3 (19 + 20 - 1 KV tokens)
    assert free - engine.num_free_pages == 2 + 3 * 3
    engine.abort("r0")
    engine.abort("r1")
    engine.step()
    assert engine.num_free_pages == free - 2 - 3 and engine.num_shared_pages == 0
    engine.abort("r2")
    engine.step()
    assert engine.num_free_pages == free
    # the key left with its page: a new request copies the block again
    prompt = [*prefix, 7]
    engine.add_request(
        "again",
        prompt,
        GREEDY,
        prefix_pages=pages,
        num_prefix_tokens=2 * BS,
        block_keys=_keys(prompt),
    )
    assert engine.num_shared_pages == 0


def test_computed_blocks_are_shared_with_later_requests(llama_dir: Path) -> None:
    prefix = _tokens(2 * BS, seed=3)
    engine = open_engine(llama_dir)
    first = [*prefix, 9, 10]
    engine.add_request(
        "a", first, SamplingParams(max_tokens=30, ignore_eos=True), block_keys=_keys(first)
    )
    engine.step()  # the prompt computed: both blocks offered
    pages = [engine.export_page("a", b).clone() for b in range(2)]
    second = [*prefix, 11]
    engine.add_request(
        "b", second, GREEDY, prefix_pages=pages, num_prefix_tokens=2 * BS, block_keys=_keys(second)
    )
    assert engine.num_shared_pages == 2


def test_more_keys_than_full_blocks_is_refused(llama_dir: Path) -> None:
    engine = open_engine(llama_dir)
    prompt = _tokens(2 * BS + 3, seed=4)
    free = engine.num_free_pages
    with pytest.raises(InvalidRequestError, match="3 block keys"):
        engine.add_request("r", prompt, GREEDY, block_keys=[*_keys(prompt), ("x",)])
    assert engine.num_free_pages == free


@pytest.mark.parametrize("attention", ["torch", "paged"])
def test_cascade_decode_equals_one_attention(
    llama_dir: Path, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PagedDecode over a batch of two groups that start with the same pages and a row of
    its own: the two-part attention (torch's path; the CPU kernel reads every row's pages
    in place) gives the one-part answer for every row."""
    monkeypatch.setenv(ENV_ATTN, attention)
    engine = open_engine(llama_dir, num_pages=16)
    pool = engine._pool  # the attention backend is built on the pool
    gen = torch.Generator().manual_seed(5)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))
    rows = [[0, 1, 2, 3], [0, 1, 4, 5], [8, 9, 10, 10], [8, 11, 12, 13], [14, 15, 14, 14]]
    table = torch.tensor(rows)
    positions = torch.tensor([3 * BS + 2, 2 * BS + 5, 2 * BS + 1, 4 * BS - 1, BS + 3])
    groups = shared_groups(rows, positions.tolist(), BS, None)
    assert groups == [([0, 1], 2), ([2, 3], 1)]
    assert shared_groups(rows, positions.tolist(), BS, window=3 * BS) == []
    spec = engine.spec
    heads, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    b = len(rows)
    q = torch.randn(b, heads, d, generator=gen)
    k, v = torch.randn(b, kvh, d, generator=gen), torch.randn(b, kvh, d, generator=gen)
    out = PagedDecode(pool, table, positions, None).attend(0, q, k, v)
    ctx = gather_context(pool.tensor, 0, table)  # k/v were written by attend
    for row in range(b):
        n = int(positions[row]) + 1
        qg = q[row].reshape(kvh, heads // kvh, d)
        ref = torch.nn.functional.scaled_dot_product_attention(
            qg, ctx[0, row, :, :n], ctx[1, row, :, :n], enable_gqa=True
        )
        assert torch.allclose(out[row], ref.reshape(-1), atol=1e-5)
