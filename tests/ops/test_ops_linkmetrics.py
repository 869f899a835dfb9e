"""The pair link's metrics: the real metrics program (a subprocess, as the timer runs it) reads a
sysfs tree laid out as the kernel lays out /sys/class/infiniband and /sys/class/net
(Documentation/ABI/stable/sysfs-class-infiniband), and the real /sys for the loopback interface's
IP bytes while real traffic crosses it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from ops_helpers import program

from sparkple.pair.linkcounters import PORT_ERRORS, ROCE_ERRORS

HCA, IFACE = "rocep1s0f1", "enp1s0f1np1"
# a ConnectX-7's second port of the same link, as DGX OS names it (docs/two-sparks.md)
TWIN = "roceP2p1s0f1"


def parse(text: str) -> dict[str, float]:
    """Samples of a text exposition, keyed by `name{labels}` as written."""
    return dict(
        (line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line and not line.startswith("#")
    )


def write(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{value}\n")


def fake_port(
    sysfs: Path, port: int = 1, *, state: str = "4: ACTIVE", device: str = HCA, **counters: int
) -> Path:
    """One port of a device: its state, counters/ (IB PortCounters), hw_counters/ (mlx5 RoCE)."""
    base = sysfs / "class" / "infiniband" / device / "ports" / str(port)
    write(base / "state", state)
    write(base / "phys_state", "5: LinkUp")
    for name, value in counters.items():
        where = "hw_counters" if name in ROCE_ERRORS else "counters"
        write(base / where / name, value)
    return base


def fake_interface(sysfs: Path, name: str = IFACE, *, rx: int, tx: int, up: bool = True) -> None:
    base = sysfs / "class" / "net" / name
    write(base / "operstate", "up" if up else "down")
    write(base / "carrier_changes", 4)
    write(base / "statistics" / "rx_bytes", rx)
    write(base / "statistics" / "tx_bytes", tx)


def collect(out: Path, sysfs: Path, *args: object) -> tuple[dict[str, float], str]:
    done = subprocess.run(
        program("metrics", "--out", out, "--sysfs-root", sysfs, *args),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return parse(out.read_text()), done.stderr


def rdma(kind: str, **labels: str) -> str:
    inner = ",".join(
        f'{k}="{v}"' for k, v in sorted({"device": HCA, "port": "1", **labels}.items())
    )
    return f"sparkple_pair_link_rdma_{kind}{{{inner}}}"


def ip(direction: str, interface: str = IFACE) -> str:
    return f'sparkple_pair_link_ip_bytes_total{{direction="{direction}",interface="{interface}"}}'


def test_port_counters_are_read_in_bytes_and_move_with_the_files(tmp_path):
    sysfs, out = tmp_path / "sys", tmp_path / "m.prom"
    errors: dict[str, Any] = {name: i + 1 for i, name in enumerate(PORT_ERRORS + ROCE_ERRORS)}
    port = fake_port(
        sysfs, port_xmit_data=1_000_000, port_rcv_data=250, link_downed=2, **errors
    )  # fmt: skip
    fake_interface(sysfs, rx=10_000, tx=20_000)
    link = ("--link-interface", IFACE, "--rdma-device", HCA)
    before, _ = collect(out, sysfs, *link)

    assert before[f'sparkple_pair_link_rdma_present{{device="{HCA}"}}'] == 1
    assert before[rdma("port_active")] == 1
    # port_xmit_data and port_rcv_data count 4-octet words
    assert before[rdma("bytes_total", direction="transmit")] == 4_000_000
    assert before[rdma("bytes_total", direction="receive")] == 1_000
    assert before[rdma("link_downed_total")] == 2
    for name, value in errors.items():
        assert before[rdma("errors_total", counter=name)] == value, name
    assert before[ip("receive")] == 10_000 and before[ip("transmit")] == 20_000
    assert before[f'sparkple_pair_link_interface_up{{interface="{IFACE}"}}'] == 1
    assert before[f'sparkple_pair_link_carrier_changes_total{{interface="{IFACE}"}}'] == 4

    # 256 MiB moves over RDMA: 64 Mi words more on each side
    write(port / "counters" / "port_xmit_data", 1_000_000 + 64 * 2**20)
    write(port / "counters" / "port_rcv_data", 250 + 64 * 2**20)
    write(port / "counters" / "link_downed", 3)
    write(port / "state", "1: DOWN")
    after, _ = collect(out, sysfs, *link)
    for direction in ("transmit", "receive"):
        moved = after[rdma("bytes_total", direction=direction)]
        moved -= before[rdma("bytes_total", direction=direction)]
        assert moved == 256 * 2**20
    assert after[rdma("link_downed_total")] == 3 and after[rdma("port_active")] == 0

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus; .ci/setup-system does it)")
    with open(out) as f:
        checked = subprocess.run(
            [promtool, "check", "metrics"], stdin=f, capture_output=True, text=True, timeout=60
        )
    assert checked.returncode == 0 and not (checked.stdout + checked.stderr).strip(), (
        checked.stdout + checked.stderr
    )


def test_without_the_rdma_device_the_ip_bytes_remain(tmp_path):
    """The lab (and a pair on sockets) has no /sys/class/infiniband: a present gauge of 0, no
    RDMA series, the interface's bytes still."""
    sysfs, out = tmp_path / "sys", tmp_path / "m.prom"
    fake_interface(sysfs, rx=5, tx=6)
    m, stderr = collect(out, sysfs, "--link-interface", IFACE, "--rdma-device", HCA)
    assert m[f'sparkple_pair_link_rdma_present{{device="{HCA}"}}'] == 0
    assert not [k for k in m if k.startswith("sparkple_pair_link_rdma_") and "present" not in k]
    assert m[ip("receive")] == 5 and m[ip("transmit")] == 6
    assert f"no RDMA device {HCA}" in stderr
    assert "sparkple_mem_available_bytes" in m, "the rest of the file is still written"


def test_missing_files_drop_only_their_series(tmp_path):
    sysfs, out = tmp_path / "sys", tmp_path / "m.prom"
    fake_port(sysfs, port_rcv_data=7, symbol_error=0)  # no xmit, no link_downed, no hw_counters
    fake_port(sysfs, 2, state="1: DOWN", port_xmit_data=3)
    (sysfs / "class" / "net").mkdir(parents=True)  # the interface named is not there
    m, stderr = collect(out, sysfs, "--link-interface", IFACE, "--rdma-device", HCA)
    assert m[rdma("bytes_total", direction="receive")] == 28
    assert rdma("bytes_total", direction="transmit") not in m
    assert m[rdma("errors_total", counter="symbol_error")] == 0
    assert [k for k in m if "errors_total" in k] == [rdma("errors_total", counter="symbol_error")]
    assert rdma("link_downed_total") not in m
    # both ports without a port in --rdma-device, each with its own state
    assert m[rdma("port_active")] == 1 and m[rdma("port_active", port="2")] == 0
    assert m[rdma("bytes_total", direction="transmit", port="2")] == 12
    # a missing interface reads as down, with no byte counts
    assert m[f'sparkple_pair_link_interface_up{{interface="{IFACE}"}}'] == 0
    assert not [k for k in m if "ip_bytes" in k] and f"no network interface {IFACE}" in stderr

    # DEVICE:PORT (NCCL_IB_HCA's form) reads that port only
    m, _ = collect(out, sysfs, "--link-interface", IFACE, "--rdma-device", f"={HCA}:2")
    assert m[rdma("port_active", port="2")] == 0 and rdma("port_active") not in m
    m, stderr = collect(out, sysfs, "--link-interface", IFACE, "--rdma-device", f"{HCA}:3")
    assert m[f'sparkple_pair_link_rdma_present{{device="{HCA}"}}'] == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--link-interface", "../../etc"], "interface '../../etc' is not a device name"),
        (["--link-interface", "eth0", "--rdma-device", "mlx5_0:x"], "the port after mlx5_0:"),
        (["--link-interface", "eth0", "--rdma-device", "^mlx5_1"], "is an exclusion list"),
        (["--link-interface", "eth0", "--rdma-device", "mlx5_0,../x"], "is not an RDMA device"),
        (["--rdma-device", "mlx5_0"], "--rdma-device needs --link-interface"),
    ],
)
def test_bad_link_names_are_refused(tmp_path, args, words):
    done = subprocess.run(
        program("metrics", "--out", tmp_path / "m.prom", *args),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert not (tmp_path / "m.prom").exists()


def test_twin_ports_are_counted_per_device_and_sum_for_the_pair(tmp_path):
    """sparkple_pair_ib_hca as docs/two-sparks.md recommends it for a ConnectX-7's twin ports:
    both devices' counters, each under its own device label (the rules and the dashboard sum
    them per host), each present gauge of its own; --check-args (what the metrics role runs)
    accepts the list."""
    sysfs, out = tmp_path / "sys", tmp_path / "m.prom"
    fake_interface(sysfs, rx=1, tx=2)
    fake_port(sysfs, port_xmit_data=10, port_rcv_data=20)
    fake_port(sysfs, device=TWIN, port_xmit_data=30, port_rcv_data=40)
    twin = f"{HCA},{TWIN}"
    checked = subprocess.run(
        program("metrics", "--out", out, "--check-args", "--link-interface", IFACE,
                "--rdma-device", twin),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    assert not out.exists(), "--check-args collects nothing"
    m, stderr = collect(out, sysfs, "--link-interface", IFACE, "--rdma-device", twin)
    assert stderr == ""
    for device in (HCA, TWIN):
        assert m[f'sparkple_pair_link_rdma_present{{device="{device}"}}'] == 1
        assert m[rdma("port_active", device=device)] == 1
    sent = sum(v for k, v in m.items() if "rdma_bytes_total" in k and "transmit" in k)
    assert (m[rdma("bytes_total", direction="transmit")], sent) == (40, 160)
    # one of the two missing: its gauge says so, the other's counters stay
    (sysfs / "class" / "infiniband" / TWIN).rename(tmp_path / "gone")
    m, stderr = collect(out, sysfs, "--link-interface", IFACE, "--rdma-device", twin)
    assert m[f'sparkple_pair_link_rdma_present{{device="{TWIN}"}}'] == 0
    assert m[rdma("bytes_total", direction="receive")] == 80 and f"no RDMA device {TWIN}" in stderr


def test_the_real_interface_bytes_grow_with_real_traffic(tmp_path):
    """The real /sys: loopback's rx_bytes and tx_bytes grow by at least what crossed it."""
    if not Path("/sys/class/net/lo/statistics/rx_bytes").exists():
        pytest.skip("no /sys/class/net/lo on this machine")
    out, sent = tmp_path / "m.prom", 4 * 2**20
    before, _ = collect(out, Path("/sys"), "--link-interface", "lo")
    with socket.create_server(("127.0.0.1", 0)) as server:
        got = bytearray()

        def drain() -> None:
            conn, _ = server.accept()
            with conn:
                while chunk := conn.recv(1 << 16):
                    got.extend(chunk)

        reader = threading.Thread(target=drain)
        reader.start()
        with socket.create_connection(server.getsockname()) as client:
            client.sendall(b"\0" * sent)
        reader.join(30)
    assert len(got) == sent
    after, _ = collect(out, Path("/sys"), "--link-interface", "lo")
    for direction in ("receive", "transmit"):
        assert after[ip(direction, "lo")] - before[ip(direction, "lo")] >= sent
