"""kvdb's remote read path: a node's BlockService (``server``), the RemoteClient that reads
another node's DRAM blocks over the transfer engine (``reader``), the DRAM and remote leases
that keep a block in place while it is read, and their types and config.

Import the classes from ``kvflow.kvdb`` (the package root re-exports them); this package's
``__init__`` imports nothing, so that the shard can use ``dram_lease`` without a cycle.
"""
