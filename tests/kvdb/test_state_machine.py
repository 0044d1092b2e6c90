"""A hypothesis state machine: put / get / remove / pin / evict / restart against a model dict.

The model holds what must be present. Blocks leave it only through explicit removes and
through BlockRemoved events that eviction emits (which must never name a pinned block); after
every step the shard must hold exactly the model's keys, with exactly the model's bytes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvflow.kvdb import BlockPinnedError, BlockRemoved, Shard, StoreConfig, Tier
from tests.kvdb.conftest import NAMESPACE, NBYTES, RECORD, keys, value

N_KEYS = 24
KEYS = keys(N_KEYS)
VALUES = [value(i).tobytes() for i in range(N_KEYS)]
index_st = st.integers(0, N_KEYS - 1)


class ShardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvdb-sm-"))
        self.config = StoreConfig(
            data_dir=self.dir,
            engine="lmdb",
            dram_capacity_bytes=4 * NBYTES,
            ssd_capacity_bytes=12 * RECORD,
            high_watermark=1.0,
            low_watermark=0.5,
            compression="zstd",
        )
        self.shard = Shard(self.config, NAMESPACE.fingerprint(), shuffle_bytes=2)
        self.model: dict[int, bytes] = {}
        self.pins: dict[int, int] = {}

    def _sync_events(self) -> None:
        for event in self.shard.take_events():
            if isinstance(event, BlockRemoved):
                i = KEYS.index(event.key)
                assert self.pins.get(i, 0) == 0, "a pinned block was evicted"
                self.model.pop(i, None)

    @rule(i=index_st, chained=st.booleans())
    def put(self, i: int, chained: bool) -> None:
        parent = KEYS[i - 1] if chained and i else None
        tier = self.shard.put(KEYS[i], VALUES[i], parent)
        if tier is not None:
            self.model[i] = VALUES[i]
        self._sync_events()

    @rule(i=index_st)
    def get(self, i: int) -> None:
        buf = np.empty(NBYTES, np.uint8)
        tier = self.shard.get_into(KEYS[i], buf)
        self._sync_events()
        if i in self.model:
            assert tier in (Tier.DRAM, Tier.SSD)
            assert buf.tobytes() == self.model[i]
        else:
            assert tier is None

    @rule(i=index_st)
    def remove(self, i: int) -> None:
        if self.pins.get(i, 0):
            with pytest.raises(BlockPinnedError):
                self.shard.remove(KEYS[i])
            return
        assert self.shard.remove(KEYS[i]) == (i in self.model)
        self.model.pop(i, None)
        self._sync_events()

    @rule(i=index_st)
    def pin(self, i: int) -> None:
        assert self.shard.pin([KEYS[i]]) == [i in self.model]
        if i in self.model:
            self.pins[i] = self.pins.get(i, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.shard.unpin([KEYS[i]])
        self.pins[i] -= 1

    @rule(blocks=st.integers(1, 6), ssd=st.booleans())
    def evict(self, blocks: int, ssd: bool) -> None:
        self.shard.evict(Tier.SSD if ssd else Tier.DRAM, blocks * NBYTES)
        self._sync_events()

    @rule()
    def restart(self) -> None:
        self.shard.close()
        self._sync_events()
        self.shard = Shard(self.config, NAMESPACE.fingerprint(), shuffle_bytes=2)
        self.pins.clear()  # pins belong to running requests, which a restart ends

    @invariant()
    def holds_exactly_the_model(self) -> None:
        held = {i for i, k in enumerate(KEYS) if self.shard.exists(k)}
        assert held == set(self.model)

    def teardown(self) -> None:
        self.shard.close()
        shutil.rmtree(self.dir, ignore_errors=True)


ShardMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestShardMachine = ShardMachine.TestCase
