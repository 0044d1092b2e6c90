"""What each engine `dtype` name means for weights, activations and KV pages.

`float32`, `bfloat16` and `float16` hold everything in that dtype. `int8` and `int4` are
weight-only quantization of the decoder's linears (q/k/v/o, gate/up/down in every layer),
done at load time from the checkpoint's float weights:

- int8: symmetric, one scale per output channel (row), run by torch's CPU kernel
  `torch._weight_int8pack_mm`;
- int4: asymmetric, one scale and zero point per group of `INT4_GROUP` input columns of a
  row, run by `torch._weight_int4pack_mm_for_cpu` on the weight packed by
  `torch._convert_weight_to_int4pack_for_cpu`.

Everything else of an int8/int4 model (embeddings, norms, RoPE, attention, the lm_head, which
is the tied embedding table in most small models) runs in the precision's `compute` dtype,
bfloat16, and the KV pages are bfloat16 too: `Engine.page_dtype`, `page_shape` and the KV
layout that kvdb keys carry follow `compute`, so an int8 engine's pages have a bf16 engine's
layout. They are not interchangeable all the same: the model fingerprint includes the `dtype`
name, so int8, int4 and bf16 engines (and nodes) never share cached KV.

A GGUF import dequantizes its Q8_0/Q4_K/... tensors to float (gguf_reader.py); `int8`/`int4`
re-quantize those float weights at load time with the schemes above (not the file's own
blocks), so the result is close to, not bit-equal to, the GGUF file's quantization.

The server's flags and config (`stages/serve/config.py:DTYPES`) name the same choices without
importing the engine; tests/stages/engine/test_quantized.py keeps the two lists equal."""

from __future__ import annotations

from dataclasses import dataclass

INT4_GROUP = 32
"""Input columns per int4 scale/zero group; divides the hidden and MLP sizes of the common
Llama-family models (SmolLM2-135M's 576 is not a multiple of 64 or 128)."""


@dataclass(frozen=True)
class Precision:
    """One engine dtype name's meaning.

    Fields:
        name: the `dtype` value ("float32", ..., "int8", "int4").
        compute: the torch dtype name of activations, float weights and KV pages.
        weight_bits: None: the decoder's linear weights are in `compute`; 8 or 4: they are
            weight-only quantized to that many bits.
        group_size: input columns per scale group (int4); None: per output channel.
    """

    name: str
    compute: str
    weight_bits: int | None = None
    group_size: int | None = None

    @property
    def quantized(self) -> bool:
        return self.weight_bits is not None


PRECISIONS: dict[str, Precision] = {
    "float32": Precision("float32", "float32"),
    "bfloat16": Precision("bfloat16", "bfloat16"),
    "float16": Precision("float16", "float16"),
    "int8": Precision("int8", "bfloat16", weight_bits=8),
    "int4": Precision("int4", "bfloat16", weight_bits=4, group_size=INT4_GROUP),
}


def precision(name: str) -> Precision:
    """The Precision called `name`; ValueError naming the choices for an unknown one."""
    try:
        return PRECISIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"dtype must be one of {list(PRECISIONS)}, got {name!r}") from None
