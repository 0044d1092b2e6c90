"""MemberConfig from a Mooncake/SGLang config mapping: the kvflow_ keys, checked by name."""

from __future__ import annotations

import pytest

from kvflow.integrations.config import MemberConfig


def test_same_host_shm_is_on_by_default_and_can_be_turned_off() -> None:
    assert MemberConfig.from_mapping({}, node_id="m0").same_host_shm is True
    config = MemberConfig.from_mapping({"kvflow_same_host_shm": False}, node_id="m0")
    assert config.same_host_shm is False
    with pytest.raises(ValueError, match="same_host_shm must be a bool"):
        MemberConfig.from_mapping({"kvflow_same_host_shm": "no"}, node_id="m0")
    with pytest.raises(ValueError, match="kvflow_same_host: unknown kvflow option"):
        MemberConfig.from_mapping({"kvflow_same_host": True}, node_id="m0")
