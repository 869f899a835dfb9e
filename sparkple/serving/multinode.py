"""A pair node's multi-node words of `vllm serve`: two Sparks at tensor parallelism 2 on vLLM's
multi-node mp engine, the head (rank 0) serving the API and the worker (rank 1) headless. The
pair itself, from the inventory, is sparkple.pair.plan."""

from __future__ import annotations

from .recipe import ServingError

TP_SIZE = 2
HEAD, WORKER = 0, 1


def node_args(rank: int, master_addr: str, master_port: int) -> list[str]:
    """The multi-node words of a pair node's `vllm serve`: the head (rank 0) serves the API,
    the worker (rank 1) runs `--headless`; both meet at the head's link address and port."""
    if rank not in (HEAD, WORKER):
        raise ServingError(f"pair rank {rank!r}: use 0 (the head) or 1 (the worker)")
    if not isinstance(master_addr, str) or not master_addr.strip():
        raise ServingError("the pair's master address is empty: set the head's link address")
    if not 1 <= master_port <= 65535:
        raise ServingError(f"the pair's master port {master_port} is not a TCP port")
    args = [
        f"--tensor-parallel-size={TP_SIZE}",
        f"--nnodes={TP_SIZE}",
        f"--node-rank={rank}",
        f"--master-addr={master_addr.strip()}",
        f"--master-port={master_port}",
    ]
    return args + (["--headless"] if rank == WORKER else [])
