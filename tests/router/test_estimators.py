"""Fitting, predicting and persisting the time models; the transfer EWMA."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from kvflow.router import (
    DecodeSample,
    DecodeTimeModel,
    FitError,
    PrefillTimeModel,
    ProfileFormatError,
    ProfileSample,
    TransferEstimator,
)

TRUE_PREFILL = (0.02, 3e-4, 4e-9, 2e-6)
TRUE_DECODE = (0.015, 8e-4, 3e-7)


def prefill_samples(noise: float, seed: int = 1) -> list[ProfileSample]:
    rng = random.Random(seed)
    truth = PrefillTimeModel(TRUE_PREFILL)
    out = []
    for n in (64, 256, 1024, 2048, 4096, 8192):
        for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
            p = int(n * frac)
            t = truth.predict(n, p) * (1 + rng.uniform(-noise, noise))
            out.append(ProfileSample(n, p, t))
    return out


def test_prefill_fit_recovers_exact_coefficients():
    model = PrefillTimeModel.fit(prefill_samples(0.0), model_id="m")
    assert model.coefficients == pytest.approx(TRUE_PREFILL, rel=1e-6)
    assert model.model_id == "m"


def test_prefill_fit_with_noise_predicts_within_tolerance():
    model = PrefillTimeModel.fit(prefill_samples(0.02))
    truth = PrefillTimeModel(TRUE_PREFILL)
    for n, p in ((512, 0), (3000, 1000), (8000, 7000)):
        assert model.predict(n, p) == pytest.approx(truth.predict(n, p), rel=0.05)


def test_decode_fit_recovers_coefficients():
    truth = DecodeTimeModel(TRUE_DECODE)
    samples = [
        DecodeSample(b, c, truth.predict(b, c)) for b in (1, 4, 16, 64) for c in (100, 5000, 40000)
    ]
    assert DecodeTimeModel.fit(samples).coefficients == pytest.approx(TRUE_DECODE, rel=1e-6)


def test_predict_never_negative_and_checks_lengths():
    model = PrefillTimeModel((-1.0, 0.0, 0.0, 0.0))
    assert model.predict(100, 0) == 0.0
    with pytest.raises(ValueError, match="reused_len"):
        model.predict(10, 11)
    with pytest.raises(ValueError):
        DecodeTimeModel.default().predict(-1, 0)


def test_fit_needs_enough_samples():
    with pytest.raises(FitError, match=">= 4 samples"):
        PrefillTimeModel.fit(prefill_samples(0.0)[:3])
    with pytest.raises(ValueError, match="reused_len"):
        ProfileSample(10, 20, 1.0)
    with pytest.raises(ValueError, match="seconds"):
        DecodeSample(1, 0, float("nan"))


def test_defaults_are_sensible():
    prefill = PrefillTimeModel.default()
    assert 0 < prefill.predict(64, 0) < prefill.predict(1024, 0) < prefill.predict(4096, 0)
    assert prefill.predict(1024, 960) < prefill.predict(1024, 0) / 5
    decode = DecodeTimeModel.default()
    assert 0 < decode.predict(1, 100) < decode.predict(8, 4000)


def test_save_load_round_trip(tmp_path):
    prefill = PrefillTimeModel.fit(prefill_samples(0.01), model_id="demo@abc")
    prefill.save(tmp_path / "p.json")
    assert PrefillTimeModel.load(tmp_path / "p.json") == prefill
    decode = DecodeTimeModel(TRUE_DECODE, "demo@abc")
    decode.save(tmp_path / "d.json")
    assert DecodeTimeModel.load(tmp_path / "d.json") == decode
    doc = json.loads((tmp_path / "p.json").read_text())
    assert (doc["format_version"], doc["kind"], doc["model_id"]) == (1, "prefill", "demo@abc")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"format_version": 99}, "format_version"),
        ({"kind": "decode"}, "kind"),
        ({"coefficients": [1, 2]}, "coefficients"),
        ({"coefficients": [1, 2, "x", 4]}, "coefficients"),
        ({"model_id": ""}, "model_id"),
    ],
)
def test_load_rejects_bad_documents(tmp_path, edit, match):
    doc = PrefillTimeModel.default().to_dict() | edit
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileFormatError, match=match):
        PrefillTimeModel.load(path)


def test_load_rejects_non_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileFormatError, match="not valid JSON"):
        PrefillTimeModel.load(path)


def test_transfer_estimate_and_ewma():
    est = TransferEstimator(1e9, latency_s=0.001, alpha=0.5)
    assert est.estimate(0) == 0.0
    assert est.estimate(10**9) == pytest.approx(1.001)
    est.observe(10**9, 0.501)  # measured 2 GB/s on the wire
    assert est.bandwidth_bytes_per_s == pytest.approx(1.5e9)
    est.observe(0, 1.0)  # no information
    assert est.bandwidth_bytes_per_s == pytest.approx(1.5e9)
    with pytest.raises(ValueError, match="num_bytes"):
        est.estimate(-1)
    with pytest.raises(ValueError, match="seconds"):
        est.observe(10, 0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        TransferEstimator(0.0)


def test_decode_predict_many_skips_the_clip_only_where_it_changes_no_bit():
    batches, contexts = np.array([1, 3, 8]), np.array([0, 500, 90_000])
    signs = [(2e-2, 2e-3, 1e-6), (0.0, 0.0, 0.0), (-0.0, -0.0, -0.0), (-1.0, 1e-3, 0.0)]
    for coefficients in signs:
        model = DecodeTimeModel(coefficients)
        many = model.predict_many(batches, contexts).tolist()
        c0, c1, c2 = coefficients
        clipped = np.maximum(0.0, (c0 + c1 * batches) + c2 * contexts).tolist()
        assert [math.copysign(1.0, x) for x in many] == [math.copysign(1.0, x) for x in clipped]
        assert many == clipped
        pairs = zip(batches.tolist(), contexts.tolist(), strict=True)
        assert many == [model.predict(b, c) for b, c in pairs]


@pytest.mark.parametrize(
    "coefficients",
    [
        (2e-2, 2e-3, 1e-6),
        (0.0, 0.0, 0.0),
        (-0.0, -0.0, -0.0),
        (-1.0, 1e-3, 0.0),
        (1e-3, -1e-4, 2e-8),
    ],
)
def test_decode_joined_predictions_equal_the_array_path(coefficients):
    rng = random.Random(7)
    # few batch sizes and contexts, so some states tie and some predictions clamp at 0.0
    states = list(
        {(rng.randrange(12), rng.choice((0, 1, 500, rng.randrange(90_000)))) for _ in range(40)}
    )
    model = DecodeTimeModel(coefficients)
    for prompt_len in (0, 1, 700, 30_000):
        batches = np.array([b for b, _ in states])
        contexts = np.array([c for _, c in states])
        want = model.predict_many(batches + 1, contexts + prompt_len).tolist()
        joined = model.predict_joined(states, prompt_len)
        assert [math.copysign(1.0, x) for x in joined] == [math.copysign(1.0, x) for x in want]
        assert joined == want
        groups = {state: f"members of {state}" for state in states}
        lowest, tied = model.lowest_joined(groups, prompt_len)
        assert lowest == min(want)
        assert tied == [groups[s] for s, t in zip(states, want, strict=True) if t == min(want)]
