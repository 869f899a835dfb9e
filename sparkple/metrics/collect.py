"""PLE metrics for node_exporter's textfile collector, written atomically.

One run collects:
  - MemAvailable, MemFree and the page cache (/proc/meminfo);
  - the PLE table's resident share: the data file named by <table-dir>/table.json is mapped
    read-only and `mincore` says which pages are in the page cache (nothing is read or faulted);
  - bytes read from the block device holding the table (/proc/diskstats);
  - major page faults of the serving process tree (/proc/<pid>/stat, pid from --pid or from
    `docker inspect` of --container);
  - the PLE counters the patched backend writes into the stats dir (format:
    sparkple/runtime/stats.py);
  - the supervisor's state and the incident markers, when --state-dir is given;
  - NVIDIA driver errors (Xid, NV_ERR_NO_MEMORY) in the kernel log, when --kmsg is given;
  - a pair node's link, when --link-interface (and --rdma-device) is given: the interface's IP
    bytes and state, and the RDMA port's bytes, errors, link downs and state (from sysfs,
    --sysfs-root; no RDMA device gives sparkple_pair_link_rdma_present 0 and no RDMA series).
A source that is missing only drops its metrics (and says so on stderr); the file is still
written, so one broken source never blanks the rest.

Standard library only: this runs on the host's system Python, with the package's own table
metadata, page-cache and stats-file readers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..atomicfile import write_text
from ..errors import TableError
from ..meminfo import read_meminfo
from ..pair.linkcounters import check_name, read_interface, read_rdma
from ..rdma import HcaError, parse_hcas
from ..runtime import stats
from ..runtime.pagecache import PAGE_SIZE, file_resident_pages
from ..runtime.tablemeta import read_meta
from ..supervise.commands import run_command
from ..supervise.devices import block_device, kernel_error_counts
from ..supervise.state import (
    INCIDENT_KINDS,
    SUPERVISOR_STATES,
    count_markers,
    manual_stop_path,
    read_json_object,
)
from .exposition import Exposition

STATS_HELP = {
    "rows_gathered": "rows copied into staging by the gather worker",
    "gather_calls": "gather batches",
    "pages_prefetched": "table pages covered by WILLNEED prefetch advice",
    "prefetch_calls": "prefetch batches",
    "staging_overruns": "batches that did not fit the staging buffer",
    "lookahead_pages_advised": "table pages of later prompt chunks advised ahead of their step",
    "lookahead_pages_used": "lookahead pages whose prompt chunk a step then gathered",
    "lookahead_pages_wasted": "lookahead pages of requests removed before their chunk ran",
    "host_device_mismatch": "requests whose prompt tokens on the host differed from the "
    "device's (their rows then come from the device's inputs)",
}


def warn(message: str) -> None:
    print(f"ple-metrics: {message}", file=sys.stderr, flush=True)


# -- memory -----------------------------------------------------------------------------------
def collect_memory(out: Exposition) -> None:
    mem = read_meminfo()
    out.metric("mem_available_bytes", "gauge", "MemAvailable.", mem["MemAvailable"])
    out.metric("mem_free_bytes", "gauge", "MemFree.", mem["MemFree"])
    out.metric("page_cache_bytes", "gauge", "Page cache (Cached).", mem.get("Cached", 0))


# -- the table --------------------------------------------------------------------------------
def disk_read_bytes(device: str) -> int | None:
    for line in Path("/proc/diskstats").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[2] == device:
            return int(parts[5]) * 512  # sectors read; diskstats sectors are 512 B
    return None


def collect_table(out: Exposition, table_dir: Path, device_override: str) -> None:
    try:
        meta = read_meta(table_dir)
        data_path, expected = meta.data_path(table_dir), meta.data_bytes
        resident, total = file_resident_pages(data_path)
    except TableError as exc:
        skipped = f"no published table ({exc})"
    except OSError as exc:
        skipped = str(exc)
    else:
        skipped = ""
    if skipped:
        warn(f"table metrics skipped: {skipped}")
        out.metric("ple_table_published", "gauge", "1 when table.json names a table.", 0)
        return
    out.metric("ple_table_published", "gauge", "1 when table.json names a table.", 1)
    out.metric("ple_table_size_bytes", "gauge", "Size of the PLE table data file.", expected)
    out.metric(
        "ple_table_resident_bytes",
        "gauge",
        "PLE table bytes in the page cache (mincore).",
        min(resident * PAGE_SIZE, expected),
    )
    out.metric(
        "ple_table_resident_ratio",
        "gauge",
        "Share of the PLE table's pages in the page cache (mincore).",
        resident / total if total else 0.0,
    )
    device = device_override or block_device(data_path)
    read = disk_read_bytes(device) if device else None
    if not device or read is None:
        warn(f"disk metrics skipped: no block device statistics for {data_path}")
        return
    out.metric(
        "ple_disk_read_bytes_total",
        "counter",
        "Bytes read from the block device holding the PLE table.",
        read,
        {"device": device},
    )


# -- the serving process ----------------------------------------------------------------------
def container_pid(container: str) -> int | None:
    inspect = "docker inspect --format {{{{.State.Pid}}}} {container}"  # braces doubled for format
    done = run_command(inspect, {"container": container}, timeout_s=20)
    pid = done.stdout.strip()
    return int(pid) if done.ok and pid.isdigit() and int(pid) > 0 else None


def proc_stat(pid: str) -> tuple[int, int] | None:
    """(ppid, majflt) from /proc/<pid>/stat; the command name may hold spaces and parens."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[9])  # fields 4 and 12 of proc(5), counted from 1


def tree_major_faults(root: int) -> tuple[int, int] | None:
    """(processes, major faults) summed over `root` and its live descendants."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := proc_stat(entry)) is not None:
            stats[int(entry)] = st
    if root not in stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return len(seen), sum(stats[p][1] for p in seen)


def collect_process(out: Exposition, pid: int | None, container: str) -> None:
    if pid is None and container:
        pid = container_pid(container)
    found = tree_major_faults(pid) if pid else None
    out.metric("serving_up", "gauge", "1 when the serving process was found.", int(bool(found)))
    if not found:
        return
    count, faults = found
    out.metric("serving_processes", "gauge", "Processes in the serving process tree.", count)
    out.metric(
        "serving_major_faults_total",
        "counter",
        "Major page faults of the live serving process tree.",
        faults,
    )


# -- PLE counters from the backend ------------------------------------------------------------
def read_stats_dir(stats_dir: Path, max_age_s: float, now: float) -> list[dict[str, Any]]:
    """Fresh, well-formed stats files (format defined in sparkple/runtime/stats.py)."""
    docs = []
    for path in sorted(stats_dir.glob("ple-stats-*.json")):
        try:
            doc = stats.parse(path.read_text(encoding="utf-8"))
        except (OSError, stats.StatsFormatError) as exc:
            warn(f"{path}: unreadable ({exc}); skipped")
            continue
        updated = doc.get("updated_at")
        if not isinstance(updated, int | float) or now - updated > max_age_s:
            continue  # its writer is gone
        docs.append(doc)
    return docs


def collect_stats(out: Exposition, stats_dir: Path, max_age_s: float) -> None:
    docs = read_stats_dir(stats_dir, max_age_s, time.time())
    out.metric("ple_stats_writers", "gauge", "Processes writing fresh PLE stats.", len(docs))
    if not docs:
        return
    for name in stats.COUNTERS:
        help_text = STATS_HELP[name]
        total = sum(int(d["counters"].get(name, 0)) for d in docs)
        out.metric(
            f"ple_{name}_total", "counter", help_text[0].upper() + help_text[1:] + ".", total
        )
    # Merge histograms by bound; every writer of one version uses the same bounds.
    merged: dict[float, int] = {}
    count, total_s = 0, 0.0
    for doc in docs:
        hist = doc["handshake_wait_seconds"]
        for le, n in zip(hist.get("le", []), hist.get("counts", []), strict=False):
            merged[float(le)] = merged.get(float(le), 0) + int(n)
        count += int(hist.get("count", 0))
        total_s += float(hist.get("sum", 0.0))
    name = out.family(
        "ple_handshake_wait_seconds",
        "histogram",
        "Time the forward waited for the gather worker's handshake.",
    )
    for le in sorted(merged):
        out.sample(f"{name}_bucket", merged[le], {"le": repr(le)})
    out.sample(f"{name}_bucket", count, {"le": "+Inf"})
    out.sample(f"{name}_sum", total_s)
    out.sample(f"{name}_count", count)


# -- operations state -------------------------------------------------------------------------
def collect_ops(out: Exposition, state_dir: Path) -> None:
    name = out.family("ops_incidents_total", "counter", "Incident markers recorded, by kind.")
    for kind, n in sorted(count_markers(state_dir, INCIDENT_KINDS).items()):
        out.sample(name, n, {"kind": kind})
    state = read_json_object(state_dir / "supervisor.json").get("state")
    name = out.family("supervisor_state", "gauge", "1 for the supervisor's current state.")
    for s in SUPERVISOR_STATES:
        out.sample(name, int(state == s), {"state": s})
    out.metric(
        "supervisor_manual_stop",
        "gauge",
        "1 while the manual-stop flag is set.",
        int(manual_stop_path(state_dir).exists()),
    )


def collect_kernel(out: Exposition, kmsg: Path, io_device: str) -> None:
    counts = kernel_error_counts(kmsg, io_device)
    if counts is None:
        warn(f"cannot read the kernel log {kmsg}; no kernel error counts")
        return
    name = out.family(
        "kernel_errors",
        "gauge",
        "Lines in the kernel log's ring buffer: NVIDIA driver errors (Xid, NV_ERR_NO_MEMORY) "
        "and I/O errors on the table's device (table_io).",
    )
    for kind, n in sorted(counts.items()):
        out.sample(name, n, {"kind": kind})


# -- the pair link ----------------------------------------------------------------------------
def collect_link(out: Exposition, sysfs: Path, interface: str, hca: str) -> None:
    """The link interface's IP bytes and the HCA port's RDMA counters (docs/link-monitoring.md)."""
    iface = read_interface(sysfs, interface)
    labels = {"interface": interface}
    if not iface.present:
        warn(f"no network interface {interface} under {sysfs}/class/net; no IP byte counts")
    out.metric(
        "pair_link_interface_up",
        "gauge",
        "1 while the pair link's interface is up.",
        iface.up,
        labels,
    )
    if iface.rx_bytes is not None and iface.tx_bytes is not None:
        name = out.family(
            "pair_link_ip_bytes_total",
            "counter",
            "Bytes of the kernel's network stack on the pair link's interface (no RoCE).",
        )
        out.sample(name, iface.rx_bytes, {**labels, "direction": "receive"})
        out.sample(name, iface.tx_bytes, {**labels, "direction": "transmit"})
    if iface.carrier_changes is not None:
        out.metric(
            "pair_link_carrier_changes_total",
            "counter",
            "Times the pair link's interface lost or regained its carrier.",
            iface.carrier_changes,
            labels,
        )
    if not hca:
        return
    # every device of the list (a ConnectX-7's twin ports are two), each port apart; the
    # dashboards and rules sum them per host
    ports = []
    present = "1 when the pair link's RDMA device (and port) is in sysfs."
    name = out.family("pair_link_rdma_present", "gauge", present)
    for each in parse_hcas(hca):
        port = None if each.port is None else str(each.port)
        found = read_rdma(sysfs, each.device, port) or []
        out.sample(name, int(bool(found)), {"device": each.device})
        if not found:
            warn(f"no RDMA device {each.device} under {sysfs}/class/infiniband; no counters")
        ports += found
    if not ports:
        return
    # each family's samples right after its HELP and TYPE (the text format groups them)
    name = out.family(
        "pair_link_rdma_port_active", "gauge", "1 while the RDMA port's state is ACTIVE."
    )
    for p in ports:
        if p.active is not None:
            out.sample(name, p.active, {"device": p.device, "port": p.port})
    name = out.family(
        "pair_link_rdma_bytes_total",
        "counter",
        "RDMA bytes through the port (port_xmit_data and port_rcv_data x 4).",
    )
    for p in ports:
        at = {"device": p.device, "port": p.port}
        if p.tx_bytes is not None:
            out.sample(name, p.tx_bytes, {**at, "direction": "transmit"})
        if p.rx_bytes is not None:
            out.sample(name, p.rx_bytes, {**at, "direction": "receive"})
    name = out.family(
        "pair_link_rdma_link_downed_total",
        "counter",
        "Times the port's link error recovery failed and the link went down (link_downed).",
    )
    for p in ports:
        if p.link_downed is not None:
            out.sample(name, p.link_downed, {"device": p.device, "port": p.port})
    name = out.family(
        "pair_link_rdma_errors_total",
        "counter",
        "The RDMA port's error counters (counters/ and RoCE hw_counters/), by counter.",
    )
    for p in ports:
        for counter, value in sorted(p.errors.items()):
            out.sample(name, value, {"device": p.device, "port": p.port, "counter": counter})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the .prom file to (re)write")
    p.add_argument("--table-dir", type=Path, help="the published PLE table's directory")
    p.add_argument("--disk-device", default="", help="block device name; default: the table's")
    p.add_argument("--pid", type=int, help="serving process id (default: from --container)")
    p.add_argument("--container", default="", help="serving container name")
    p.add_argument("--stats-dir", type=Path, help="where the backend writes ple-stats-*.json")
    p.add_argument("--stats-max-age-s", type=float, default=60.0, help="older files are stale")
    p.add_argument("--state-dir", type=Path, help="the watchdog/supervisor state dir")
    p.add_argument(
        "--kmsg", type=Path, help="kernel log to count NVIDIA errors in (e.g. /dev/kmsg)"
    )
    p.add_argument("--link-interface", default="", help="a pair node's link interface")
    p.add_argument(
        "--rdma-device",
        default="",
        help="the link's RDMA device(s) as NCCL_IB_HCA names them: DEVICE[:PORT][,DEVICE[:PORT]]",
    )
    p.add_argument(
        "--check-args",
        action="store_true",
        help="check the arguments (the link's names included) and exit: what the role runs",
    )
    p.add_argument(
        "--sysfs-root", type=Path, default=Path("/sys"), help="where sysfs is (tests: a tree)"
    )
    args = p.parse_args(argv)
    if args.rdma_device and not args.link_interface:
        p.error("--rdma-device needs --link-interface (the pair link's interface)")
    try:
        if args.link_interface:
            check_name("interface", args.link_interface)
        if args.rdma_device:
            parse_hcas(args.rdma_device)
    except (HcaError, ValueError) as exc:
        p.error(
            f"{exc}: set the pair's link in the inventory (sparkple_pair_link_interface, "
            "sparkple_pair_ib_hca)"
        )
    if args.out.suffix != ".prom":
        p.error("--out must end in .prom (node_exporter's textfile collector reads only those)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check_args:
        return 0
    started = time.monotonic()
    out = Exposition()
    collect_memory(out)
    if args.table_dir:
        collect_table(out, args.table_dir, args.disk_device)
    if args.pid or args.container:
        collect_process(out, args.pid, args.container)
    if args.stats_dir:
        collect_stats(out, args.stats_dir, args.stats_max_age_s)
    if args.state_dir:
        collect_ops(out, args.state_dir)
    if args.kmsg:
        device = args.disk_device
        if not device and args.table_dir:
            try:
                device = block_device(args.table_dir) or ""
            except OSError:
                device = ""
        collect_kernel(out, args.kmsg, device)
    if args.link_interface:
        collect_link(out, args.sysfs_root, args.link_interface, args.rdma_device)
    out.metric(
        "metrics_collect_seconds",
        "gauge",
        "Time this collection took.",
        round(time.monotonic() - started, 6),
    )
    try:
        write_text(args.out, out.text())
    except OSError as exc:
        warn(f"cannot write {args.out}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
