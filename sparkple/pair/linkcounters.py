"""The pair link's counters as sysfs shows them: the RDMA port of the link's HCA
(/sys/class/infiniband/<device>/ports/<n>/) and the link's network interface
(/sys/class/net/<interface>/).

Units and meanings (docs/link-monitoring.md has the sources):
  - counters/port_xmit_data and port_rcv_data count 4-octet words; read_port returns bytes;
  - on an mlx5 RoCE port they are the RDMA traffic only, and the interface's rx_bytes and
    tx_bytes are the kernel's IP traffic only: RoCE bypasses the netdev's rings;
  - state is "4: ACTIVE" when the port can carry RDMA traffic.
A file that is missing or unreadable is None (or left out), never an error: drivers differ in
what they expose. The sysfs root is a parameter, so tests read a tree of their own.

Standard library only: the host's system Python runs this (sparkple.metrics.collect).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# port_xmit_data and port_rcv_data are "divided by 4" (the IB PortCounters data unit)
DATA_WORD_BYTES = 4
# counters/ of every IB port: the physical link's and the port's packet errors
PORT_ERRORS = (
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
# hw_counters/ of an mlx5 RoCE port: lost or retransmitted RDMA packets, and corrupt ones
ROCE_ERRORS = (
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
    "implied_nak_seq_err",
    "req_transport_retries_exceeded",
    "rx_icrc_encapsulated",
)
# what a device, port or interface name may hold (they become sysfs path components)
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@-]*")


@dataclass(frozen=True)
class RdmaPort:
    device: str
    port: str
    active: bool | None
    tx_bytes: int | None
    rx_bytes: int | None
    link_downed: int | None
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Interface:
    name: str
    present: bool
    up: bool
    rx_bytes: int | None = None
    tx_bytes: int | None = None
    carrier_changes: int | None = None


def check_name(kind: str, name: str) -> str:
    if not NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{kind} {name!r} is not a device name (letters, digits, _ . : @ -)")
    return name


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_port(port_dir: Path, device: str) -> RdmaPort:
    counters, hw = port_dir / "counters", port_dir / "hw_counters"
    try:
        state: str | None = (port_dir / "state").read_text()
    except OSError:
        state = None
    words = {d: read_int(counters / f"port_{d}_data") for d in ("xmit", "rcv")}
    errors = {n: v for n in PORT_ERRORS if (v := read_int(counters / n)) is not None}
    errors |= {n: v for n in ROCE_ERRORS if (v := read_int(hw / n)) is not None}
    return RdmaPort(
        device=device,
        port=port_dir.name,
        # "4: ACTIVE"; the name, not the number, is what every kernel prints the same
        active=None if state is None else state.split(":")[-1].strip() == "ACTIVE",
        tx_bytes=None if words["xmit"] is None else words["xmit"] * DATA_WORD_BYTES,
        rx_bytes=None if words["rcv"] is None else words["rcv"] * DATA_WORD_BYTES,
        link_downed=read_int(counters / "link_downed"),
        errors=errors,
    )


def read_rdma(sysfs: Path, device: str, port: str | None = None) -> list[RdmaPort] | None:
    """The device's ports (or the one named), or None when sysfs has no such device/port."""
    ports = sysfs / "class" / "infiniband" / check_name("RDMA device", device) / "ports"
    if port is not None:
        dirs = [ports / port] if (ports / port).is_dir() else []
    else:
        try:
            dirs = sorted(
                (p for p in ports.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
            )
        except OSError:
            dirs = []
    return [read_port(d, device) for d in dirs] or None


def read_interface(sysfs: Path, name: str) -> Interface:
    base = sysfs / "class" / "net" / check_name("interface", name)
    if not base.is_dir():
        return Interface(name=name, present=False, up=False)
    try:
        operstate = (base / "operstate").read_text().strip()
    except OSError:
        operstate = "unknown"
    stats = base / "statistics"
    return Interface(
        name=name,
        present=True,
        up=operstate == "up",
        rx_bytes=read_int(stats / "rx_bytes"),
        tx_bytes=read_int(stats / "tx_bytes"),
        carrier_changes=read_int(base / "carrier_changes"),
    )
