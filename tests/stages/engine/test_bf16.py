"""bfloat16 engines against float32 on the equivalence tests' models and prompt: the weights
really are bf16, and the greedy choices mostly agree (teacher-forced top-1) with logits close.
The measured cost on the default model is in docs/performance.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.stages.engine.model import RMSNorm
from kvflow.stages.engine.onednn_linear import (
    ENV_LINEAR,
    OneDNNDenseLinear,
    OneDNNLinear,
    onednn_applies,
    use_onednn_linears,
)
from kvflow.tools.bench.precision import compare, equivalence_prompt
from tests.stages.engine.conftest import open_engine
from tests.stages.engine.hf_models import make_hf_model
from tests.stages.engine.test_hf_equivalence import CASES

TOKENS = 16


@pytest.mark.parametrize("case", ["llama", "qwen2-bias"])
def test_bf16_mostly_agrees_with_float32(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    model_dir = make_hf_model(tmp_path, arch, seed=3, **overrides)
    ref = open_engine(model_dir, prefill_chunk=16)
    cand = open_engine(model_dir, prefill_chunk=16, dtype="bfloat16")
    assert {p.dtype for p in cand.model.parameters()} == {torch.bfloat16}
    assert cand.page_dtype == torch.bfloat16
    result = compare(ref, cand, [equivalence_prompt()], TOKENS)
    # These random tiny models have close logits (near-ties), so bf16 rounding flips a few
    # greedy choices; measured 0.875-1.0 agreement and 0.11-0.38 max diff over the six
    # equivalence cases (two run here: plain, and with biases).
    # Any real defect (a bf16 op on the wrong path, a cast lost) lands far outside.
    assert result["agreement"] >= 0.75, result
    assert 0 < result["max_logit_diff"] <= 0.6, result  # > 0: bf16 really ran
    assert result["max_abs_logit"] > 3.0  # the diff's scale: logits are not all tiny


def test_onednn_linear_equals_nn_linear() -> None:
    gen = torch.Generator().manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(40, 96, generator=gen))
            if bias:
                linear.bias.copy_(torch.randn(40, generator=gen))
        x = torch.randn(5, 96, generator=gen).to(torch.bfloat16)
        holder = torch.nn.Sequential(linear)
        expected = linear(x).float()
        if not onednn_applies(torch.bfloat16, torch.device("cpu")):
            pytest.skip("this CPU has no native bf16 for oneDNN")
        assert use_onednn_linears(holder) == 1
        assert isinstance(holder[0], OneDNNLinear)
        got = holder[0](x).float()
        # The same products, summed in fp32 in a maybe different order: within bf16 rounding.
        assert torch.allclose(got, expected, rtol=1e-2, atol=0.1), (got - expected).abs().max()


def test_onednn_dense_linear_equals_f_linear() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    gen = torch.Generator().manual_seed(0)
    for bias in (False, True):
        for rows in (1, 5, 64):
            linear = torch.nn.Linear(96, 40, bias=bias)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(40, 96, generator=gen))
                if bias:
                    linear.bias.copy_(torch.randn(40, generator=gen))
            x = torch.randn(rows, 96, generator=gen)
            holder = torch.nn.Sequential(linear)
            expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
            assert use_onednn_linears(holder) == 1
            assert isinstance(holder[0], OneDNNDenseLinear)
            assert holder[0].weight is linear.weight  # no copy; the name still holds it
            got = holder[0](x)
            assert got.shape == expected.shape and got.dtype == torch.float32
            # float32 products summed in another order: within float32 rounding
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4), (got - expected).abs().max()


def test_onednn_where_it_applies(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert onednn_applies(torch.float32, cpu) == torch.backends.mkldnn.is_available()
    assert not onednn_applies(torch.float16, cpu)
    assert not onednn_applies(torch.bfloat16, torch.device("meta"))
    assert not onednn_applies(torch.float32, torch.device("meta"))
    f32 = open_engine(llama_dir)
    dense = [m for m in f32.model.modules() if isinstance(m, OneDNNDenseLinear)]
    assert bool(dense) == torch.backends.mkldnn.is_available()
    if dense:  # every linear swapped
        assert not any(isinstance(m, torch.nn.Linear) for m in f32.model.modules())
    # tied embeddings stay one tensor
    if f32.spec.tie_word_embeddings and dense:
        assert f32.model.lm_head.weight is f32.model.model.embed_tokens.weight
    monkeypatch.setenv(ENV_LINEAR, "aten")
    assert not onednn_applies(torch.float32, cpu)
    aten = open_engine(llama_dir)
    assert not any(isinstance(m, OneDNNDenseLinear) for m in aten.model.modules())
    monkeypatch.setenv(ENV_LINEAR, "bogus")
    with pytest.raises(ValueError, match=ENV_LINEAR):
        onednn_applies(torch.float32, cpu)
    monkeypatch.delenv(ENV_LINEAR)
    b16 = open_engine(llama_dir, dtype="bfloat16")
    swapped = any(isinstance(m, OneDNNLinear) for m in b16.model.modules())
    assert swapped == onednn_applies(torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_rms_norm_is_transformers_formula_bit_for_bit(dtype: torch.dtype) -> None:
    """The half-precision RMSNorm (F.rms_norm over the float32 upcast: fewer kernels on a GPU)
    equals transformers' h * rsqrt(mean(h^2) + eps) in float32, scaled in the half dtype."""
    gen = torch.Generator().manual_seed(0)
    for n in (576, 1024):
        norm = RMSNorm(n, 1e-5).to(dtype)
        norm.weight.data = (torch.randn(n, generator=gen) * 0.2 + 1).to(dtype)
        x = (torch.randn(64, n, generator=gen) * 3).to(dtype)
        h = x.to(torch.float32)
        ref = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        assert torch.equal(norm(x), ref)
