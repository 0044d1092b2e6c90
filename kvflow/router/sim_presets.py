"""Named cost models for the simulator, each with its source stated, and loading a fitted one.

A preset is a prefill model, a decode model, the KV bytes of one token and one decode
instance's KV memory in tokens. The built-in presets are *derived* from public model shapes and
GPU datasheets (the arithmetic is in each docstring), not measured; a measured model comes from
``kvflow profile`` (``kvflow_profile.json``), loaded with :func:`preset_from_profile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvflow.router.estimators import PROFILE_FILENAME, DecodeTimeModel, PrefillTimeModel
from kvflow.router.profile import Profile, load_profile


@dataclass(frozen=True)
class CostPreset:
    """A cost model with its provenance. ValueError names a bad field."""

    name: str
    prefill: PrefillTimeModel
    decode: DecodeTimeModel
    kv_bytes_per_token: int
    decode_capacity_tokens: int
    source: str

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if self.decode_capacity_tokens < 1:
            raise ValueError(
                f"decode_capacity_tokens must be >= 1, got {self.decode_capacity_tokens}"
            )


def llama3_70b_8xa100() -> CostPreset:
    """LLaMA3-70B on one node of 8 A100-80GB (the paper's testbed GPU), fp16.

    KV per token: 2 (k,v) * 80 layers * 8 kv heads * 128 dims * 2 bytes = 327,680 B.
    Prefill: ~140 GFLOP per token at 50% of 8 * 312 TFLOPS -> ~9k tokens/s (1.1e-4 s/token);
    attention ~1 ns per (query, key) pair-unit; reused tokens loaded at ~50 GB/s.
    Decode: 25 ms per step (140 GB of weights over 8 * 2 TB/s, plus overheads), +0.3 ms per
    sequence, KV reads ~40 ns per context token.
    Decode memory: 640 GB - 140 GB weights, 90% usable -> ~1.37M tokens.
    """
    return CostPreset(
        "llama3-70b-8xa100",
        PrefillTimeModel((0.03, 1.1e-4, 1.05e-9, 6.5e-6), "llama3-70b-8xa100"),
        DecodeTimeModel((0.025, 3e-4, 4e-8), "llama3-70b-8xa100"),
        kv_bytes_per_token=327_680,
        decode_capacity_tokens=1_370_000,
        source="derived (not measured): LLaMA3-70B shapes, 8x A100-80GB datasheet, 50% MFU",
    )


def llama3_8b_1xa100() -> CostPreset:
    """LLaMA3-8B on one A100-80GB, fp16.

    KV per token: 2 * 32 layers * 8 kv heads * 128 dims * 2 bytes = 131,072 B.
    Prefill: 16 GFLOP per token at 50% of 312 TFLOPS -> ~10k tokens/s (1e-4 s/token);
    attention 4 * 32 layers * 32 heads * 128 dims FLOPs per pair -> ~1.7e-9 s per pair-unit;
    reused tokens loaded at ~20 GB/s. Decode: 8 ms per step (16 GB over 2 TB/s), +0.1 ms per
    sequence, ~65 ns per context token. Decode memory: (80 - 16) GB * 0.9 -> ~440k tokens.
    """
    return CostPreset(
        "llama3-8b-1xa100",
        PrefillTimeModel((0.01, 1e-4, 1.7e-9, 6.5e-6), "llama3-8b-1xa100"),
        DecodeTimeModel((0.008, 1e-4, 6.5e-8), "llama3-8b-1xa100"),
        kv_bytes_per_token=131_072,
        decode_capacity_tokens=440_000,
        source="derived (not measured): LLaMA3-8B shapes, A100-80GB datasheet, 50% MFU",
    )


PRESETS = {p().name: p for p in (llama3_70b_8xa100, llama3_8b_1xa100)}
DEFAULT_PRESET = "llama3-70b-8xa100"


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def make_preset(name: str) -> CostPreset:
    """The named preset; ValueError lists the known names."""
    factory = PRESETS.get(name)
    if factory is None:
        raise ValueError(f"unknown cost preset {name!r}; known: {', '.join(PRESETS)}")
    return factory()


def preset_from_profile(
    path: str | Path, kv_bytes_per_token: int, decode_capacity_tokens: int
) -> CostPreset:
    """A preset from ``kvflow profile`` output: ``path`` is the model directory or its
    ``kvflow_profile.json``. The profile holds only times, so the KV size and decode memory are
    given. Raises ProfileFormatError / OSError; ValueError when there is no profile file."""
    directory = Path(path)
    if directory.name == PROFILE_FILENAME:
        directory = directory.parent
    if not (directory / PROFILE_FILENAME).exists():
        raise ValueError(f"no {PROFILE_FILENAME} in {directory}; run `kvflow profile` first")
    profile: Profile = load_profile(directory)
    return CostPreset(
        f"profile:{profile.model_id}",
        profile.prefill,
        profile.decode,
        kv_bytes_per_token,
        decode_capacity_tokens,
        source=f"fitted by `kvflow profile` ({directory / PROFILE_FILENAME})",
    )
