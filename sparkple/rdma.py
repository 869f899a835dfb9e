"""The pair link's RDMA devices as NCCL_IB_HCA names them (the inventory's sparkple_pair_ib_hca):
one rule for every reader, the link check (sparkple.pair.link), the metrics program
(sparkple.metrics.collect) and, through that program, the metrics role.

A value is a comma-separated list of `DEVICE` or `DEVICE:PORT`; a leading `=` (NCCL's
exact-match prefix) may stand before the list or a device. A ConnectX-7 shows its twin ports as
two devices (`rocep1s0f1,roceP2p1s0f1`), and NCCL uses both when both are named. An exclusion
list (`^...`) names no device to check or count, so it is refused. Standard library only: the
host's system Python runs the metrics program.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# a device's name becomes a sysfs path component (/sys/class/infiniband/<device>)
DEVICE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]*")
KNOB = "sparkple_pair_ib_hca"


class HcaError(ValueError):
    """An NCCL_IB_HCA value that names no device to check, or one no sysfs path can hold."""


@dataclass(frozen=True)
class Hca:
    device: str
    port: int | None  # None: every port of the device (NCCL's own default)

    @property
    def port_or_first(self) -> int:
        """The port NCCL takes where none is named: the first."""
        return 1 if self.port is None else self.port


def parse_hcas(value: str) -> list[Hca]:
    """The devices (and ports) of an NCCL_IB_HCA list, in its order; refused: an exclusion
    list, an empty one, a name sysfs cannot hold, a port that is not a number, a repeat."""
    text = value.strip()
    if text.startswith("^"):
        raise HcaError(f"{KNOB} {value!r} is an exclusion list: name the link's devices")
    found: list[Hca] = []
    for token in text.removeprefix("=").split(","):
        device, sep, port = token.strip().removeprefix("=").partition(":")
        if not device and not sep:
            continue
        if not DEVICE_NAME.fullmatch(device) or ".." in device:
            raise HcaError(
                f"{KNOB} {value!r}: {device!r} is not an RDMA device name "
                "(letters, digits, _ . @ -, as `rdma link` shows them)"
            )
        if sep and not port.isdigit():
            raise HcaError(f"{KNOB} {value!r}: the port after {device}: must be a number")
        hca = Hca(device, int(port) if sep else None)
        if any(seen.device == hca.device and seen.port == hca.port for seen in found):
            raise HcaError(f"{KNOB} {value!r} names {token.strip()} twice")
        found.append(hca)
    if not found:
        raise HcaError(f"{KNOB} is empty: name the link's RDMA device(s)")
    return found
