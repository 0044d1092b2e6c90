"""The fitted profile of one LLM: its prefill and decode time models in one JSON file.

``kvflow profile --model DIR`` measures the engine, fits both models and calls
:meth:`Profile.save` (``DIR/kvflow_profile.json``); the server calls :func:`load_profile`, which
falls back to the defaults when no profile exists yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.router.errors import ProfileFormatError, ProfileMismatchError
from kvflow.router.estimators import (
    FORMAT_VERSION,
    PROFILE_FILENAME,
    DecodeTimeModel,
    PrefillTimeModel,
    read_json,
    write_json_atomic,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """Both time models of one LLM; ``is_default`` is True when no measured profile was found."""

    prefill: PrefillTimeModel
    decode: DecodeTimeModel
    is_default: bool = False

    def __post_init__(self) -> None:
        if self.prefill.model_id != self.decode.model_id:
            raise ValueError(
                f"prefill.model_id {self.prefill.model_id!r} != decode.model_id "
                f"{self.decode.model_id!r}"
            )

    @property
    def model_id(self) -> str:
        return self.prefill.model_id

    @classmethod
    def default(cls) -> Profile:
        return cls(PrefillTimeModel.default(), DecodeTimeModel.default(), is_default=True)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model_id": self.model_id,
            "prefill": self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
        }

    @classmethod
    def from_dict(cls, doc: Any) -> Profile:
        """Raises ProfileFormatError on a malformed document."""
        if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION:
            raise ProfileFormatError(
                f"profile must be a JSON object with format_version {FORMAT_VERSION}"
            )
        profile_id = doc.get("model_id")
        prefill = PrefillTimeModel.from_dict(doc.get("prefill"))
        decode = DecodeTimeModel.from_dict(doc.get("decode"))
        if not (profile_id == prefill.model_id == decode.model_id):
            raise ProfileFormatError(
                f"profile model_id {profile_id!r} disagrees with its models "
                f"({prefill.model_id!r}, {decode.model_id!r})"
            )
        return cls(prefill, decode)

    def save(self, model_dir: str | Path) -> Path:
        """Write ``model_dir/kvflow_profile.json`` atomically; returns the path."""
        path = Path(model_dir) / PROFILE_FILENAME
        write_json_atomic(path, self.to_dict())
        return path


def load_profile(model_dir: str | Path, model_id: str | None = None) -> Profile:
    """The profile stored in ``model_dir``, or :meth:`Profile.default` when there is none.

    Raises ProfileFormatError for an unreadable file, and ProfileMismatchError when ``model_id``
    is given and the file was fitted for another model (a stale profile would mis-route).
    """
    path = Path(model_dir) / PROFILE_FILENAME
    if not path.exists():
        logger.info("no profile at path=%s; using default time models", path)
        return Profile.default()
    profile = Profile.from_dict(read_json(path))
    if model_id is not None and profile.model_id != model_id:
        raise ProfileMismatchError(
            f"{path} was fitted for model {profile.model_id!r}, not {model_id!r}; "
            "re-run `kvflow profile`"
        )
    return profile
