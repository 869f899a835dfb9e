"""A pair: two Sparks serving one model at tensor parallelism 2 on vLLM's multi-node mp engine.

The inventory names a pair on each of its two hosts (`sparkple_pair`, the same name on both)
with the host's rank (0: the head, which serves the API; 1: the worker, `--headless`) and its
side of the link between them (address, interface, MTU, transport, RDMA device, an optional
pinned GID index). From those come the multi-node flags of `vllm serve`, the NCCL/Gloo
environment of each node, the arguments of its link check (sparkple.pair.link), and which
host is the other's peer. Every mistake in that description is refused here with the host and
the variable to fix, before anything starts.

Standard library only: the roles' filter plugin and the host programs import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..serving.multinode import HEAD, TP_SIZE, WORKER, node_args
from ..serving.recipe import ServingError
from .link import DEFAULT_MTU, TRANSPORTS

__all__ = ["Pair", "PairNode", "disagreements", "pair_of", "pairs_of"]

DEFAULT_MASTER_PORT = 29501
# The inventory variables that describe a pair (host vars on both of its hosts).
INVENTORY_VARS = (
    "sparkple_pair",
    "sparkple_pair_rank",
    "sparkple_pair_link_address",
    "sparkple_pair_link_interface",
    "sparkple_pair_ib_hca",
    "sparkple_pair_ib_gid_index",
    "sparkple_pair_master_port",
    "sparkple_pair_transport",
    "sparkple_pair_link_mtu",
)
# What NCCL's debug output must show for the head's transport check to read it (INIT: "Using
# network", NET: the device lines); only these two subsystems, so the log stays short.
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}

# What both nodes of a pair must agree on before either starts (preflight, tasks_from: pair),
# each with the words a refusal uses: a node serving another revision, other patches or another
# table would garble the output (each rank computes its half of every layer).
IDENTITY = {
    "checkpoint_revision": "checkpoint revision (model_checkpoint_revision)",
    "snapshot_manifest": "snapshot manifest sha256 (model_checkpoint's manifest of the revision)",
    "patch_manifest": "vLLM patch manifest sha256 (vllm_patches)",
    "table_fingerprint": "PLE table fingerprint (sparkple inspect-table --json)",
}


# Without these a node cannot serve at all (an unpatched pair has no patch manifest on either).
REQUIRED_IDENTITY = ("checkpoint_revision", "table_fingerprint")


def disagreements(head: Mapping[str, Any], worker: Mapping[str, Any]) -> list[str]:
    """What two nodes' identities (IDENTITY's keys, and `host`) differ in, one line each
    naming both hosts and both values; a value missing on one node only is a difference, and a
    required one missing on both is one too."""
    hosts = (head.get("host") or "the head", worker.get("host") or "the worker")
    found = []
    for key, words in IDENTITY.items():
        values = [head.get(key) or "", worker.get(key) or ""]
        if values[0] != values[1]:
            shown = [repr(v) if v else "none" for v in values]
            found.append(f"{words}: {hosts[0]} has {shown[0]}, {hosts[1]} has {shown[1]}")
        elif not values[0] and key in REQUIRED_IDENTITY:
            found.append(f"{words}: neither {hosts[0]} nor {hosts[1]} has one")
    return found


@dataclass(frozen=True)
class PairNode:
    """One side of the pair, as the inventory describes it."""

    host: str
    rank: int
    link_address: str
    link_interface: str
    ib_hca: str
    # pinned by the inventory; None: found in sysfs at each start (sparkple.pair.link)
    ib_gid_index: int | None
    transport: str = "ib"
    link_mtu: int = DEFAULT_MTU


@dataclass(frozen=True)
class Pair:
    name: str
    head: PairNode
    worker: PairNode
    master_port: int

    def node(self, host: str) -> PairNode:
        for node in (self.head, self.worker):
            if node.host == host:
                return node
        raise ServingError(f"{host} is not a node of pair {self.name}")

    def peer(self, host: str) -> PairNode:
        return self.worker if self.node(host).rank == HEAD else self.head

    def vllm_args(self, host: str) -> list[str]:
        """The multi-node words of this host's `vllm serve` (the recipe's own flags besides)."""
        return node_args(self.node(host).rank, self.head.link_address, self.master_port)

    def env(self, host: str) -> dict[str, str]:
        """The environment of this host's engine: its own link address (the address vLLM's
        workers announce), its own side of the link for NCCL and Gloo, and the transport forced:
        NCCL_NET=IB makes a missing IB path fail NCCL's init instead of falling back to sockets
        (NCCL_IB_GID_INDEX comes from the link check's env file, found at each start)."""
        node = self.node(host)
        env = {
            "VLLM_HOST_IP": node.link_address,
            "NCCL_SOCKET_IFNAME": node.link_interface,
            "GLOO_SOCKET_IFNAME": node.link_interface,
        }
        if node.transport == "ib":
            env |= {"NCCL_NET": "IB", "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": node.ib_hca}
        else:
            env |= {"NCCL_NET": "Socket", "NCCL_IB_DISABLE": "1"}
        return env | NCCL_DEBUG_ENV

    def link_check_args(self, host: str) -> list[str]:
        """The arguments of `sparkple pair-link-check` for this host's side of the link."""
        node, peer = self.node(host), self.peer(host)
        args = [
            f"--host={host}",
            f"--interface={node.link_interface}",
            f"--address={node.link_address}",
            f"--peer-address={peer.link_address}",
            f"--peer-port={self.master_port}",
            f"--mtu={node.link_mtu}",
            f"--transport={node.transport}",
        ]
        if node.transport == "ib":
            args.append(f"--ib-hca={node.ib_hca}")
            if node.ib_gid_index is not None:
                args.append(f"--gid-index={node.ib_gid_index}")
        return args

    def describe(self, host: str) -> dict[str, Any]:
        """What a role needs of the pair from this host's side (JSON-friendly)."""
        node, peer = self.node(host), self.peer(host)
        return {
            "name": self.name,
            "rank": node.rank,
            "role": "head" if node.rank == HEAD else "worker",
            "head": self.head.host,
            "worker": self.worker.host,
            "peer": peer.host,
            "peer_address": peer.link_address,
            "master_addr": self.head.link_address,
            "master_port": self.master_port,
            "transport": node.transport,
            "node": asdict(node),
            "vllm_args": self.vllm_args(host),
            "env": self.env(host),
            "link_check_args": self.link_check_args(host),
        }


def _node(host: str, hv: Mapping[str, Any]) -> PairNode:
    def need(var: str) -> str:
        value = hv.get(var, "")
        if not isinstance(value, str) or not value.strip():
            raise ServingError(
                f"{host} is in pair {hv.get('sparkple_pair')!r} but {var} is not set: "
                "set it in the host's inventory vars (see docs/two-sparks.md)"
            )
        return value.strip()

    def integer(var: str, default: int) -> int:
        value = hv.get(var, default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ServingError(f"{host}: {var} is {value!r}: use a whole number") from None

    rank = integer("sparkple_pair_rank", -1)
    if rank not in (HEAD, WORKER):
        raise ServingError(
            f"{host}: sparkple_pair_rank is {hv.get('sparkple_pair_rank')!r}: "
            "use 0 on the head (serves the API) and 1 on the worker"
        )
    transport = str(hv.get("sparkple_pair_transport", "ib")).strip().lower()
    if transport not in TRANSPORTS:
        raise ServingError(
            f"{host}: sparkple_pair_transport is {hv.get('sparkple_pair_transport')!r}: use ib "
            "(RDMA over the link, the default) or socket (TCP, about half the decode speed)"
        )
    gid: int | None = None
    if hv.get("sparkple_pair_ib_gid_index") not in (None, ""):
        gid = integer("sparkple_pair_ib_gid_index", 0)
        if gid < 0:
            raise ServingError(f"{host}: sparkple_pair_ib_gid_index is {gid}: use 0 or more")
    mtu = integer("sparkple_pair_link_mtu", DEFAULT_MTU)
    if not 576 <= mtu <= 65535:
        raise ServingError(f"{host}: sparkple_pair_link_mtu is {mtu}: use the link's MTU (9000)")
    return PairNode(
        host=host,
        rank=rank,
        link_address=need("sparkple_pair_link_address"),
        link_interface=need("sparkple_pair_link_interface"),
        # the socket transport opens no RDMA device
        ib_hca=need("sparkple_pair_ib_hca")
        if transport == "ib"
        else str(hv.get("sparkple_pair_ib_hca") or "").strip(),
        ib_gid_index=gid,
        transport=transport,
        link_mtu=mtu,
    )


def pairs_of(hostvars: Mapping[str, Mapping[str, Any]]) -> dict[str, Pair]:
    """Every pair the inventory names (host -> its vars), checked; single Sparks are left out."""
    members: dict[str, list[str]] = {}
    for host, hv in hostvars.items():
        name = hv.get("sparkple_pair") or ""
        if not isinstance(name, str):
            raise ServingError(f"{host}: sparkple_pair is {name!r}: use the pair's name")
        if name:
            members.setdefault(name, []).append(host)
    pairs = {}
    for name, hosts in sorted(members.items()):
        if len(hosts) != TP_SIZE:
            raise ServingError(
                f"pair {name} has {len(hosts)} host(s) ({', '.join(sorted(hosts))}): a pair is "
                "two Sparks; set sparkple_pair on exactly two hosts"
            )
        nodes = sorted((_node(h, hostvars[h]) for h in hosts), key=lambda n: n.rank)
        if [n.rank for n in nodes] != [HEAD, WORKER]:
            raise ServingError(
                f"pair {name}: {nodes[0].host} and {nodes[1].host} both have "
                f"sparkple_pair_rank {nodes[0].rank}: one is 0 (the head), the other 1"
            )
        head, worker = nodes
        if head.link_address == worker.link_address:
            raise ServingError(
                f"pair {name}: {head.host} and {worker.host} have the same "
                f"sparkple_pair_link_address {head.link_address}: each is its own node's address"
            )
        for var, values in (
            ("sparkple_pair_transport", (head.transport, worker.transport)),
            ("sparkple_pair_link_mtu", (head.link_mtu, worker.link_mtu)),
        ):
            if values[0] != values[1]:
                raise ServingError(
                    f"pair {name}: {var} is {values[0]} on {head.host} and {values[1]} on "
                    f"{worker.host}: both ends of the link use the same"
                )
        port_value = hostvars[head.host].get("sparkple_pair_master_port", DEFAULT_MASTER_PORT)
        ports = {
            str(hostvars[h].get("sparkple_pair_master_port", DEFAULT_MASTER_PORT)) for h in hosts
        }
        if len(ports) != 1:
            raise ServingError(
                f"pair {name}: sparkple_pair_master_port differs between {head.host} and "
                f"{worker.host} ({', '.join(sorted(ports))}): both use the head's rendezvous port"
            )
        try:
            port = int(port_value)
        except (TypeError, ValueError):
            port = 0
        if not 1 <= port <= 65535:
            raise ServingError(
                f"pair {name}: sparkple_pair_master_port is {port_value!r}: use a TCP port"
            )
        pairs[name] = Pair(name=name, head=head, worker=worker, master_port=port)
    return pairs


def inventory_view(
    hostvars: Mapping[str, Mapping[str, Any]], hosts: Any
) -> dict[str, dict[str, Any]]:
    """Only the pair variables of `hosts` (Ansible's hostvars templates a variable when read)."""
    return {h: {k: hostvars[h][k] for k in INVENTORY_VARS if k in hostvars[h]} for h in hosts}


def pair_of(hostvars: Mapping[str, Mapping[str, Any]], host: str) -> Pair | None:
    """The pair `host` belongs to, or None for a single Spark."""
    name = hostvars[host].get("sparkple_pair") or ""
    return pairs_of(hostvars)[name] if name else None
