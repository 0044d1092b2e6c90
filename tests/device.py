"""The device the gpu-marked tests run on, and their marks: ``KVFLOW_TEST_DEVICE`` (``cuda``
unless set, so the same checks can be tried on ``cpu``); skipped where CUDA is asked for and
torch sees none."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("KVFLOW_TEST_DEVICE", "cuda")

MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(),
        reason="no CUDA device (torch.cuda.is_available() is False)",
    ),
]
