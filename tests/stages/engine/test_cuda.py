"""The engine on a CUDA device: the CPU equivalence checks run again with `device="cuda"`.

Never in the default run (marker `gpu`); `pytest -m gpu tests/stages/engine/test_cuda.py` on a
machine with a GPU. The device comes from ``KVFLOW_TEST_DEVICE`` (``cuda`` unless set), so the
same checks can be tried on ``cpu`` where no GPU is at hand. What a run on an H200 gave is in
BENCHMARKS.md ("The engine on a GPU").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvflow.stages.engine import Engine, ModelLoadError, PageLayoutError, SamplingParams
from kvflow.stages.engine import pages as pages_module
from kvflow.stages.engine.attention import PagedPrefill
from kvflow.stages.engine.model import RMSNorm
from kvflow.stages.engine.pages import KVLayout, PagePool
from kvflow.tools.bench.precision import equivalence_prompt, greedy, teacher_forced_hits
from tests.device import DEVICE, MARKS
from tests.stages.engine.conftest import open_engine
from tests.stages.engine.hf_models import hf_logits, make_hf_model
from tests.stages.engine.test_hf_equivalence import CASES
from tests.stages.engine.test_paging import _prompt, _run, _tokens_logits

pytestmark = MARKS

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _single(
    engine: Engine, tokens: list[int], rid: str = "r", **kw: object
) -> tuple[list[int], list[torch.Tensor]]:
    engine.add_request(rid, tokens, GREEDY, **kw)  # type: ignore[arg-type]
    outs = _run(engine)[rid]
    ids = [t for o in outs for t in o.new_token_ids]
    return ids, [o.logits[0].float().cpu() for o in outs if o.logits is not None]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b) > 0
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_weights_pages_and_logits_live_on_the_device(llama_dir: Path) -> None:
    engine = open_engine(llama_dir, device=DEVICE)
    want = torch.device(DEVICE).type
    assert {p.device.type for p in engine.model.parameters()} == {want}
    engine.add_request("r", _prompt(12), GREEDY, retain_pages=True)
    outs = _run(engine)["r"]
    assert outs[0].logits is not None and outs[0].logits.device.type == "cpu"  # the caller's
    assert engine.export_page("r", 0).device.type == want


def test_exported_pages_cross_to_a_host_mirror_of_the_pool(llama_dir: Path) -> None:
    """`export_pages` on a device engine: host views of a mirror of the pool (the segment a
    server registers), holding the device pages' bytes at the same page ids; a second engine
    that imports them continues exactly as the first."""
    engine = open_engine(llama_dir, device=DEVICE)
    prompt = _prompt(30, seed=6)
    engine.add_request("a", prompt, GREEDY, retain_pages=True)
    expected, _ = _tokens_logits(_run(engine)["a"])
    host = engine.host_pool
    assert host.device.type == "cpu" and host.shape == engine.pool_tensor.shape
    pages = engine.export_pages("a", range(3))
    nbytes = engine.page_nbytes
    for b, view in pages.items():
        device_page = engine.export_page("a", b)
        assert view.device.type == "cpu" and torch.equal(view, device_page.cpu())
        offset = view.data_ptr() - host.data_ptr()
        assert offset % nbytes == 0 and host[offset // nbytes].data_ptr() == view.data_ptr()
    second = open_engine(llama_dir, device=DEVICE, num_pages=16)
    second.add_request(
        "b",
        prompt,
        GREEDY,
        prefix_pages=[pages[b] for b in range(3)],
        num_prefix_tokens=24,
    )
    assert _tokens_logits(_run(second)["b"])[0] == expected


@pytest.mark.parametrize("case", ["llama", "llama3-rope", "mistral-sliding", "qwen2-bias"])
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    """The same bar as the CPU test (1e-4 on logits of ~3): transformers' float32 on CPU is the
    reference; kvflow runs on the device. TF32 stays off (torch's default for matmul)."""
    arch, overrides = CASES[case]
    model_dir = make_hf_model(tmp_path, arch, seed=3, **overrides)
    tokens = _prompt(37, seed=5)
    expected = hf_logits(model_dir, arch, tokens, steps=5)
    engine = open_engine(model_dir, device=DEVICE, prefill_chunk=16)
    engine.add_request("r", tokens, SamplingParams(max_tokens=6, ignore_eos=True))
    got = [o.logits[0].cpu() for o in _run(engine)["r"] if o.logits is not None]
    diff = _max_diff(got, expected)
    assert diff <= 1e-4, f"{case}: max abs diff {diff} against transformers"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_chunk_attention_equals_masked_reference(dtype: torch.dtype) -> None:
    """A chunk at an offset attends (lower-right causal bias on a GPU, flash for bf16) as one
    float32 attention under an explicit mask does, grouped heads included."""
    dev = torch.device(DEVICE)
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=str(dtype))
    pool = PagePool(16, layout, dtype, dev)
    pages = torch.tensor([5, 2, 9, 0, 12, 7, 3, 14], device=dev)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(120, 2, 64, generator=gen), torch.randn(120, 2, 64, generator=gen)
    q = torch.randn(50, 6, 64, generator=gen)
    on = {"device": dev, "dtype": dtype}
    PagedPrefill(pool, pages, 0, 70, None).attend(
        0, torch.zeros(70, 6, 64, **on), k[:70].to(**on), v[:70].to(**on)
    )
    got = PagedPrefill(pool, pages, 70, 50, None).attend(
        0, q.to(**on), k[70:].to(**on), v[70:].to(**on)
    )
    mask = torch.arange(120)[None, :] <= torch.arange(70, 120)[:, None]
    qh, kh, vh = (x.to(dtype).float().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    want = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)[0]
    diff = float((got.float().cpu() - want.transpose(0, 1).reshape(50, -1)).abs().max())
    assert diff <= (1e-5 if dtype == torch.float32 else 2e-2), diff


@pytest.mark.parametrize("chunk", [1, 13])
def test_chunked_prefill_equals_one_shot(llama_dir: Path, chunk: int) -> None:
    prompt = _prompt(45)
    ref = _single(open_engine(llama_dir, device=DEVICE, prefill_chunk=512), prompt)
    got = _single(open_engine(llama_dir, device=DEVICE, prefill_chunk=chunk), prompt)
    assert got[0] == ref[0]
    assert _max_diff(got[1], ref[1]) <= 5e-5


def test_cached_prefix_equals_recomputed(llama_dir: Path) -> None:
    """Pages exported as bytes (what kvdb stores) and imported give what a full prefill gives."""
    prompt = _prompt(40, seed=1)
    source = open_engine(llama_dir, device=DEVICE)
    source.add_request("src", prompt, SamplingParams(max_tokens=1), retain_pages=True)
    _run(source)
    pages = [source.export_page_bytes("src", i) for i in range(-(-39 // source.block_size))]
    ref = _single(open_engine(llama_dir, device=DEVICE), prompt)
    got = _single(
        open_engine(llama_dir, device=DEVICE), prompt, prefix_pages=pages, num_prefix_tokens=39
    )
    assert got[0] == ref[0]
    assert _max_diff(got[1], ref[1]) <= 1e-5


def test_pages_import_as_tensors_and_a_bad_one_is_named(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages import in batched transfers (bytes, host tensors and device tensors alike; two
    pages a transfer here, so five take three); a non-finite page among them is refused by
    its index, and the engine takes no page."""
    prompt = _prompt(40, seed=1)
    source = open_engine(llama_dir, device=DEVICE)
    source.add_request("src", prompt, SamplingParams(max_tokens=1), retain_pages=True)
    _run(source)
    raw = [source.export_page_bytes("src", i) for i in range(5)]
    monkeypatch.setattr(pages_module, "TRANSFER_BYTES", 2 * source.page_nbytes)
    shape, dtype = source.page_shape, source.page_dtype
    host = [torch.frombuffer(bytearray(b), dtype=dtype).view(shape) for b in raw]
    ref = _single(open_engine(llama_dir, device=DEVICE), prompt)
    for pages in (raw, host, [h.to(DEVICE) for h in host]):
        got = _single(
            open_engine(llama_dir, device=DEVICE), prompt, prefix_pages=pages, num_prefix_tokens=39
        )
        assert got[0] == ref[0]
        assert _max_diff(got[1], ref[1]) <= 1e-5
    bad = [h.clone() for h in host]
    bad[3][0, 0, 0, 0, 0] = float("nan")
    engine = open_engine(llama_dir, device=DEVICE)
    with pytest.raises(PageLayoutError, match="page 3: holds non-finite"):
        engine.add_request("r", prompt, GREEDY, prefix_pages=bad, num_prefix_tokens=39)
    assert engine.num_free_pages == engine.num_pages


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rms_norm_on_the_device_is_the_formula_to_one_rounding(dtype: torch.dtype) -> None:
    """On the CPU the half-precision RMSNorm equals transformers' formula bit for bit
    (test_bf16.py); on the device F.rms_norm is another kernel: within one rounding of the
    half dtype, nearly every element equal."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(1024, 1e-5).to(dtype)
    norm.weight.data = (torch.randn(1024, generator=gen) * 0.2 + 1).to(dtype)
    norm = norm.to(DEVICE)
    x = (torch.randn(64, 1024, generator=gen) * 3).to(dtype).to(DEVICE)
    h = x.to(torch.float32)
    ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    got = norm(x)
    torch.testing.assert_close(got, ref, rtol=torch.finfo(dtype).eps * 2, atol=0.0)
    assert float(got.eq(ref).float().mean()) >= 0.99


def test_pages_cross_between_cpu_and_device(llama_dir: Path) -> None:
    """A prefill on one device, the decode on the other (a disaggregated pair of mixed nodes):
    the page bytes mean the same on both, so the tokens match a local run on either."""
    prompt = _prompt(30, seed=2)
    n_pages = -(-29 // 8)
    for src_dev, dst_dev in ((DEVICE, "cpu"), ("cpu", DEVICE)):
        source = open_engine(llama_dir, device=src_dev)
        source.add_request("src", prompt, SamplingParams(max_tokens=1), retain_pages=True)
        _run(source)
        pages = [source.export_page_bytes("src", i) for i in range(n_pages)]
        ref = _single(open_engine(llama_dir, device=dst_dev), prompt)
        got = _single(
            open_engine(llama_dir, device=dst_dev), prompt, prefix_pages=pages, num_prefix_tokens=29
        )
        assert got[0] == ref[0], (src_dev, dst_dev)
        assert _max_diff(got[1], ref[1]) <= 1e-4, (src_dev, dst_dev)


def test_batched_decode_equals_one_at_a_time(llama_dir: Path) -> None:
    prompts = [_prompt(n, seed=10 + n) for n in (5, 17, 30, 9)]
    alone = [_single(open_engine(llama_dir, device=DEVICE), p) for p in prompts]
    engine = open_engine(llama_dir, device=DEVICE, prefill_chunk=16, max_batch=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    outs = _run(engine)
    for i, (ref_tokens, ref_logits) in enumerate(alone):
        tokens = [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        logits = [o.logits[0].cpu() for o in outs[f"r{i}"] if o.logits is not None]
        assert tokens == ref_tokens
        assert _max_diff(logits, ref_logits) <= 1e-4


def test_shared_prompt_pages_equal_private_copies(llama_dir: Path) -> None:
    """Requests that share their imported prompt pages by key (one copy, cascade attention in
    decode) produce what each produces alone with a full prefill."""
    prefix = _prompt(16, seed=4)
    source = open_engine(llama_dir, device=DEVICE)
    source.add_request("src", prefix, SamplingParams(max_tokens=1), retain_pages=True)
    _run(source)
    pages = [source.export_page_bytes("src", i) for i in range(2)]
    prompts = [prefix + _prompt(5, seed=20 + i) for i in range(3)]
    alone = [_single(open_engine(llama_dir, device=DEVICE), p)[0] for p in prompts]
    engine = open_engine(llama_dir, device=DEVICE)
    for i, prompt in enumerate(prompts):
        keys = [("block", tuple(prompt[: (b + 1) * 8])) for b in range(len(prompt) // 8)]
        engine.add_request(
            f"s{i}", prompt, GREEDY, prefix_pages=pages, num_prefix_tokens=16, block_keys=keys
        )
    assert engine.num_shared_pages == 2
    outs = _run(engine)
    for i in range(3):
        assert [t for o in outs[f"s{i}"] for t in o.new_token_ids] == alone[i]


def test_seeded_sampling_repeats_on_the_device(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = open_engine(llama_dir, device=DEVICE)
        engine.add_request("r", _prompt(20, seed=3), params)
        runs.append([t for o in _run(engine)["r"] for t in o.new_token_ids])
    assert runs[0] == runs[1] and len(runs[0]) == 12


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precisions_mostly_agree_with_float32(tmp_path: Path, dtype: str) -> None:
    arch, overrides = CASES["llama"]
    model_dir = make_hf_model(tmp_path, arch, seed=3, **overrides)
    ref = open_engine(model_dir, device=DEVICE, prefill_chunk=16)
    cand = open_engine(model_dir, device=DEVICE, prefill_chunk=16, dtype=dtype)
    assert {p.dtype for p in cand.model.parameters()} == {getattr(torch, dtype)}
    prompt = equivalence_prompt()
    ref_tokens, _ = greedy(ref, "ref", prompt, 16)
    hits = teacher_forced_hits(cand, "tf", prompt, ref_tokens)
    # As on CPU (test_bf16): near-ties in these random tiny models flip a few greedy choices.
    assert hits / 16 >= 0.75, (dtype, hits)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_weight_only_int_refused_with_the_reason(llama_dir: Path, dtype: str) -> None:
    if torch.device(DEVICE).type == "cpu":
        pytest.skip("int8/int4 run on the CPU; the refusal is a device's")
    with pytest.raises(ModelLoadError, match="use bfloat16 or float16"):
        open_engine(llama_dir, device=DEVICE, dtype=dtype)


def test_decode_never_takes_cudnn_attention(llama_dir: Path) -> None:
    """cuDNN's attention builds a plan for each new key length, and every decode step is one
    (4.8 ms of CPU a layer on an H200): the engine keeps it out of the kernels SDPA may pick."""
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("cuDNN is a CUDA backend")
    from torch.profiler import ProfilerActivity, profile

    engine = open_engine(llama_dir, device=DEVICE, dtype="bfloat16")
    engine.add_request("r", _prompt(20), SamplingParams(max_tokens=8, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(engine)
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names  # the profile saw the attention
    assert not any("cudnn_attention" in n for n in names), sorted(names)
