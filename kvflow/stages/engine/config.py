"""Engine and sampling configuration: frozen, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


MAX_TEMPERATURE = 100.0
"""The largest temperature accepted (beyond it sampling is uniform noise)."""
GREEDY_BELOW = 1e-5
"""A temperature below this samples greedily (as vLLM's _SAMPLING_EPS)."""

@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs a model.

    Fields:
        dtype: weights, activations and KV pages: "float32", "bfloat16" or "float16".
        block_size: tokens per KV page (and per cached block).
        num_pages: pages in the pool; the pool is allocated once at open.
        prefill_chunk: at most this many prompt tokens are computed per `step()`
            (chunked prefill), summed over all requests in prefill.
        max_model_len: longest sequence (prompt + output) in tokens; None takes the
            model's `max_position_embeddings`.
        max_batch: at most this many requests in one decode step.
        device: torch device string, "cpu" or "cuda[:N]".
        seed: seeds sampling for requests whose SamplingParams give no seed.
        return_logits: attach the float32 logits that each sampled token came from
            to its `RequestOutput` (for tests and debugging; costs a copy).
    """

    dtype: str = "float32"
    block_size: int = 64
    num_pages: int = 256
    prefill_chunk: int = 512
    max_model_len: int | None = None
    max_batch: int = 32
    device: str = "cpu"
    seed: int = 0
    return_logits: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _positive("block_size", self.block_size)
        _positive("num_pages", self.num_pages)
        _positive("prefill_chunk", self.prefill_chunk)
        _positive("max_batch", self.max_batch)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from exc

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen for one request.

    Fields:
        max_tokens: stop after this many generated tokens (finish_reason "length").
        temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens before sampling; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
        seed: seeds this request's sampling generator; None derives one from the
            engine seed and the request id (stable across runs).
        stop_token_ids: extra tokens that end generation (finish_reason "stop").
        ignore_eos: do not stop on the model's EOS token(s).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _positive("max_tokens", self.max_tokens)
        temperature = self.temperature
        if not isinstance(temperature, int | float) or not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        bad_seed = isinstance(self.seed, bool) or not isinstance(self.seed, int)
        if self.seed is not None and bad_seed:
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` are greedy: dividing logits by them
        overflows float32 (1e-40 made NaN probabilities and failed a whole engine step)."""
        return self.temperature < GREEDY_BELOW
