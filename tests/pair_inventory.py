"""A pair's host variables for the tests: two Sparks serving one model at tensor parallelism 2,
the head (rank 0) and the worker (rank 1), as an inventory names them (docs/two-sparks.md).

The defaults are the README's pair (one link interface and HCA name on both nodes, the link's
192.168.100.10 and .11) under the tests' host names spark-a and spark-b; a test passes only what
it is about (another name, loopback addresses, a cross-wired worker's HCA, a deliberately broken
node) as keyword overrides.
"""

from __future__ import annotations

from collections.abc import Mapping

HEAD, WORKER = "spark-a", "spark-b"
HEAD_ADDRESS, WORKER_ADDRESS = "192.168.100.10", "192.168.100.11"
INTERFACE, HCA = "enp1s0f1np1", "rocep1s0f1"
# both ports of a ConnectX-7 for NCCL, as docs/two-sparks.md recommends (sparkple.rdma)
TWIN_HCAS = "rocep1s0f1,roceP2p1s0f1"


def pair_node(
    rank: int,
    address: str,
    *,
    pair: str = "p1",
    interface: str = INTERFACE,
    hca: str = HCA,
    **more: object,
) -> dict[str, object]:
    """One node's sparkple_pair_* variables; `more` adds or overrides any variable."""
    return {
        "sparkple_pair": pair,
        "sparkple_pair_rank": rank,
        "sparkple_pair_link_address": address,
        "sparkple_pair_link_interface": interface,
        "sparkple_pair_ib_hca": hca,
        **more,
    }


def pair_hostvars(
    *,
    hosts: tuple[str, str] = (HEAD, WORKER),
    pair: str = "p1",
    addresses: tuple[str, str] = (HEAD_ADDRESS, WORKER_ADDRESS),
    interface: str = INTERFACE,
    hcas: tuple[str, str] = (HCA, HCA),
    both: Mapping[str, object] | None = None,
    head: Mapping[str, object] | None = None,
    worker: Mapping[str, object] | None = None,
) -> dict[str, dict[str, object]]:
    """{head host: its variables, worker host: its variables}, head first.

    `hosts`, `addresses` and `hcas` are (head's, worker's); `both` is merged into each node's
    variables (connection settings, a knob of the pair), then `head` and `worker` into that
    node's alone, so a test can override anything, the pair's own variables included.
    """
    nodes = {}
    for rank, own in enumerate((head, worker)):
        variables = pair_node(rank, addresses[rank], pair=pair, interface=interface, hca=hcas[rank])
        nodes[hosts[rank]] = {**variables, **(both or {}), **(own or {})}
    return nodes
