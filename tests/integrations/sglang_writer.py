"""A second SGLang-like process for the cluster tests: joins the cluster through the HiCache
backend, writes seeded pages, prints one READY line, and serves until its stdin closes.

python -m tests.integrations.sglang_writer META_ADDRESS NODE_ID MODEL SEED PAGES [LAYOUT]
"""

from __future__ import annotations

import sys

from tests.integrations.conftest import create_backend
from tests.integrations.sglang_pools import fill, indices, make_pool


def main(argv: list[str]) -> int:
    meta, node_id, model, seed, pages = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    layout = argv[5] if len(argv) > 5 else "page_first"
    pool = make_pool("mha", layout, pages=max(pages, 1))
    fill(pool, seed)
    backend = create_backend(
        pool, False, model=model, kvflow_meta=meta, kvflow_node_id=node_id, kvflow_engine="memory"
    )
    keys = [f"page-{i}" for i in range(pages)]
    ok = backend.batch_set_v1(keys, indices(list(range(pages)), pool.page_size))
    backend.member.store.flush_metadata()  # holders visible to peers now
    print(f"READY {sum(ok)}", flush=True)
    sys.stdin.read()
    backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
