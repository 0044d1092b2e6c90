"""What every torch benchmark records about its run in its ``--json`` document."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path
from typing import Any


def run_meta(args: argparse.Namespace) -> dict[str, Any]:
    """Python and torch versions, torch's thread count, the machine (and the GPU, where the
    run's ``--device`` is one) and the arguments."""
    import torch

    device = str(getattr(args, "device", "cpu"))
    gpu = {"gpu": torch.cuda.get_device_name(device)} if device.startswith("cuda") else {}
    return {
        **gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
