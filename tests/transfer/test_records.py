"""Validation of the pure records, the config and buffer views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.transfer import OpCode, SegmentHandle, TransferConfig, TransferRequest
from kvflow.transfer.memory import as_byte_view

HANDLE = SegmentHandle("local", "local", "seg", 1, 100)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("connections_per_peer", 0),
        ("slice_size", 100),
        ("max_endpoints", 0),
        ("io_timeout_s", 0),
        ("request_timeout_s", -1.0),
        ("max_retries", -1),
        ("path_retry_s", -0.5),
        ("engine_name", "has space"),
        ("max_batch_capacity", True),
    ],
)
def test_config_rejects_bad_fields_naming_them(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TransferConfig(**{field: value})  # type: ignore[arg-type]


def test_config_engine_names_are_random_by_default() -> None:
    assert TransferConfig().engine_name != TransferConfig().engine_name


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"local_offset": -1}, "local_offset"),
        ({"remote_offset": -5}, "remote_offset"),
        ({"length": 0}, "length"),
        ({"opcode": "read"}, "opcode"),
        ({"local_segment": ""}, "local_segment"),
        ({"target": "local"}, "target"),
    ],
)
def test_request_rejects_bad_fields(kwargs: dict[str, object], field: str) -> None:
    fields: dict[str, object] = {
        "opcode": OpCode.READ,
        "local_segment": "buf",
        "local_offset": 0,
        "target": HANDLE,
        "remote_offset": 0,
        "length": 10,
    }
    fields.update(kwargs)
    with pytest.raises(ValueError, match=field):
        TransferRequest(**fields)  # type: ignore[arg-type]


def test_byte_views_alias_the_callers_memory() -> None:
    array = np.zeros((4, 8), dtype=np.float32)
    view = as_byte_view(array)
    assert view.nbytes == 128 and view.format == "B"
    view[0:4] = np.float32(1.5).tobytes()
    assert array[0, 0] == 1.5

    tensor = torch.zeros(16, dtype=torch.float16)
    tview = as_byte_view(tensor)  # through DLPack, no torch import in kvflow.transfer
    tview[:2] = np.float16(3.0).tobytes()
    assert tensor[0].item() == 3.0

    bf16 = torch.zeros(16, dtype=torch.bfloat16)  # numpy has no bfloat16: the uint8 view works
    with pytest.raises(TypeError, match="DLPack"):
        as_byte_view(bf16)
    as_byte_view(bf16.view(torch.uint8).numpy())[:2] = bytes([0x40, 0x40])
    assert bf16[0].item() == 3.0

    raw = bytearray(10)
    as_byte_view(memoryview(raw))[3] = 7
    assert raw[3] == 7


def test_byte_views_reject_unusable_buffers() -> None:
    with pytest.raises(TypeError, match="writable"):
        as_byte_view(b"read only")
    with pytest.raises(TypeError, match="contiguous"):
        as_byte_view(np.zeros((4, 4), dtype=np.uint8)[:, 1])
    with pytest.raises(TypeError, match="buffer protocol"):
        as_byte_view(object())
    with pytest.raises(ValueError, match="empty"):
        as_byte_view(bytearray())
