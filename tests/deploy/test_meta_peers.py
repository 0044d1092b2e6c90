"""`kvflow serve --role meta --peers`: every replica of a StatefulSet gets the same list (the
group's members, itself included); the replica leaves its own --address out."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from kvflow.tools.cli import build_parser
from kvflow.tools.meta import config_from_args

NAMES = [f"kvflow-meta-{i}.kvflow-meta.ns.svc.cluster.local:7100" for i in range(3)]


@pytest.fixture(autouse=True)
def cluster_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica with partners needs the cluster secret (its Raft password)."""
    path = tmp_path / "cluster.secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    monkeypatch.setenv("KVFLOW_CLUSTER_SECRET_FILE", str(path))


def _config(address: str, peers: str) -> object:
    args = build_parser("serve").parse_args(
        ["serve", "--role=meta", f"--address={address}", f"--peers={peers}", "--memory-journal"]
    )
    return config_from_args(args)


@pytest.mark.parametrize("me", range(3))
def test_own_address_is_left_out_of_the_shared_list(me: int) -> None:
    config = _config(NAMES[me], ",".join(NAMES))
    assert config.self_address == NAMES[me]  # type: ignore[attr-defined]
    assert config.partner_addresses == tuple(n for n in NAMES if n != NAMES[me])  # type: ignore[attr-defined]


def test_the_others_only_still_works() -> None:
    config = _config(NAMES[0], ",".join(NAMES[1:]))
    assert config.partner_addresses == tuple(NAMES[1:])  # type: ignore[attr-defined]


def test_raft_peers_names_are_resolved_again_within_seconds() -> None:
    """A replica rescheduled on another IP keeps its DNS name; the others must dial the new
    address soon (pysyncobj caches a resolved name for 600 s by default)."""
    from kvflow.replication import MetadataConfig
    from kvflow.replication.raft import syncobj_conf

    conf = syncobj_conf(MetadataConfig(self_address=NAMES[0], partner_addresses=tuple(NAMES[1:])))
    assert conf.dnsCacheTime <= 5.0
    assert conf.dnsFailCacheTime <= 1.0
