"""The cluster secret file: generated private, refused when readable by others, one key per
channel."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvflow.security import generate_secret_file, load_secret_file


def test_generated_file_is_private_and_loads_back(tmp_path: Path) -> None:
    path = tmp_path / "s" / "cluster.secret"
    secret = generate_secret_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_secret_file(path) == secret
    assert secret.value.hex() not in repr(secret)
    with pytest.raises(FileExistsError):
        generate_secret_file(path)  # never overwritten


def test_world_readable_or_short_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "cluster.secret"
    generate_secret_file(path)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_secret_file(path)
    short = tmp_path / "short"
    short.write_text("abcd")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_secret_file(short)


def test_each_channel_has_its_own_key(tmp_path: Path) -> None:
    secret = generate_secret_file(tmp_path / "s")
    keys = {secret.grpc_token(), secret.raft_password(), secret.transfer_key().hex()}
    assert len(keys) == 3
    assert secret.value.hex() not in keys
