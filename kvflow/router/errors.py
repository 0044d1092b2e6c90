"""Errors of the router package.

Routing outcomes (an SLO that cannot be met, no healthy instance) are values
(:class:`kvflow.router.types.Rejection`), never exceptions. Exceptions here mean a broken contract
or unreadable input.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class of every error raised by kvflow.router."""


class UnknownPolicyError(RouterError, ValueError):
    """A routing policy name that is not in the registry; the message lists the known names."""


class ProfileFormatError(RouterError, ValueError):
    """A profile / estimator JSON file that is unreadable, of another format version or kind."""


class ProfileMismatchError(RouterError):
    """A profile fitted for another model than the one being served."""


class FitError(RouterError, ValueError):
    """Samples that cannot fit a model (too few, negative, non-finite)."""


class TraceFormatError(RouterError, ValueError):
    """A trace line that is not a valid Mooncake trace record; the message names line and field."""


class UnknownInstanceError(RouterError, KeyError):
    """An instance id or request id that the caller's state does not know."""
