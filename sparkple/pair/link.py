"""A pair node's link, checked before it starts, and the NCCL transport it ended up on.

Before either node of a pair starts (preflight, and again in the unit's ExecStartPre), each
node checks its own side of the link (docs/tensor-parallel.md, "Link checks"):

- the link interface is up, holds the inventory's link address and has the expected MTU;
- the peer answers over that interface (a TCP connection to its link address, bound to the
  interface: an accept or a refusal both come from the peer's kernel, silence does not);
- with the IB transport: each RDMA device's port is ACTIVE, and the GID index NCCL must use is
  found in sysfs as the RoCE v2 entry of the link's IPv4 address (a pinned index that is not
  that entry is refused, naming both), and the running kernel is not one known to break NCCL's
  memory registration.

Each failure names the host, the thing and the fix. Everything is read under a root directory
(a fake tree in tests); the interface's addresses come from `ip -j -4 addr` (or its saved
output). Once NCCL is up, `nccl_networks` reads NCCL's own init lines to say which transport
it chose.

Standard library only: the host runs it before the container starts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import socket
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .. import rdma
from ..serving.recipe import ServingError

TRANSPORTS = ("ib", "socket")
DEFAULT_MTU = 9000
PEER_TIMEOUT_S = 5.0
ROCE_V2 = "RoCE v2"
# how sysfs writes an IPv4-mapped GID (::ffff:a.b.c.d) before the address's two groups
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"
ACTIVE = "ACTIVE"


@dataclass(frozen=True)
class BadKernel:
    """A kernel release public reports show breaking NCCL's memory registration."""

    release: str
    what: str
    # a kernel command-line word that avoids it ("" = none known)
    workaround: str
    sources: tuple[str, ...]


# Kernels known to break NCCL over RoCE on a DGX Spark (docs/tensor-parallel.md, "Link
# checks", with the reports). Refused unless the command line carries the workaround.
KNOWN_BAD_KERNELS: tuple[BadKernel, ...] = (
    BadKernel(
        release="7.0.0-1019-nvidia",
        what=(
            "ibv_reg_mr fails with ENOMEM at NCCL init: the kernel's default Kexec HandOver "
            "scratch area hands about 9 GiB to the page allocator as CMA pageblocks, which "
            "long-term pins cannot use"
        ),
        workaround="kho=off",
        sources=(
            "https://github.com/MiaAI-Lab/DeepSeek-v4.1-Flash-DGX-Sparks/issues/14",
            "https://github.com/MiaAI-Lab/DeepSeek-v4-Flash-DSpark-2x-DGX-Spark/issues/259",
            "https://github.com/NVIDIA/NV-Kernels/pull/590",
        ),
    ),
)


@dataclass(frozen=True)
class LinkSpec:
    """One node's side of the link, as the inventory describes it (Pair.link_check_args)."""

    host: str
    interface: str
    address: str
    peer_address: str
    peer_port: int
    mtu: int = DEFAULT_MTU
    transport: str = "ib"
    ib_hca: str = ""
    gid_index: int | None = None


@dataclass
class LinkReport:
    host: str
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    gid_index: int | None = None

    def fail(self, thing: str, fix: str) -> None:
        self.failures.append(f"{self.host}: {thing}: {fix}")

    def env(self) -> dict[str, str]:
        """What the container must add to the inventory's env (the GID is found at start)."""
        return {} if self.gid_index is None else {"NCCL_IB_GID_INDEX": str(self.gid_index)}


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str
    type: str
    ndev: str


def read(path: Path) -> str | None:
    """A sysfs file's content, stripped; None when it is missing or unreadable (an unused
    GID's type reads as EINVAL)."""
    try:
        return path.read_text().strip()
    except OSError:
        return None


def ipv4_of(name: str) -> str:
    """The IPv4 address of a link address as the inventory gives it (an address, or a name)."""
    try:
        return str(ipaddress.IPv4Address(name))
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise ServingError(f"the link address {name!r} does not resolve to IPv4 ({exc})") from None
    return str(found[0][4][0])


def parse_ip_json(text: str) -> list[str]:
    """The IPv4 addresses in `ip -j -4 addr show dev IF`'s output."""
    try:
        links = json.loads(text or "[]")
    except ValueError as exc:
        raise ServingError(f"`ip -j -4 addr` printed no JSON ({exc})") from None
    return [
        info["local"]
        for link in links
        for info in link.get("addr_info", [])
        if info.get("family") == "inet" and "local" in info
    ]


def ip_addresses(interface: str) -> list[str]:
    """The interface's IPv4 addresses, from iproute2 (all of them, secondaries included)."""
    run = subprocess.run(
        ["ip", "-j", "-4", "addr", "show", "dev", interface],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return parse_ip_json(run.stdout) if run.returncode == 0 else []


def ipv4_mapped_gid(address: str) -> str:
    """The GID sysfs shows for an IPv4 address: ::ffff:a.b.c.d in eight 4-hex-digit groups."""
    packed = ipaddress.IPv6Address(f"::ffff:{address}").packed
    return ":".join(packed[i : i + 2].hex() for i in range(0, 16, 2))


def gid_table(root: Path, hca: str, port: int) -> list[Gid]:
    """The port's populated GID entries: index, GID, RoCE type and netdev (sysfs)."""
    base = root / "sys/class/infiniband" / hca / "ports" / str(port)
    entries = []
    gids = base / "gids"
    names = [p.name for p in gids.iterdir() if p.name.isdigit()] if gids.is_dir() else []
    for name in sorted(names, key=int):
        gid = read(gids / name) or ""
        if not gid or set(gid) <= {"0", ":"}:
            continue
        entries.append(
            Gid(
                index=int(name),
                gid=gid.lower(),
                type=read(base / "gid_attrs/types" / name) or "",
                ndev=read(base / "gid_attrs/ndevs" / name) or "",
            )
        )
    return entries


def roce_v2_index(table: Iterable[Gid], address: str, interface: str) -> int | None:
    """The index of the RoCE v2 entry of `address` on `interface`, or None."""
    mapped = ipv4_mapped_gid(address)
    for gid in table:
        if gid.gid == mapped and gid.type == ROCE_V2 and gid.ndev in ("", interface):
            return gid.index
    return None


def parse_hcas(value: str) -> list[tuple[str, int]]:
    """NCCL_IB_HCA's devices and the port of each NCCL uses (sparkple.rdma, the one rule)."""
    try:
        return [(hca.device, hca.port_or_first) for hca in rdma.parse_hcas(value)]
    except rdma.HcaError as exc:
        raise ServingError(str(exc)) from None


def default_connect(address: str, port: int, interface: str, source: str, timeout: float) -> str:
    """'' when the peer's kernel answers a TCP connection over `interface` (accepted or
    refused), else why not."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        # leave by the link only: SO_BINDTODEVICE needs root (preflight and the unit are root)
        with contextlib.suppress(PermissionError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
        with contextlib.suppress(OSError):
            sock.bind((source, 0))
        sock.connect((address, port))
        return ""
    except ConnectionRefusedError:
        return ""
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    except OSError as exc:
        return f"{exc.strerror or exc}"
    finally:
        sock.close()


def check_kernel(root: Path, report: LinkReport) -> None:
    """Refuse a kernel known to break NCCL's memory registration, unless its workaround is on."""
    release = read(root / "proc/sys/kernel/osrelease") or ""
    words = (read(root / "proc/cmdline") or "").split()
    for bad in KNOWN_BAD_KERNELS:
        if release != bad.release:
            continue
        if bad.workaround and bad.workaround in words:
            report.passed.append(f"kernel {release} with {bad.workaround}")
            return
        fix = f"boot another kernel (6.17.0-1032-nvidia works in {bad.sources[0]})"
        if bad.workaround:
            fix += f", or add {bad.workaround} to the kernel command line and reboot"
        sources = ", ".join(bad.sources)
        report.fail(f"kernel {release} breaks NCCL over RoCE ({bad.what}; {sources})", fix)
        return
    report.passed.append(f"kernel {release or 'unknown'}")


def check_interface(spec: LinkSpec, root: Path, addresses: list[str], report: LinkReport) -> str:
    """The interface up, holding the link address, at the expected MTU; the address's IPv4."""
    net = root / "sys/class/net" / spec.interface
    if not net.is_dir():
        report.fail(
            f"link interface {spec.interface} does not exist",
            "set sparkple_pair_link_interface to the link's netdev (ibdev2netdev names it)",
        )
        return ""
    state = read(net / "operstate") or "unknown"
    if state != "up":
        report.fail(
            f"link interface {spec.interface} is {state}, not up",
            f"cable the link and bring it up (ip link set {spec.interface} up)",
        )
    mtu = read(net / "mtu") or "?"
    if mtu != str(spec.mtu):
        report.fail(
            f"link interface {spec.interface} has MTU {mtu}, not {spec.mtu}",
            f"set MTU {spec.mtu} on both nodes' link (or sparkple_pair_link_mtu to the link's)",
        )
    try:
        address = ipv4_of(spec.address)
    except ServingError as exc:
        report.fail(str(exc), "set sparkple_pair_link_address to this node's link IPv4 address")
        return ""
    if address not in addresses:
        held = ", ".join(addresses) or "no IPv4 address"
        report.fail(
            f"link interface {spec.interface} has {held}, not the link address {address}",
            f"give {spec.interface} the address {address}, or correct sparkple_pair_link_address",
        )
    if not report.failures:
        report.passed.append(f"{spec.interface} up, {address}, MTU {mtu}")
    return address


def check_hcas(spec: LinkSpec, root: Path, address: str, report: LinkReport) -> None:
    """Each RDMA device's port ACTIVE; the GID index of the link's RoCE v2 IPv4 entry."""
    try:
        hcas = parse_hcas(spec.ib_hca)
    except ServingError as exc:
        report.fail(str(exc), "set sparkple_pair_ib_hca (ibdev2netdev names the devices)")
        return
    devices = root / "sys/class/infiniband"
    present = sorted(p.name for p in devices.iterdir()) if devices.is_dir() else []
    tables: dict[str, list[Gid]] = {}
    for hca, port in hcas:
        if hca not in present:
            report.fail(
                f"no RDMA device {hca} (found {', '.join(present) or 'none'})",
                "set sparkple_pair_ib_hca to the link's device, load mlx5_ib, or choose "
                "sparkple_pair_transport: socket explicitly",
            )
            continue
        state = read(devices / hca / "ports" / str(port) / "state") or "missing"
        if state.split(":")[-1].strip() != ACTIVE:
            report.fail(
                f"RDMA device {hca} port {port} is {state!r}, not ACTIVE",
                f"cable the link and bring {spec.interface} up (ibstat {hca} shows the port)",
            )
        tables[hca] = gid_table(root, hca, port)
    if not address or len(tables) != len(hcas):
        return
    found = {hca: roce_v2_index(t, address, spec.interface) for hca, t in tables.items()}
    indexes = {i for i in found.values() if i is not None}
    if not indexes:
        report.fail(
            f"no RoCE v2 GID of {address} ({ipv4_mapped_gid(address)}) on {', '.join(tables)}",
            f"give {spec.interface} its address and check `show_gids`; the device must be the "
            "link's (sparkple_pair_ib_hca)",
        )
        return
    if len(indexes) > 1:
        report.fail(
            f"the RoCE v2 GID of {address} has different indexes on "
            + ", ".join(f"{h} ({i})" for h, i in found.items()),
            "NCCL uses one NCCL_IB_GID_INDEX for every device: list one in sparkple_pair_ib_hca",
        )
        return
    (index,) = indexes
    if spec.gid_index is not None and spec.gid_index != index:
        pinned = {g.index: g for t in tables.values() for g in t}.get(spec.gid_index)
        held = f"{pinned.gid} ({pinned.type}, {pinned.ndev})" if pinned else "empty"
        report.fail(
            f"sparkple_pair_ib_gid_index is {spec.gid_index} (that entry is {held}), but the "
            f"RoCE v2 GID of {address} on {spec.interface} is at index {index}",
            "remove sparkple_pair_ib_gid_index (the index is found at each start) or set it "
            f"to {index}",
        )
        return
    # the other devices NCCL may use (a twin port) need a RoCE v2 IPv4 entry at that index
    for hca, table in tables.items():
        entry = {g.index: g for g in table}.get(index)
        if entry is None or entry.type != ROCE_V2 or not entry.gid.startswith(IPV4_MAPPED):
            report.fail(
                f"GID index {index} of {hca} is not a RoCE v2 IPv4 entry",
                f"give {hca}'s interface an address, or leave {hca} out of sparkple_pair_ib_hca",
            )
            return
    report.gid_index = index
    report.passed.append(f"GID index {index} ({ROCE_V2} {address} on {', '.join(tables)})")


def check_link(
    spec: LinkSpec,
    root: Path = Path("/"),
    addresses: Callable[[str], list[str]] = ip_addresses,
    connect: Callable[[str, int, str, str, float], str] = default_connect,
    timeout_s: float = PEER_TIMEOUT_S,
) -> LinkReport:
    """Every check of this node's side of the link (the module's docstring)."""
    if spec.transport not in TRANSPORTS:
        raise ServingError(
            f"{spec.host}: sparkple_pair_transport is {spec.transport!r}: use ib or socket"
        )
    report = LinkReport(spec.host)
    address = check_interface(spec, root, addresses(spec.interface), report)
    try:
        peer = ipv4_of(spec.peer_address)
    except ServingError as exc:
        report.fail(str(exc), "set the peer's sparkple_pair_link_address")
    else:
        why = connect(peer, spec.peer_port, spec.interface, address or "0.0.0.0", timeout_s)
        if why:
            report.fail(
                f"the peer {peer} does not answer over {spec.interface} (TCP port "
                f"{spec.peer_port}: {why})",
                "check the cable, both nodes' link addresses and netmask, and any firewall",
            )
        else:
            report.passed.append(f"peer {peer} answers over {spec.interface}")
    if spec.transport == "ib":
        check_hcas(spec, root, address, report)
        check_kernel(root, report)
    return report


# NCCL's init line naming the network a communicator uses (src/init.cc:
# INFO(NCCL_INIT, "Using network %s", ...)), and the IB plugin's device line.
USING_NETWORK = re.compile(r"NCCL INFO Using network (\S+)")
IB_DEVICES = re.compile(r"NCCL INFO NET/IB ?: Using (\[\d+\]\S+(?: \[\d+\]\S+)*)")


def nccl_networks(lines: Iterable[str]) -> list[str]:
    """The network of each communicator NCCL set up, in log order ("IB", "Socket", ...)."""
    return [m.group(1) for line in lines if (m := USING_NETWORK.search(line))]


def nccl_transport(lines: Iterable[str]) -> str | None:
    """ "ib" when every communicator uses NCCL's IB network, "socket" when one uses sockets,
    the name of any other network, or None when the log has no such line."""
    found = {name.lower() for name in nccl_networks(lines)}
    if not found:
        return None
    if "socket" in found:
        return "socket"
    return "ib" if found == {"ib"} else ",".join(sorted(found))


def ib_devices(lines: Iterable[str]) -> str:
    """The devices of NCCL's last `NET/IB : Using` line ('' when none)."""
    devices = [m.group(1) for line in lines if (m := IB_DEVICES.search(line))]
    return devices[-1] if devices else ""
