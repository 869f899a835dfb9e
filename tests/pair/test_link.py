"""A pair node's link checks (sparkple.pair.link) on a fake sysfs/proc tree, with real
sockets for the peer, and NCCL's init lines read for the transport; the CLI as the unit runs it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkple.pair.link import (
    KNOWN_BAD_KERNELS,
    LinkSpec,
    check_link,
    gid_table,
    ib_devices,
    ip_addresses,
    ipv4_mapped_gid,
    nccl_transport,
    parse_ip_json,
)

ROOT = Path(__file__).resolve().parents[2]
LINK_IP = "192.168.100.10"
HCA = "rocep1s0f1"
# a GID table as a Spark shows it: IPv6 link-local (v1, v2), the address as RoCE v1, an unused
# slot, another address, and the link's IPv4 RoCE v2 entry at 5 (not 3)
GIDS = [
    (0, "fe80:0000:0000:0000:5e25:73ff:fe6b:0a01", "IB/RoCE v1"),
    (1, "fe80:0000:0000:0000:5e25:73ff:fe6b:0a01", "RoCE v2"),
    (2, "0000:0000:0000:0000:0000:ffff:c0a8:640a", "IB/RoCE v1"),
    (3, "0000:0000:0000:0000:0000:0000:0000:0000", ""),
    (4, "0000:0000:0000:0000:0000:ffff:0a00:0005", "RoCE v2"),
    (5, "0000:0000:0000:0000:0000:ffff:c0a8:640a", "RoCE v2"),
]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def hca(root: Path, name: str, gids: list[tuple[int, str, str]], state: str = "4: ACTIVE",
        ndev: str = "lo") -> None:  # fmt: skip
    port = root / "sys/class/infiniband" / name / "ports/1"
    write(port / "state", state)
    for index, gid, kind in gids:
        write(port / "gids" / str(index), gid)
        if kind:  # an unused slot's type and netdev read as EINVAL: no file here
            write(port / "gid_attrs/types" / str(index), kind)
            write(port / "gid_attrs/ndevs" / str(index), ndev)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A Spark's link as sysfs and proc show it; the link's netdev is `lo` so the peer
    connection, bound to it, is a real one on this machine."""
    write(tmp_path / "sys/class/net/lo/operstate", "up")
    write(tmp_path / "sys/class/net/lo/mtu", "9000")
    hca(tmp_path, HCA, GIDS)
    write(tmp_path / "proc/sys/kernel/osrelease", "6.17.0-1032-nvidia")
    write(tmp_path / "proc/cmdline", "BOOT_IMAGE=/vmlinuz ro quiet splash")
    return tmp_path


@pytest.fixture
def peer() -> Iterator[int]:
    """A listening peer on the loopback link: its port."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def spec(port: int, **more: object) -> LinkSpec:
    fields: dict = dict(host="spark-a", interface="lo", address=LINK_IP,
                        peer_address="127.0.0.1", peer_port=port, ib_hca=HCA)  # fmt: skip
    return LinkSpec(**{**fields, **more})


def check(tree: Path, port: int, addresses: list[str] | None = None, **more: object):
    held = [LINK_IP] if addresses is None else addresses
    return check_link(spec(port, **more), tree, lambda _: held, timeout_s=1.0)


def test_a_good_link_passes_and_finds_the_gid_index(tree: Path, peer: int) -> None:
    report = check(tree, peer)
    assert report.failures == []
    assert report.gid_index == 5 and report.env() == {"NCCL_IB_GID_INDEX": "5"}
    assert report.passed[0] == f"lo up, {LINK_IP}, MTU 9000"
    assert "peer 127.0.0.1 answers over lo" in report.passed
    assert f"GID index 5 (RoCE v2 {LINK_IP} on {HCA})" in report.passed


def test_the_gid_table_reads_every_populated_entry(tree: Path) -> None:
    table = gid_table(tree, HCA, 1)
    assert [g.index for g in table] == [0, 1, 2, 4, 5]
    assert (table[-1].type, table[-1].ndev) == ("RoCE v2", "lo")
    assert ipv4_mapped_gid(LINK_IP) == "0000:0000:0000:0000:0000:ffff:c0a8:640a"


def test_a_pinned_index_that_is_not_the_entry_is_refused_naming_both(tree: Path, peer: int) -> None:
    report = check(tree, peer, gid_index=3)
    (failure,) = report.failures
    assert failure.startswith("spark-a: sparkple_pair_ib_gid_index is 3 (that entry is empty)")
    assert f"the RoCE v2 GID of {LINK_IP} on lo is at index 5" in failure
    assert "remove sparkple_pair_ib_gid_index" in failure and report.gid_index is None
    assert (
        "that entry is 0000:0000:0000:0000:0000:ffff:c0a8:640a (IB/RoCE v1, lo)"
        in check(tree, peer, gid_index=2).failures[0]
    )
    assert check(tree, peer, gid_index=5).failures == []


def test_an_address_with_only_a_roce_v1_entry_has_no_index(tree: Path, peer: int) -> None:
    hca(tree, HCA, [g for g in GIDS if g[0] != 5])
    (tree / f"sys/class/infiniband/{HCA}/ports/1/gids/5").unlink()
    (failure,) = check(tree, peer).failures
    assert failure.startswith(f"spark-a: no RoCE v2 GID of {LINK_IP} (0000:0000:")


@pytest.mark.parametrize(
    ("change", "thing", "fix"),
    [
        (("sys/class/net/lo/operstate", "down"), "link interface lo is down, not up",
         "ip link set lo up"),
        (("sys/class/net/lo/mtu", "1500"), "link interface lo has MTU 1500, not 9000",
         "set MTU 9000 on both nodes' link"),
        ((f"sys/class/infiniband/{HCA}/ports/1/state", "1: DOWN"),
         f"RDMA device {HCA} port 1 is '1: DOWN', not ACTIVE", "cable the link"),
    ],
)  # fmt: skip
def test_each_sysfs_refusal_names_host_thing_and_fix(
    tree: Path, peer: int, change: tuple[str, str], thing: str, fix: str
) -> None:
    write(tree / change[0], change[1])
    (failure,) = check(tree, peer).failures
    assert failure.startswith(f"spark-a: {thing}: ") and fix in failure


def test_the_interface_must_exist_and_hold_the_link_address(tree: Path, peer: int) -> None:
    (failure,) = check(tree, peer, addresses=["10.0.0.5"]).failures
    assert failure.startswith(
        f"spark-a: link interface lo has 10.0.0.5, not the link address {LINK_IP}"
    )
    report = check(tree, peer, interface="enp1s0f1np1")
    assert report.failures[0].startswith("spark-a: link interface enp1s0f1np1 does not exist")


def test_a_missing_rdma_device_is_named_with_what_is_there(tree: Path, peer: int) -> None:
    (failure,) = check(tree, peer, ib_hca="mlx5_0").failures
    assert f"no RDMA device mlx5_0 (found {HCA})" in failure
    assert "sparkple_pair_transport: socket" in failure


def test_a_silent_peer_is_refused_within_the_timeout(tree: Path) -> None:
    # a listener whose accept queue is full drops new SYNs: the peer never answers
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        waiting = [socket.socket() for _ in range(3)]
        for s in waiting:
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
        try:
            (failure,) = check(tree, port).failures
        finally:
            for s in waiting:
                s.close()
    assert failure.startswith(
        f"spark-a: the peer 127.0.0.1 does not answer over lo (TCP port {port}: no answer in 1 s)"
    )


def test_a_peer_that_refuses_the_port_still_answers(tree: Path, peer: int) -> None:
    with socket.socket() as closed:  # a port nobody listens on: the peer's kernel resets
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert check(tree, port).failures == []


def test_a_kernel_known_to_break_memory_registration_is_refused(tree: Path, peer: int) -> None:
    bad = KNOWN_BAD_KERNELS[0]
    write(tree / "proc/sys/kernel/osrelease", bad.release)
    (failure,) = check(tree, peer).failures
    assert failure.startswith(f"spark-a: kernel {bad.release} breaks NCCL over RoCE")
    assert bad.sources[0] in failure and "add kho=off to the kernel command line" in failure
    write(tree / "proc/cmdline", "BOOT_IMAGE=/vmlinuz ro quiet kho=off")
    report = check(tree, peer)
    assert report.failures == [] and f"kernel {bad.release} with kho=off" in report.passed


def test_every_known_bad_kernel_is_documented_with_its_sources() -> None:
    doc = (ROOT / "docs/tensor-parallel.md").read_text()
    for bad in KNOWN_BAD_KERNELS:
        assert bad.release in doc and all(url in doc for url in bad.sources)


def test_the_socket_transport_checks_the_interface_and_peer_only(tree: Path, peer: int) -> None:
    write(tree / "proc/sys/kernel/osrelease", KNOWN_BAD_KERNELS[0].release)
    write(tree / "sys/class/net/lo/mtu", "1500")
    report = check(tree, peer, transport="socket", ib_hca="", mtu=1500)
    assert report.failures == [] and report.gid_index is None and report.env() == {}
    assert (
        check(tree, peer, transport="socket", ib_hca="")
        .failures[0]
        .startswith("spark-a: link interface lo has MTU 1500, not 9000")
    )


def test_a_twin_device_needs_a_roce_v2_ipv4_entry_at_the_same_index(tree: Path, peer: int) -> None:
    twin = "roceP2p1s0f1"
    hca(tree, twin, GIDS[:2], ndev="enP2p1s0f1np1")  # no IPv4 entry on the twin
    (failure,) = check(tree, peer, ib_hca=f"={HCA},={twin}").failures
    assert failure.startswith(f"spark-a: GID index 5 of {twin} is not a RoCE v2 IPv4 entry")
    hca(tree, twin, [(5, ipv4_mapped_gid("192.168.101.10"), "RoCE v2")], ndev="enP2p1s0f1np1")
    assert check(tree, peer, ib_hca=f"={HCA}:1,={twin}").gid_index == 5


def test_ip_json_is_read_as_iproute2_prints_it() -> None:
    printed = json.dumps([{"ifindex": 4, "ifname": "enp1s0f1np1", "addr_info": [
        {"family": "inet", "local": LINK_IP, "prefixlen": 24},
        {"family": "inet", "local": "192.168.100.50", "secondary": True}]}])  # fmt: skip
    assert parse_ip_json(printed) == [LINK_IP, "192.168.100.50"]
    assert "127.0.0.1" in ip_addresses("lo")  # the real iproute2 on this machine
    assert ip_addresses("no-such-link0") == []


IB_LOG = """\
spark-a:81:81 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to enp1s0f1np1
spark-a:81:81 [0] NCCL INFO Bootstrap: Using enp1s0f1np1:192.168.100.10<0>
spark-a:81:81 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
spark-a:81:203 [0] NCCL INFO NET/IB : Using [0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE [RO]; \
OOB enp1s0f1np1:192.168.100.10<0>
spark-a:81:203 [0] NCCL INFO Initialized NET plugin IB
spark-a:81:203 [0] NCCL INFO Assigned NET plugin IB to comm
spark-a:81:203 [0] NCCL INFO Using network IB
spark-a:81:203 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0
"""
SOCKET_LOG = """\
spark-a:81:203 [0] NCCL INFO NET/IB : No device found.
spark-a:81:203 [0] NCCL INFO NET/IB : Using [RO]; OOB enp1s0f1np1:192.168.100.10<0>
spark-a:81:203 [0] NCCL INFO NET/Socket : Using [0]enp1s0f1np1:192.168.100.10<0>
spark-a:81:203 [0] NCCL INFO Initialized NET plugin Socket
spark-a:81:203 [0] NCCL INFO Using network Socket
"""


def test_nccl_init_lines_say_the_transport() -> None:
    assert nccl_transport(IB_LOG.splitlines()) == "ib"
    assert ib_devices(IB_LOG.splitlines()) == "[0]rocep1s0f1:1/RoCE [1]roceP2p1s0f1:1/RoCE"
    assert nccl_transport(SOCKET_LOG.splitlines()) == "socket"
    # one communicator on sockets is a socket pair; no line at all is not known
    assert nccl_transport((IB_LOG + SOCKET_LOG).splitlines()) == "socket"
    assert (
        nccl_transport(["INFO 12-02 vLLM started", "NCCL INFO NET/IB : No device found."]) is None
    )


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkple.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_cli_writes_the_found_index_for_docker_and_refuses_with_exit_1(
    tree: Path, peer: int, tmp_path: Path
) -> None:
    ip_json = tmp_path / "ip.json"
    ip_json.write_text(json.dumps([{"ifname": "lo", "addr_info": [
        {"family": "inet", "local": LINK_IP}]}]))  # fmt: skip
    env_file = tmp_path / "run" / "vllm-link.env"
    args = ["pair-link-check", "--host=spark-a", "--interface=lo", f"--address={LINK_IP}",
            "--peer-address=127.0.0.1", f"--peer-port={peer}", f"--ib-hca={HCA}",
            f"--root={tree}", f"--ip-json={ip_json}", f"--env-file={env_file}"]  # fmt: skip
    run = cli(*args)
    assert run.returncode == 0, run.stderr
    assert env_file.read_text().splitlines()[1:] == ["NCCL_IB_GID_INDEX=5"]
    env_file.unlink()
    run = cli(*args, "--gid-index=3")
    assert run.returncode == 1 and not env_file.exists()
    assert "sparkple pair-link-check: spark-a: sparkple_pair_ib_gid_index is 3" in run.stderr


def test_the_transport_cli_refuses_or_warns_on_a_socket_pair(tmp_path: Path) -> None:
    log = tmp_path / "journal.txt"
    log.write_text(SOCKET_LOG)
    run = cli("pair-transport", "--host=spark-a", f"--log={log}", "--expect=ib")
    assert run.returncode == 1
    assert "NCCL uses Socket, not ib: the pair runs on TCP sockets" in run.stderr
    run = cli("pair-transport", "--host=spark-a", f"--log={log}", "--on-mismatch=warn")
    assert run.returncode == 0 and "WARNING" in run.stderr
    assert cli("pair-transport", "--host=a", f"--log={log}", "--expect=socket").returncode == 0
    log.write_text(IB_LOG)
    run = cli("pair-transport", "--host=spark-a", f"--log={log}")
    assert run.returncode == 0 and "NCCL uses IB ([0]rocep1s0f1:1/RoCE" in run.stdout
    log.write_text("vLLM started\n")
    run = cli("pair-transport", "--host=spark-a", f"--log={log}")
    assert run.returncode == 1 and "no NCCL 'Using network' line" in run.stderr
