"""The profile file beside a model: defaults when absent, identity checked when present."""

from __future__ import annotations

import json

import pytest

from kvflow.router import (
    PROFILE_FILENAME,
    DecodeTimeModel,
    PrefillTimeModel,
    Profile,
    ProfileFormatError,
    ProfileMismatchError,
    load_profile,
)


def fitted(model_id: str = "demo@1") -> Profile:
    return Profile(
        PrefillTimeModel((0.01, 2e-4, 1e-9, 1e-6), model_id),
        DecodeTimeModel((0.02, 1e-3, 1e-7), model_id),
    )


def test_absent_profile_gives_defaults(tmp_path):
    profile = load_profile(tmp_path)
    assert profile.is_default
    assert profile.prefill == PrefillTimeModel.default()


def test_round_trip_in_model_dir(tmp_path):
    path = fitted().save(tmp_path)
    assert path == tmp_path / PROFILE_FILENAME == tmp_path / "kvflow_profile.json"
    loaded = load_profile(tmp_path, model_id="demo@1")
    assert loaded == fitted()
    assert not loaded.is_default


def test_profile_of_another_model_is_refused(tmp_path):
    fitted("other").save(tmp_path)
    with pytest.raises(ProfileMismatchError, match="'other', not 'demo@1'"):
        load_profile(tmp_path, model_id="demo@1")


def test_inconsistent_profile_is_refused(tmp_path):
    doc = fitted().to_dict()
    doc["model_id"] = "x"
    (tmp_path / PROFILE_FILENAME).write_text(json.dumps(doc))
    with pytest.raises(ProfileFormatError, match="disagrees"):
        load_profile(tmp_path)
    with pytest.raises(ValueError, match="model_id"):
        Profile(PrefillTimeModel.default(), DecodeTimeModel((0.0, 0.0, 0.0), "y"))
