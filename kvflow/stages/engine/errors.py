"""Errors raised by the torch model engine.

Every error the engine raises on purpose derives from `EngineError`, so a caller can catch
the family in one place. Validation errors are raised *before* any state changes: the engine
keeps serving its other requests.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """The model directory cannot be loaded: a missing file, an unsupported architecture or
    config field, a weight whose name or shape does not match the config."""


class InvalidRequestError(EngineError):
    """A request breaks the API contract: token ids outside the vocabulary, a prompt longer
    than `max_model_len`, nothing left to compute, a duplicate or unknown request id."""


class UnknownRequestError(InvalidRequestError):
    """The request id is not known to the engine (never added, or already released)."""


class OutOfPagesError(InvalidRequestError):
    """The page pool has too few free pages for the request; retry after others finish."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"request needs {needed} KV pages but only {free} are free")
        self.needed = needed
        self.free = free


class PageLayoutError(EngineError):
    """An imported page does not match the engine's page layout (size, shape, dtype, count)
    or holds non-finite values."""


class ChatTemplateError(EngineError):
    """The model's chat template cannot render these messages (the template raised, e.g.
    "roles must alternate", or the messages are not a list of dicts), or the model directory
    has no chat template. The caller's input is at fault: an HTTP front answers 400."""
