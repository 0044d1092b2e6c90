"""The backend registry: backends are picked by name, never by an if/elif over names.

Built-in backends register themselves when their modules are first imported (at the first
lookup); a third party registers its own class with :func:`register_backend`.
"""

from __future__ import annotations

import importlib

from kvflow.transfer.backends.base import Backend
from kvflow.transfer.errors import BackendUnavailableError

_BACKENDS: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Register ``cls`` under ``cls.name`` (usable as a class decorator); ValueError on a clash."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend class {cls.__name__} must set a non-empty str `name`")
    existing = _BACKENDS.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"backend name {name!r} is already registered by {existing.__name__}")
    _BACKENDS[name] = cls
    return cls


def backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``; BackendUnavailableError if there is none."""
    _load_builtins()
    try:
        return _BACKENDS[name]
    except KeyError:
        raise BackendUnavailableError(
            f"no transfer backend named {name!r}; known: {sorted(_BACKENDS)}"
        ) from None


def backend_names(*, available_only: bool = False) -> list[str]:
    """Registered backend names (sorted), optionally only those available on this host."""
    _load_builtins()
    return sorted(n for n, c in _BACKENDS.items() if not available_only or c.available())


_BUILTIN_MODULES = (
    "kvflow.transfer.backends.local",
    "kvflow.transfer.backends.shm",
    "kvflow.transfer.backends.tcp",
    "kvflow.transfer.backends.rdma",
)


def _load_builtins() -> None:
    """Import the built-in backend modules; each registers its class when first imported."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
