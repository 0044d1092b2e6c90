"""RouterTarget: the WarmTarget of a cluster router (serve/warmup_targets.py's FrontendTarget plus
what only a cluster has).

- The cache it sees is the metadata's holders among the *healthy* prefill nodes: blocks of a
  node that died are not counted as cached, so a job redoes them elsewhere.
- Pins live on the nodes: ``pin`` asks every healthy prefill node holding some of the keys to
  pin them for the job's TTL (``Node.Pin``); the node drops them itself when it lapses, so the
  pins outlive this router and ``unpin`` has nothing to do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from kvflow.kvdb import Namespace
from kvflow.stages.api import node_pb2
from kvflow.stages.serve.warmup_targets import FrontendTarget

logger = logging.getLogger(__name__)

PIN_TIMEOUT_S = 10.0


class RouterTarget(FrontendTarget):
    """Build on the router's event loop (after ``RouterServer.start``)."""

    supports_pins = True

    def __init__(self, frontend: Any) -> None:
        super().__init__(frontend)
        self._loop = asyncio.get_running_loop()

    def _healthy_prefill(self) -> dict[str, Any]:
        return {name: n for name, n in self._f.prefill.items() if n.state.healthy}

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """Leading keys with a holder among the healthy prefill nodes (a fresh metadata read)."""
        view = self._f.metadata.view()
        forget = getattr(view, "forget", None)
        if forget is not None:
            forget(list(keys))
        healthy = set(self._healthy_prefill())
        n = 0
        for h in view.holders(list(keys)):
            if not any(str(node) in healthy for node in h):
                break
            n += 1
        return n

    def pin(self, namespace: Namespace, keys: Sequence[bytes], ttl_s: float) -> Any:
        """Blocking (call from a thread): ``Node.Pin`` on each healthy prefill node holding some
        of ``keys``. Returns {node: blocks pinned}; a node that fails is logged and left out."""
        rows = self._f.metadata.view().holders(list(keys))
        per_node: dict[str, list[bytes]] = {}
        for key, holders in zip(keys, rows, strict=True):
            for node in holders:
                per_node.setdefault(str(node), []).append(key)
        nodes = self._healthy_prefill()
        calls = {
            name: self._pin_on(nodes[name], ks, ttl_s)
            for name, ks in per_node.items()
            if name in nodes
        }
        fut = asyncio.run_coroutine_threadsafe(_gather(calls), self._loop)
        return fut.result(PIN_TIMEOUT_S + 1.0)

    @staticmethod
    async def _pin_on(node: Any, keys: list[bytes], ttl_s: float) -> int:
        reply = await node.stub.Pin(
            node_pb2.PinRequest(keys=keys, ttl_s=ttl_s), timeout=PIN_TIMEOUT_S
        )
        return int(reply.pinned)

    def unpin(self, token: Any) -> None:
        """Nothing: the nodes drop the pins when their TTL lapses."""


async def _gather(calls: dict[str, Any]) -> dict[str, int]:
    names = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    out = {}
    for name, result in zip(names, results, strict=True):
        if isinstance(result, BaseException):
            detail = result.details() if isinstance(result, grpc.aio.AioRpcError) else result
            logger.warning("warm-up: pinning on node=%s failed: %s", name, detail)
        else:
            out[name] = result
    return out
