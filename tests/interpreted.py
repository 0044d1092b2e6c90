"""A compiled module's interpreted twin, for tests that subclass its classes.

mypyc-compiled classes (see setup.py) cannot be subclassed by interpreted code. A test that
plants a bug in a subclass, to show that a check catches it, subclasses the class of the module
loaded from its ``.py`` source instead: the same code, interpreted, under another module name.
With a pure-Python build it is simply a second copy of the module.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def interpreted(module: str) -> ModuleType:
    """``module`` executed from its ``.py`` source as ``<module>__interpreted`` (cached)."""
    name = f"{module}__interpreted"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module)
    source = Path(spec.origin).with_name(module.rsplit(".", 1)[-1] + ".py")
    twin_spec = importlib.util.spec_from_file_location(name, source)
    assert twin_spec is not None and twin_spec.loader is not None
    twin = importlib.util.module_from_spec(twin_spec)
    sys.modules[name] = twin  # before exec: dataclasses look their module up by name
    twin_spec.loader.exec_module(twin)
    return twin
