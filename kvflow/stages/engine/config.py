"""Engine and sampling configuration: frozen, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvflow.stages.engine.grammar import GrammarSpec
from kvflow.stages.engine.precision import PRECISIONS, Precision, precision

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


DECODE_GRAPH_MODES = ("auto", "off", "static")
"""EngineConfig.decode_graphs: what each means is in decode_graphs.py."""

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


DEVICE_FORM = re.compile(r"cpu|cuda(:[0-9]+)?")
"""The devices an engine runs on (serve/config.py's torch-free ``DEVICE_PATTERN`` is the same;
a test holds them equal)."""


def require_device(device: str) -> torch.device:
    """``device`` as a torch device this process can run an engine on: the CPU, or a CUDA
    device that torch sees. ValueError naming what is wrong otherwise (checked before any
    weight is read)."""
    if not (isinstance(device, str) and DEVICE_FORM.fullmatch(device)):
        raise ValueError(f"device {device!r}: an engine runs on 'cpu' or 'cuda[:N]'")
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {device!r}: torch sees {count} CUDA device(s), 0-{count - 1}")
    return dev


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


MAX_TEMPERATURE = 100.0
"""The largest temperature accepted (beyond it sampling is uniform noise)."""
GREEDY_BELOW = 1e-5
"""A temperature below this samples greedily (as vLLM's _SAMPLING_EPS)."""
MAX_SEED = 2**64 - 1
TOP_K_ALL = 2**31 - 1
"""A top_k above this (no vocabulary is that large) is stored as 0: every token."""
"""The largest seed: what torch.Generator.manual_seed takes (and gRPC's uint64)."""


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs a model.

    Fields:
        dtype: weights, activations and KV pages: "float32", "bfloat16" or "float16"; or
            "int8" / "int4": the decoder's linear weights quantized at load time, everything
            else (activations, KV pages) in bfloat16 (precision.py).
        block_size: tokens per KV page (and per cached block).
        num_pages: pages in the pool; the pool is allocated once at open.
        prefill_chunk: at most this many prompt tokens are computed per `step()`
            (chunked prefill), summed over all requests in prefill.
        mixed_chunk: the prefill budget of a step that also decodes (None: prefill_chunk);
            smaller bounds running streams' time between tokens while prompts prefill
            (scheduler.py). While more than one prompt waits (and no tbt_target_ms), such a
            step takes up to prefill_chunk instead: a queue of prompts is answered sooner.
        tbt_target_ms: size the prefill budget of a step that also decodes to a step of
            about this many milliseconds (measured as the engine runs: step_budget.py), at
            most mixed_chunk (or prefill_chunk); None: the fixed mixed_chunk.
        max_model_len: longest sequence (prompt + output) in tokens; None takes the
            model's `max_position_embeddings`.
        max_batch: at most this many requests in one decode step.
        device: torch device string, "cpu" or "cuda[:N]".
        seed: seeds sampling for requests whose SamplingParams give no seed.
        return_logits: attach the float32 logits that each sampled token came from
            to its `RequestOutput` (for tests and debugging; costs a copy).
        mixed_forward: a step that has prefill chunks and decode tokens (or several
            chunks) runs them as ONE forward pass, so the weights are read once for all
            of them; False: one forward per chunk and one for the decode batch.
        decode_graphs: how a step that only decodes runs (decode_graphs.py): "auto"
            replays a CUDA graph of its fixed-shape bucket on a CUDA device and runs eagerly
            elsewhere; "off" always eagerly; "static" the graphs' fixed-shape forward without
            capturing it, on any device (for tests and comparisons).
        prefault_pages: how many of the pool's leading pages (and of a GPU pool's host
            mirror) to write at open, so the steps that use them take no first-use page
            faults (the pages are handed out lowest first); None: one sequence's
            (`pages.resident_pages`), the rest mapped as first written, so a large pool costs
            memory only as it is used. `kvflow serve` (`--kv-prefault`, its default) writes
            one memory-planned pool's pages of the engine that prefills.
    """

    dtype: str = "float32"
    block_size: int = 64
    num_pages: int = 256
    prefill_chunk: int = 512
    mixed_chunk: int | None = None
    tbt_target_ms: float | None = None
    max_model_len: int | None = None
    max_batch: int = 32
    device: str = "cpu"
    seed: int = 0
    return_logits: bool = False
    mixed_forward: bool = True
    decode_graphs: str = "auto"
    prefault_pages: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in PRECISIONS:
            raise ValueError(f"dtype must be one of {list(PRECISIONS)}, got {self.dtype!r}")
        _positive("block_size", self.block_size)
        _positive("num_pages", self.num_pages)
        _positive("prefill_chunk", self.prefill_chunk)
        if self.mixed_chunk is not None:
            _positive("mixed_chunk", self.mixed_chunk)
        if self.tbt_target_ms is not None and not (
            isinstance(self.tbt_target_ms, int | float)
            and not isinstance(self.tbt_target_ms, bool)
            and 0 < self.tbt_target_ms < float("inf")
        ):
            raise ValueError(
                f"tbt_target_ms must be a positive number of milliseconds, "
                f"got {self.tbt_target_ms!r}"
            )
        _positive("max_batch", self.max_batch)
        if self.decode_graphs not in DECODE_GRAPH_MODES:
            raise ValueError(
                f"decode_graphs must be one of {list(DECODE_GRAPH_MODES)}, "
                f"got {self.decode_graphs!r}"
            )
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.prefault_pages is not None and (
            isinstance(self.prefault_pages, bool)
            or not isinstance(self.prefault_pages, int)
            or self.prefault_pages < 0
        ):
            raise ValueError(
                f"prefault_pages must be None or an int >= 0, got {self.prefault_pages!r}"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from exc

    @property
    def precision(self) -> Precision:
        return precision(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype: activations, float weights and KV pages."""
        return DTYPES[self.precision.compute]


MAX_LOGIT_BIAS = 100.0
"""The largest |bias| of one logit_bias entry (OpenAI's limit)."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen for one request.

    Fields:
        max_tokens: stop after this many generated tokens (finish_reason "length").
        temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens before sampling; 0 keeps all, and so does any k
            at or above the vocabulary size (vLLM's rule; a k over TOP_K_ALL becomes 0, so it
            fits the wire's uint32).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
        seed: seeds this request's sampling generator, in [0, 2**64); None derives one from
            the engine seed and the request id (stable across runs).
        stop_token_ids: extra tokens that end generation (finish_reason "stop").
        ignore_eos: do not stop on the model's EOS token(s).
        repetition_penalty: > 0; 1 is off. Every token seen so far (prompt and output) has a
            positive logit divided by it and a negative one multiplied (the CTRL / transformers
            / vLLM rule).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it was
            generated (OpenAI's rule; prompt tokens do not count).
        presence_penalty: in [-2, 2]; subtracted once from every token generated at least once.
        logprobs: None = off; n in [0, MAX_LOGPROBS]: each output token carries its log
            probability, its rank and the n most likely alternatives (RequestOutput.logprobs).
            Log probabilities are of the model's raw distribution: before penalties,
            temperature, top-k and top-p (vLLM's default).
        prompt_logprobs: like logprobs, for the prompt tokens whose KV this engine computes
            (RequestOutput.prompt_logprobs): positions num_prefix_tokens + 1 .. prompt_len - 1.
            A token's logprob comes from the previous position's output, so imported (cached)
            prefix positions and position 0 have none.
        logit_bias: (token id, bias) pairs added to the logits before sampling, bias in
            [-100, 100] (OpenAI's rule: -100 bans a token, +100 all but forces it).
        grammar: a GrammarSpec the output must match (structured output: a JSON schema, any
            JSON object, a regex, an EBNF grammar); None = free text.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        _positive("max_tokens", self.max_tokens)
        temperature = self.temperature
        if not isinstance(temperature, int | float) or not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.top_k > TOP_K_ALL:  # vLLM's rule: top_k >= the vocabulary keeps every token
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        seed = self.seed
        bad_seed = isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
        if seed is not None and bad_seed:  # 2**64 used to overflow torch's manual_seed (a 500)
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
        stops = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        self._check_penalties()
        self._check_bias()
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got {self.grammar!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            bad = isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS
            if n is not None and bad:
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {n!r}")

    def _check_penalties(self) -> None:
        rep = self.repetition_penalty
        if isinstance(rep, bool) or not isinstance(rep, int | float) or not rep > 0.0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {rep!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")

    def _check_bias(self) -> None:
        pairs = tuple((k, v) for k, v in dict(self.logit_bias).items())
        for token, bias in pairs:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"logit_bias[{token}] must be a number, got {bias!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias!r}"
                )
        object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in pairs))

    @property
    def penalized(self) -> bool:
        """True when any penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` are greedy: dividing logits by them
        overflows float32 (1e-40 made NaN probabilities and failed a whole engine step)."""
        return self.temperature < GREEDY_BELOW
