"""A cluster whose prefill and decode nodes run their engines on the device (``--device``):
the KV a prefill node computes on its GPU is streamed to the decode node's staging from the
prefill engine's host mirror, across processes, and stored in the prefill node's shard.

Never in the default run (marker ``gpu``); the device comes from ``KVFLOW_TEST_DEVICE``
(tests/device.py), so the same check can be tried on ``cpu``. The small demo model, whose
outputs depend on its KV.
"""

from __future__ import annotations

import random
from pathlib import Path

from kvflow.stages.api import pb2
from kvflow.stages.api.client import InferenceClient
from kvflow.stages.engine import Engine, EngineConfig, SamplingParams
from kvflow.tools.supervise import LocalCluster
from tests.device import DEVICE, MARKS
from tests.e2e.conftest import wait_recorded

pytestmark = MARKS


def test_nodes_on_the_device_stream_and_reuse_kv(small_model: Path, tmp_path: Path) -> None:
    cluster = LocalCluster(
        tmp_path,
        meta=1,
        prefill=1,
        decode=1,
        model=small_model,
        extra=("--device", DEVICE, "--block-size", "16", "--num-pages", "128", "--dram-mb", "32"),
    )
    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(150)]

    def generate(client: InferenceClient) -> tuple[list[int], int]:
        req = pb2.GenerateRequest(max_tokens=12, sampling=pb2.SamplingParams(ignore_eos=True))
        req.token_ids.ids.extend(prompt)
        events = list(client.generate(req, timeout=120))
        return [t for e in events for t in e.token_ids], events[-1].usage.cached_tokens

    try:
        cluster.start(timeout_s=240)
        with InferenceClient(cluster.addresses) as client:
            cold, cold_cached = generate(client)
            wait_recorded(cluster, "prefill-0", blocks=150 // 16)  # every prompt block stored
            warm, warm_cached = generate(client)
        engine = Engine.open(small_model, EngineConfig(block_size=16, device=DEVICE))
        direct = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        assert cold_cached == 0 and cold == direct  # streamed KV decodes as computed
        assert warm_cached == (150 // 16) * 16 and warm == direct  # cached == recomputed
        where = "" if DEVICE == "cpu" else f" on {DEVICE}"  # each node's plan names it
        for node in ("prefill-0", "decode-0"):
            assert f"memory{where}: " in cluster.procs[node].log_path.read_text()
    finally:
        cluster.stop()
