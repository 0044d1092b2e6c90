"""Time estimators of the conductor: prefill time, decode TBT, KV transfer time.

The paper (§4.1) predicts prefill time "using a polynomial regression model fitted with offline
data" as a function of the request length and the prefix cache hit length. Here:

- :class:`PrefillTimeModel` — seconds to prefill a prompt of ``n`` tokens of which ``p`` are reused.
  Features over the new tokens ``m = n - p``: ``[1, m, m*(n+p), p]``. ``m*(n+p)/2`` is exactly the
  number of (query, key) pairs the new tokens attend to (token ``i`` of the suffix sees ``p + i``
  keys), so the third coefficient is the attention cost; ``p`` is the cost of loading the reused
  blocks.
- :class:`DecodeTimeModel` — seconds per output token (TBT) of a decode instance as a function of
  its batch size ``b`` and the total context tokens ``c`` of the batch: ``[1, b, c]``.
- :class:`TransferEstimator` — ``latency + bytes / bandwidth`` with the bandwidth an EWMA of
  measured transfers.

Both models are immutable values: ``fit`` returns a new model, ``predict`` is pure and
thread-safe. ``save``/``load`` write a small JSON document with a format version, the model kind
and the identity of the LLM they were fitted for.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvflow.router.errors import FitError, ProfileFormatError

T = TypeVar("T")

PROFILE_FILENAME = "kvflow_profile.json"
"""File name of the fitted profile, stored in the model directory (see :mod:`.profile`)."""

FORMAT_VERSION = 1
DEFAULT_MODEL_ID = "default"

PREFILL_FEATURES: tuple[str, ...] = ("1", "m", "m*(n+p)", "p")
DECODE_FEATURES: tuple[str, ...] = ("1", "b", "c")


@dataclass(frozen=True)
class ProfileSample:
    """One measured prefill: ``seconds`` to prefill ``prompt_len`` tokens reusing ``reused_len``."""

    prompt_len: int
    reused_len: int
    seconds: float

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if not 0 <= self.reused_len <= self.prompt_len:
            raise ValueError(
                f"reused_len must be in [0, prompt_len={self.prompt_len}], got {self.reused_len}"
            )
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {self.seconds}")


@dataclass(frozen=True)
class DecodeSample:
    """One measured decode step: ``seconds`` per token at ``batch_size`` and ``context_tokens``."""

    batch_size: int
    context_tokens: int
    seconds: float

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {self.context_tokens}")
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {self.seconds}")


def _least_squares(rows: np.ndarray, targets: np.ndarray) -> tuple[float, ...]:
    """Least squares with column scaling (features span ~10 orders of magnitude)."""
    scale = np.max(np.abs(rows), axis=0)
    scale[scale == 0] = 1.0
    solution, *_ = np.linalg.lstsq(rows / scale, targets, rcond=None)
    return tuple(float(c) for c in solution / scale)


def _check_coefficients(coefficients: Sequence[float], expected: int, what: str) -> None:
    if len(coefficients) != expected:
        raise ValueError(
            f"{what} coefficients must have {expected} entries, got {len(coefficients)}"
        )
    if not all(math.isfinite(c) for c in coefficients):
        raise ValueError(f"{what} coefficients must be finite, got {tuple(coefficients)}")


def _to_document(
    kind: str, model_id: str, coefficients: Sequence[float], features: Sequence[str]
) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "model_id": model_id,
        "features": list(features),
        "coefficients": list(coefficients),
    }


def _from_document(doc: Any, kind: str, features: Sequence[str]) -> tuple[str, tuple[float, ...]]:
    """Validate a model document; returns (model_id, coefficients). Raises ProfileFormatError."""
    if not isinstance(doc, dict):
        raise ProfileFormatError(f"{kind} model document must be a JSON object")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ProfileFormatError(
            f"{kind} model format_version must be {FORMAT_VERSION}, "
            f"got {doc.get('format_version')!r}"
        )
    if doc.get("kind") != kind:
        raise ProfileFormatError(f"model kind must be {kind!r}, got {doc.get('kind')!r}")
    if doc.get("features") != list(features):
        raise ProfileFormatError(
            f"{kind} model features must be {list(features)}, got {doc.get('features')!r}"
        )
    model_id = doc.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise ProfileFormatError(f"{kind} model_id must be a non-empty string, got {model_id!r}")
    coefficients = doc.get("coefficients")
    if (
        not isinstance(coefficients, list)
        or not all(
            isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c)
            for c in coefficients
        )
        or len(coefficients) != len(features)
    ):
        raise ProfileFormatError(
            f"{kind} coefficients must be {len(features)} finite numbers, got {coefficients!r}"
        )
    return model_id, tuple(float(c) for c in coefficients)


def read_json(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ProfileFormatError(f"{path}: not valid JSON: {exc}") from exc


def write_json_atomic(path: str | Path, doc: dict[str, Any]) -> None:
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    tmp.replace(target)  # atomic: a reader never sees half a file


@dataclass(frozen=True)
class PrefillTimeModel:
    """Predicted prefill seconds as a linear model over ``[1, m, m*(n+p), p]`` (see module doc).

    Immutable and thread-safe. ``model_id`` names the LLM the coefficients were fitted for.
    """

    coefficients: tuple[float, float, float, float]
    model_id: str = DEFAULT_MODEL_ID

    def __post_init__(self) -> None:
        _check_coefficients(self.coefficients, len(PREFILL_FEATURES), "prefill")
        if not self.model_id:
            raise ValueError("model_id must be a non-empty string")

    @staticmethod
    def features(prompt_len: int, reused_len: int) -> tuple[float, float, float, float]:
        """The feature vector of one prefill; raises ValueError on inconsistent lengths."""
        if prompt_len < 0 or not 0 <= reused_len <= prompt_len:
            raise ValueError(
                f"need 0 <= reused_len <= prompt_len, got prompt_len={prompt_len} "
                f"reused_len={reused_len}"
            )
        new = prompt_len - reused_len
        return (1.0, float(new), float(new) * float(prompt_len + reused_len), float(reused_len))

    @classmethod
    def fit(
        cls, samples: Sequence[ProfileSample], model_id: str = DEFAULT_MODEL_ID
    ) -> PrefillTimeModel:
        """Least-squares fit. Needs at least 4 samples; raises FitError otherwise."""
        if len(samples) < len(PREFILL_FEATURES):
            raise FitError(
                f"prefill fit needs >= {len(PREFILL_FEATURES)} samples, got {len(samples)}"
            )
        rows = np.array([cls.features(s.prompt_len, s.reused_len) for s in samples])
        targets = np.array([s.seconds for s in samples])
        c = _least_squares(rows, targets)
        return cls((c[0], c[1], c[2], c[3]), model_id)

    @classmethod
    def default(cls) -> PrefillTimeModel:
        """A guess for the CPU demo model, used when no profile was fitted.

        About 5 ms fixed cost, ~2,000 new tokens/s, attention noticeable beyond a few thousand
        tokens, loading a reused token ~50x cheaper than computing it. Run ``kvflow profile``
        for real numbers.
        """
        return cls((5e-3, 5e-4, 2e-8, 1e-5), DEFAULT_MODEL_ID)

    def predict(self, prompt_len: int, reused_len: int) -> float:
        """Predicted seconds, never negative. Raises ValueError on inconsistent lengths."""
        if prompt_len < 0 or not 0 <= reused_len <= prompt_len:
            self.features(prompt_len, reused_len)  # raises the ValueError
        c0, c1, c2, c3 = self.coefficients
        new = prompt_len - reused_len
        seconds = c0 + c1 * new + c2 * (new * (prompt_len + reused_len)) + c3 * reused_len
        return seconds if seconds > 0.0 else 0.0  # max(0.0, seconds) without the call

    def to_dict(self) -> dict[str, Any]:
        return _to_document("prefill", self.model_id, self.coefficients, PREFILL_FEATURES)

    @classmethod
    def from_dict(cls, doc: Any) -> PrefillTimeModel:
        """Raises ProfileFormatError on any malformed field."""
        model_id, c = _from_document(doc, "prefill", PREFILL_FEATURES)
        return cls((c[0], c[1], c[2], c[3]), model_id)

    def save(self, path: str | Path) -> None:
        """Write the model as JSON (atomically replacing ``path``)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> PrefillTimeModel:
        """Read a model written by :meth:`save`; raises ProfileFormatError or OSError."""
        return cls.from_dict(read_json(path))


@dataclass(frozen=True)
class DecodeTimeModel:
    """Predicted seconds per output token over ``[1, b, c]`` (batch size, batch context tokens).

    Immutable and thread-safe.
    """

    coefficients: tuple[float, float, float]
    model_id: str = DEFAULT_MODEL_ID

    def __post_init__(self) -> None:
        _check_coefficients(self.coefficients, len(DECODE_FEATURES), "decode")
        if not self.model_id:
            raise ValueError("model_id must be a non-empty string")

    @staticmethod
    def features(batch_size: int, context_tokens: int) -> tuple[float, float, float]:
        if batch_size < 0 or context_tokens < 0:
            raise ValueError(
                f"need batch_size >= 0 and context_tokens >= 0, got {batch_size}, {context_tokens}"
            )
        return (1.0, float(batch_size), float(context_tokens))

    @classmethod
    def fit(
        cls, samples: Sequence[DecodeSample], model_id: str = DEFAULT_MODEL_ID
    ) -> DecodeTimeModel:
        """Least-squares fit. Needs at least 3 samples; raises FitError otherwise."""
        if len(samples) < len(DECODE_FEATURES):
            raise FitError(
                f"decode fit needs >= {len(DECODE_FEATURES)} samples, got {len(samples)}"
            )
        rows = np.array([cls.features(s.batch_size, s.context_tokens) for s in samples])
        targets = np.array([s.seconds for s in samples])
        c = _least_squares(rows, targets)
        return cls((c[0], c[1], c[2]), model_id)

    @classmethod
    def default(cls) -> DecodeTimeModel:
        """A guess for the CPU demo model: 20 ms per step, +2 ms per sequence, +1 us per token."""
        return cls((2e-2, 2e-3, 1e-6), DEFAULT_MODEL_ID)

    def predict(self, batch_size: int, context_tokens: int) -> float:
        """Predicted seconds per token, never negative. Raises ValueError on negative input."""
        if batch_size < 0 or context_tokens < 0:
            self.features(batch_size, context_tokens)  # raises the ValueError
        c0, c1, c2 = self.coefficients
        seconds = c0 + c1 * batch_size + c2 * context_tokens
        return seconds if seconds > 0.0 else 0.0  # max(0.0, seconds) without the call

    def predict_many(self, batch_sizes: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        """:meth:`predict` elementwise over two integer arrays of one shape (the same float
        operations in the same order, so equal values), as a new float64 array. Inputs are
        trusted to be >= 0 (the conductor's own counters)."""
        return self.predict_from_batch_terms(self.batch_terms(batch_sizes), context_tokens)

    def batch_terms(self, batch_sizes: np.ndarray) -> np.ndarray:
        """The part of :meth:`predict_many` that depends on the batch size only (to reuse it
        while the batches do not change)."""
        c0, c1, _ = self.coefficients
        return c0 + c1 * batch_sizes

    def predict_from_batch_terms(
        self, batch_terms: np.ndarray, context_tokens: np.ndarray
    ) -> np.ndarray:
        """:meth:`predict_many` given :meth:`batch_terms` of the same batch sizes."""
        tbt = batch_terms + self.coefficients[2] * context_tokens
        return tbt if self._never_negative else np.maximum(0.0, tbt)

    def predict_joined(self, states: Sequence[tuple[int, int]], prompt_len: int) -> list[float]:
        """For each ``(batch size, context tokens)`` state, the prediction with one more
        request of ``prompt_len`` tokens joined: ``predict(batch + 1, context + prompt_len)``,
        as the value :meth:`predict_many` gives for that row (the same float operations in the
        same order). In Python: over the few distinct states of a group of instances it costs
        less than the array operations over every instance."""
        c0, c1, c2 = self.coefficients
        out = [(c0 + c1 * (b + 1)) + c2 * (c + prompt_len) for b, c in states]
        if self._never_negative:
            return out
        return [t if t >= 0.0 else 0.0 for t in out]  # np.maximum(0.0, t), -0.0 kept as it does

    def lowest_joined(
        self, groups: Mapping[tuple[int, int], T], prompt_len: int
    ) -> tuple[float, list[T]]:
        """The lowest :meth:`predict_joined` value over the states that key ``groups``, and the
        values of every state that reaches it, in ``groups``' order (a plain loop: no list of
        predictions, no second pass, unless the lowest is clamped at 0.0)."""
        c0, c1, c2 = self.coefficients
        best = math.inf
        tied: list[T] = []
        for (b, c), value in groups.items():
            t = (c0 + c1 * (b + 1)) + c2 * (c + prompt_len)  # predict_joined's, inline (no list)
            if t < best:
                best = t
                tied = [value]
            elif t == best:
                tied.append(value)
        if best > 0.0 or self._never_negative:
            return best, tied
        # clamped at 0.0: every state at or below it ties
        values = self.predict_joined(tuple(groups), prompt_len)
        best = min(values)
        return best, [value for value, t in zip(groups.values(), values, strict=True) if t == best]

    @cached_property
    def _never_negative(self) -> bool:
        """Whether every coefficient is +0.0 or positive: then with batch sizes and context
        tokens >= 0 every product and sum is too, and ``max(0.0, x)`` is ``x`` bit for bit
        (a -0.0 coefficient could make a -0.0 sum, which the max turns into +0.0)."""
        return all(math.copysign(1.0, c) > 0 for c in self.coefficients)

    def to_dict(self) -> dict[str, Any]:
        return _to_document("decode", self.model_id, self.coefficients, DECODE_FEATURES)

    @classmethod
    def from_dict(cls, doc: Any) -> DecodeTimeModel:
        model_id, c = _from_document(doc, "decode", DECODE_FEATURES)
        return cls((c[0], c[1], c[2]), model_id)

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> DecodeTimeModel:
        return cls.from_dict(read_json(path))


class TransferEstimator:
    """KV transfer time: ``latency_s + num_bytes / bandwidth`` with an EWMA bandwidth.

    ``observe`` feeds measured transfers (mutates; thread-safe through an internal lock);
    ``estimate`` reads the current bandwidth (thread-safe, no mutation).
    """

    def __init__(
        self, bandwidth_bytes_per_s: float, latency_s: float = 0.0, alpha: float = 0.2
    ) -> None:
        if not (math.isfinite(bandwidth_bytes_per_s) and bandwidth_bytes_per_s > 0):
            raise ValueError(
                f"bandwidth_bytes_per_s must be finite and > 0, got {bandwidth_bytes_per_s}"
            )
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency_s must be finite and >= 0, got {latency_s}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self._bandwidth = float(bandwidth_bytes_per_s)
        self._latency = float(latency_s)
        self._alpha = float(alpha)
        self._lock = threading.Lock()

    @property
    def bandwidth_bytes_per_s(self) -> float:
        with self._lock:
            return self._bandwidth

    @property
    def latency_s(self) -> float:
        return self._latency

    def estimate(self, num_bytes: int) -> float:
        """Predicted seconds to move ``num_bytes``; 0 for nothing to move. ValueError if < 0."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        if num_bytes == 0:
            return 0.0
        with self._lock:
            bandwidth = self._bandwidth
        return self._latency + num_bytes / bandwidth

    def observe(self, num_bytes: int, seconds: float) -> None:
        """Fold one measured transfer into the bandwidth EWMA.

        The fixed latency is subtracted first (floored at 1% of ``seconds``, so a transfer faster
        than the assumed latency still counts as fast rather than infinitely fast). Transfers of
        0 bytes carry no bandwidth information and are ignored. ValueError on negative or
        non-finite input, or ``seconds <= 0`` with bytes moved.
        """
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds must be finite and > 0, got {seconds}")
        if num_bytes == 0:
            return
        wire_seconds = max(seconds - self._latency, seconds * 0.01)
        sample = num_bytes / wire_seconds
        with self._lock:
            self._bandwidth = (1 - self._alpha) * self._bandwidth + self._alpha * sample
