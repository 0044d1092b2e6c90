"""Transfer backends: base (the interface), local, shm, tcp, rdma (see transfer.registry)."""
