"""A colocated server's prompt stores wait for other prompts' first tokens
(``runtime/store_gate.py``), but never hold up their own request's end."""

from __future__ import annotations

import time
from typing import Any

from tests.e2e.conftest import BLOCK


def test_a_request_ends_while_another_prompt_holds_the_gate(make_server: Any) -> None:
    """A colocated server: with the gate held shut (a prompt that never gets its first
    token), a request still completes, long before the gate's cap, and its blocks are stored:
    its decode's end makes its stores due."""
    server = make_server(colocate=True)
    gate = server.cluster.prefill["prefill-0"].store_gate
    gate.max_wait_s = 120.0  # only stores_due opens it sooner

    async def hold() -> None:
        gate.enter()

    server.call(hold)
    try:
        prompt = [(i * 13) % 200 + 5 for i in range(3 * BLOCK + 3)]
        started = time.monotonic()
        ids, _, _ = server.generate(prompt, max_tokens=4)
        assert time.monotonic() - started < 60.0
        assert len(ids) == 4
        shard = server.cluster.prefill["prefill-0"].store.shard
        assert shard.stats().dram.blocks >= 3  # the prompt's full blocks
    finally:

        async def release() -> None:
            gate.leave()

        server.call(release)
