"""ReuseLoadStage keeps the peers mapping it is given, even while it is empty: a node that
registers first sees no peers at start, and must see the ones that register after it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from kvflow.stages.reuse_load import ReuseLoadStage


class LivePeers(Mapping[str, Any]):
    """Like RemotePeers: its contents change after the stage is built."""

    def __init__(self) -> None:
        self.current: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        return self.current[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.current)

    def __len__(self) -> int:
        return len(self.current)


def test_an_empty_live_peers_mapping_is_kept() -> None:
    peers = LivePeers()
    stage = ReuseLoadStage({}, (1, 2, 1, 16, 4), torch.float32, 16, peers=peers)
    peers.current["prefill-1"] = object()  # a node registers after this one started
    assert list(stage._peers) == ["prefill-1"]


def test_no_peers_is_an_empty_mapping() -> None:
    stage = ReuseLoadStage({}, (1, 2, 1, 16, 4), torch.float32, 16)
    assert len(stage._peers) == 0
