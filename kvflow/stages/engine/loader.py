"""Loading a Hugging Face model directory: weights from safetensors (single file or sharded
with `model.safetensors.index.json`) into a `CausalLM`, and the model's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvflow.stages.engine.cpu_attn import attn_setting
from kvflow.stages.engine.cpu_decode import decode_enabled
from kvflow.stages.engine.cpu_fused import fused_enabled
from kvflow.stages.engine.cpu_fused import kernels as fused_cpu_kernels
from kvflow.stages.engine.cpu_kernels import isa_flags
from kvflow.stages.engine.errors import ModelLoadError
from kvflow.stages.engine.model import CausalLM
from kvflow.stages.engine.onednn_linear import onednn_applies, use_onednn_linears
from kvflow.stages.engine.precision import Precision
from kvflow.stages.engine.quant_linear import missing_kernel, quantize_linears
from kvflow.stages.engine.spec import ModelSpec

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Checkpoint entries that carry no weights of ours (precomputed RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of `model_dir`, in a stable order; ModelLoadError if none."""
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    index = model_dir / INDEX_FILE
    if not index.is_file():
        raise ModelLoadError(
            f"model directory {model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
    files = [model_dir / n for n in names]
    missing = [str(f.name) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{index} names missing shard files: {missing}")
    return files


def _read_state(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors = load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weights {path}: {exc}") from exc
        for name, tensor in tensors.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            state[name] = tensor.to(dtype)
    return state


def load_weights(
    model_dir: Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    fuse: bool = True,
    quant: Precision | None = None,
) -> CausalLM:
    """Build a CausalLM for `spec` holding the checkpoint's weights in `dtype` on `device`.
    `fuse` (the default) concatenates q/k/v and gate/up (`CausalLM.fuse_projections`): 4
    matrix products per layer instead of 7, and the wider ones read memory faster (decode at
    batch 1 was 1.14x faster on 2 threads here, docs/performance.md); int8/int4 keep the
    separate projections. bf16 on a CPU
    with native bf16 runs its linears through oneDNN (`onednn_linear.py`). A quantized `quant`
    (int8/int4, precision.py) reads the weights in float32, quantizes the decoder layers'
    linears from them, and holds the rest in `dtype`.

    Raises ModelLoadError naming missing, unexpected or misshapen weights, or the kernel a
    quantized precision needs that this torch or device lacks; ValueError for a
    `KVFLOW_LINEAR`, `KVFLOW_FUSED`, `KVFLOW_ATTN` or `KVFLOW_KERNEL_ISA` it does not know."""
    bits = quant.weight_bits if quant is not None else None
    if quant is not None and bits is not None:
        why = missing_kernel(bits, device)
        if why:
            raise ModelLoadError(f"dtype {quant.name} cannot load: {why}")
    state = _read_state(weight_files(model_dir), torch.float32 if bits else dtype)
    if spec.tie_word_embeddings or "lm_head.weight" not in state:
        if not spec.tie_word_embeddings:
            raise ModelLoadError("checkpoint has no lm_head.weight and embeddings are not tied")
        state["lm_head.weight"] = state.get("model.embed_tokens.weight", torch.empty(0))
    with torch.device("meta"):
        model = CausalLM(spec)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"weights do not match {spec.architecture} config: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    for name, param in expected.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"weight {name} has shape {tuple(state[name].shape)}, config implies "
                f"{tuple(param.shape)}"
            )
    model.load_state_dict(state, assign=True, strict=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if fuse and bits is None:  # int8/int4 keep their measured per-projection layout
        model.fuse_projections()
    model = model.to(device).eval().requires_grad_(False)
    if quant is not None and bits is not None:
        try:
            quantize_linears(model.model.layers, quant, dtype)
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"dtype {quant.name} cannot quantize this model: {exc}") from exc
        model = model.to(dtype)  # the rest (embeddings, norms, lm_head); int buffers stay
    if onednn_applies(dtype, device):
        use_onednn_linears(model)
    attn_setting()  # an unknown KVFLOW_ATTN fails here, not in the first decode step
    isa_flags()  # and an unknown KVFLOW_KERNEL_ISA
    decode_enabled()  # likewise KVFLOW_DECODE
    if fused_enabled() and device.type == "cpu" and dtype == torch.float32:
        fused_cpu_kernels()  # built (or found) now, not in the first forward
    model.setup_rotary(device)
    name = quant.name if quant is not None else dtype
    logger.info("loaded %s: %d params, dtype=%s", spec.architecture, spec.num_params, name)
    return model


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ModelLoadError(f"{path} is too short to be a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > 100_000_000:
            raise ModelLoadError(f"{path} has an implausible header size {size}")
        return fh.read(size)


SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 4096


def _sampled_bytes(path: Path, size: int) -> bytes:
    """SAMPLES_PER_FILE slices of SAMPLE_BYTES at evenly spaced offsets (64 KiB per file)."""
    chunks = []
    with path.open("rb") as fh:
        for i in range(SAMPLES_PER_FILE):
            fh.seek(max(0, size - SAMPLE_BYTES) * i // (SAMPLES_PER_FILE - 1))
            chunks.append(fh.read(SAMPLE_BYTES))
    return b"".join(chunks)


def fingerprint(model_dir: Path, config_bytes: bytes, dtype: str) -> str:
    """A stable identity of (architecture, weights, dtype): blake2b over config.json, each
    weight file's name, size, safetensors header and 16 sampled 4 KiB slices of its bytes, and
    the dtype. It reads ~64 KiB per file, so it is fast for big models; it changes whenever a
    tensor's name, shape, dtype or offset changes, and (with near certainty) when the weights
    are re-drawn or retrained, but not for an edit confined to unsampled bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"kvflow-model-v1\0")
    h.update(config_bytes)
    for path in weight_files(model_dir):
        size = path.stat().st_size
        h.update(b"\0" + path.name.encode() + b"\0")
        h.update(struct.pack("<Q", size))
        h.update(_safetensors_header(path))
        h.update(_sampled_bytes(path, size))
    h.update(b"\0" + dtype.encode())
    return h.hexdigest()
