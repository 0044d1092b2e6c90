"""What every torch benchmark records about its run in its ``--json`` document."""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path
from typing import Any


def run_meta(args: argparse.Namespace) -> dict[str, Any]:
    """Python and torch versions, torch's thread count, the machine, its CPU's model and the
    instruction set the CPU kernels were built for (and the GPU, where the run's ``--device``
    is one) and the arguments."""
    import torch

    from kvflow.stages.engine.cpu_kernels import ENV_ISA

    device = str(getattr(args, "device", "cpu"))
    gpu = {"gpu": torch.cuda.get_device_name(device)} if device.startswith("cuda") else {}
    return {
        **gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "kernel_isa": os.environ.get(ENV_ISA, "native"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
