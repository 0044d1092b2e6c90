"""The WarmTargets of the embedded server (``EmbeddedTarget``) and the base every frontend
shares (``FrontendTarget``: the pipeline, conductor, tokenizer and metadata of a Frontend).
A cluster router's is serve/warmup_router.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvflow.kvdb import Namespace
from kvflow.pipeline import Priority, RequestContext
from kvflow.stages.engine.model_card import ModelCard
from kvflow.stages.hash import namespace_for
from kvflow.stages.state import GenerateState
from kvflow.stages.warmup.materialize import Materializer


class FrontendTarget:
    """A WarmTarget over a Frontend (the embedded server or a router), after its start."""

    supports_pins = False

    def __init__(self, frontend: Any) -> None:
        self._f = frontend
        self.block_size = int(frontend.block_size)
        self.block_nbytes = int(frontend.conductor.config.block_nbytes)
        self.max_model_len = int(frontend.max_model_len)
        vocab = frontend.tokenizer.vocab_size
        self._vocab = min(vocab, getattr(frontend, "vocab_size", vocab))
        self._card = ModelCard.from_dir(frontend.model_dir)

    def namespace(self, tenant: str) -> Namespace:
        return namespace_for(tenant, self._f.model_fingerprint, self._f.layout)

    def materializer(self) -> Materializer:
        return Materializer(
            self._f.tokenizer, self._card.chat_template, self.block_size, self._vocab
        )

    def holders(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        rows = self._f.metadata.view().holders(list(keys))
        return [{str(n): _tier_name(t) for n, t in h.items()} for h in rows]

    def replica_target(self, key: bytes) -> int:
        return int(self._f.metadata.view().replica_target(key))

    def set_replica_target(self, keys: Sequence[bytes], n: int) -> None:
        for key in keys:
            self._f.metadata.set_replica_target(key, n, time.time())

    def pin(self, namespace: Namespace, keys: Sequence[bytes], ttl_s: float) -> Any:
        raise NotImplementedError("pins are held by shards; this frontend has none")

    def unpin(self, token: Any) -> None:
        raise NotImplementedError("pins are held by shards; a router has none")

    def prefill_slots(self) -> int:
        return max(1, sum(1 for p in self._f.prefill.values() if p.state.healthy))

    def online_busy(self, warm_in_flight: int) -> bool:
        # This process's pipeline: another router's traffic reaches the conductor's books
        # through the nodes' load reports, which lag by a refresh, so it is not gated on.
        # Interactive requests waiting for admission come first, too.
        waiting = self._f.admission.waiting(Priority.INTERACTIVE)
        return bool(self._f.pipeline.in_flight() > warm_in_flight or waiting)

    def submit(self, request_id: str, state: GenerateState) -> Any:
        return self._f.pipeline.try_submit(RequestContext(request_id, state=state))

    def predict_prefill_s(self, prompt_len: int, reused_tokens: int) -> float:
        return float(self._f.conductor.predict_prefill_s(prompt_len, reused_tokens))

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        """Leading keys with a holder among the prefill nodes, from the metadata."""
        view = self._f.metadata.view()
        forget = getattr(view, "forget", None)
        if forget is not None:
            forget(list(keys))  # a fresh answer, not the view's cache
        prefill = set(self._f.prefill)
        n = 0
        for h in view.holders(list(keys)):
            if not any(str(node) in prefill for node in h):
                break
            n += 1
        return n


class EmbeddedTarget(FrontendTarget):
    """The embedded server: the shards in this process answer (no metadata lag) and pin."""

    supports_pins = True

    def holders(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        shards = [(sid, shard) for sid, (shard, _) in self._f.shards().items()]
        rows = []
        for key in keys:
            tiers = {sid: shard.tier_of(key) for sid, shard in shards}
            rows.append({sid: _tier_name(t) for sid, t in tiers.items() if t is not None})
        return rows

    def cached_blocks(self, keys: Sequence[bytes]) -> int:
        return max((p.match_prefix(list(keys)) for p in self._f.prefill.values()), default=0)

    def pin(self, namespace: Namespace, keys: Sequence[bytes], ttl_s: float) -> Any:
        """Pin the leading ``keys`` each prefill shard holds; returns (client, keys) pairs."""
        taken = []
        for p in self._f.prefill.values():
            n = p.match_prefix(list(keys))
            if n:
                client = p.client(namespace)
                ok = client.pin(list(keys[:n]))
                taken.append(
                    (client, [k for k, pinned in zip(keys[:n], ok, strict=True) if pinned])
                )
        return taken

    def unpin(self, token: Any) -> None:
        for client, keys in token:
            if keys:
                client.unpin(keys)


def _tier_name(tier: Any) -> str:
    return str(getattr(tier, "name", tier)).lower()
