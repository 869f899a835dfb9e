"""The host's serving status in one report: the supervisor's, the watchdog's and the probe's
state, the incidents of the last 24 h, the kernel's error counts, MemAvailable now and, given
the table's directory, whether a table is published there (`supervisor status`, which
playbooks/status.yml reads, and the line of the supervisor's daily heartbeat), and the table's
NVMe drive: each controller's live APST latency tolerance (sparkple.nvme; kernel_tuning sets it,
0 keeping the drive out of its idle power states) and the kernel's default for new ones."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from .. import nvme
from ..errors import TableError
from ..meminfo import read_meminfo
from ..runtime.tablemeta import META_NAME, read_meta
from .devices import KMSG, kernel_error_counts
from .state import INCIDENT_KINDS, iso, manual_stop_path, read_json, read_markers


def state_options() -> argparse.ArgumentParser:
    """The flags of what the report reads (an argparse parent): the shared state directory,
    the kernel log and the PLE table's device."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--state-dir", type=Path, required=True, help="markers and state (shared)")
    p.add_argument("--kmsg", type=Path, default=KMSG, help="kernel log (Xid counts)")
    p.add_argument(
        "--table-dir", type=Path, help="the published PLE table (I/O errors on its device)"
    )
    p.add_argument("--table-device", default="", help="its block device; default: found")
    return p


def report(
    state_dir: Path,
    kmsg: Path,
    io_device: str = "",
    table_dir: Path | None = None,
    sysfs: Path = nvme.SYSFS,
) -> dict[str, Any]:
    now = time.time()
    sup = read_json(state_dir / "supervisor.json", None)
    if not io_device and isinstance(sup, dict):
        io_device = sup.get("table_device") or ""  # the one the supervisor's loop watches
    return {
        "manual_stop": manual_stop_path(state_dir).exists(),
        "supervisor": read_json(state_dir / "supervisor.json", None),
        "watchdog": read_json(state_dir / "watchdog.json", None),
        "probe": read_json(state_dir / "probe.json", None),
        "incidents_24h": [
            {k: m.get(k) for k in ("kind", "time_iso", "reason", "path")}
            for m in read_markers(state_dir, INCIDENT_KINDS, now - 86400)
        ],
        "kernel_errors": kernel_error_counts(kmsg, io_device),
        "table_device": io_device or None,
        "pair": pair_status(sup),
        "mem_available_bytes": read_meminfo().get("MemAvailable"),
        "table": table_status(table_dir) if table_dir is not None else None,
        "table_drive": drive_status(table_dir, io_device, sysfs),
    }


def drive_status(table_dir: Path | None, device: str, sysfs: Path) -> dict[str, Any] | None:
    """The table's drive and its APST latency (sparkple.nvme's report), found from the table's
    directory, else from its block device; None when neither is known or it cannot be read."""
    try:
        if table_dir is not None:
            return nvme.report(nvme.locate(table_dir, sysfs), sysfs)
        if device:
            return nvme.report(nvme.locate_device(device, sysfs), sysfs)
    except OSError:
        return None
    return None


def table_status(table_dir: Path) -> dict[str, Any]:
    """published (its metadata valid and its data file whole), missing or broken, and why."""
    try:
        meta = read_meta(table_dir)
    except TableError as exc:
        gone = not (table_dir / META_NAME).exists()
        return {"state": "missing" if gone else "broken", "error": str(exc)}
    return {"state": "published", "data_bytes": meta.data_bytes}


def pair_status(sup: Any) -> dict[str, Any] | None:
    """A pair node's view of its pair (from the supervisor's last check); None on a single
    Spark."""
    pair = sup.get("pair") if isinstance(sup, dict) else None
    if not isinstance(pair, dict):
        return None
    peer = pair.get("peer") or {}
    return {
        "name": pair.get("name"),
        "role": pair.get("role"),
        "host": pair.get("host"),
        "generation": pair.get("generation"),
        "want_worker": pair.get("want_worker"),
        "up": pair.get("up"),
        "peer": peer.get("host"),
        "peer_reachable": bool(peer.get("reachable")),
        "peer_unit_active": peer.get("unit_active"),
        "peer_state": peer.get("state"),
        "peer_generation": peer.get("generation"),
        "peer_seen_at": peer.get("seen_at"),
        "link_error": pair.get("link_error") or pair.get("peer_problem"),
        "release": (pair.get("release") or {}).get("release"),
        "peer_release": peer.get("release"),
        "mixed_release": bool(pair.get("mixed_release")),
        # the peer's supervisor unreachable past the bound while this side serves (since when)
        "peer_unreachable_serving_since": pair.get("peer_unreachable_since"),
    }


def pair_line(pair: dict[str, Any]) -> str:
    unit = {True: "active", False: "inactive"}.get(pair["peer_unit_active"], "unknown")
    return (
        f"pair {pair['name']}: {pair['role']} {pair['host']}, peer {pair['peer'] or '-'} "
        + ("reachable" if pair["peer_reachable"] else "unreachable")
        + f" (unit {unit}, supervisor {pair['peer_state'] or 'unknown'}, last seen "
        f"{iso_or_dash(pair['peer_seen_at'])}), generation {pair['generation']}"
        + (f"; link: {pair['link_error']}" if pair["link_error"] else "")
        + (
            f"; MIXED RELEASES: {pair['release']} here, {pair['peer_release']} on the peer"
            if pair["mixed_release"]
            else ""
        )
    )


def kernel_line(errors: dict[str, int] | None, device: str | None = None) -> str:
    if errors is None:
        return "kernel log: unreadable"
    line = f"kernel log: Xid {errors['xid']}, NV_ERR_NO_MEMORY {errors['nv_err_no_memory']}"
    if "table_io" in errors:
        line += f", table I/O errors {errors['table_io']} ({device})"
    return line


def one_line(rep: dict[str, Any]) -> str:
    """The status in one line (the daily heartbeat's text)."""
    sup = rep["supervisor"] or {}
    probe = rep["probe"] or {}
    wd = rep["watchdog"] or {}
    return (
        f"supervisor {sup.get('state', 'unknown')}"
        + (" (manual stop)" if rep["manual_stop"] else "")
        + (f", {pair_line(rep['pair'])}" if rep.get("pair") else "")
        + f", probe {probe.get('last_result', 'unknown')}, incidents in 24 h "
        f"{len(rep['incidents_24h'])}, MemAvailable "
        f"{wd.get('mem_available_bytes', 0) // (1024 * 1024)} MiB, "
        + kernel_line(rep["kernel_errors"], rep.get("table_device"))
        + (f", {nvme.line(rep['table_drive'])}" if rep.get("table_drive") else "")
    )


def status(
    state_dir: Path, as_json: bool, kmsg: Path, io_device: str = "", table_dir: Path | None = None
) -> int:
    rep = report(state_dir, kmsg, io_device, table_dir)
    if as_json:
        print(json.dumps(rep, indent=2, sort_keys=True))
        return 0
    sup = rep["supervisor"] or {}
    wd = rep["watchdog"] or {}
    probe = rep["probe"] or {}
    mib = 1024 * 1024
    lines = [
        f"supervisor: {sup.get('state', 'unknown')}"
        + (f" (hold: {sup['hold_reason']})" if sup.get("hold_reason") else "")
        + (" (manual stop)" if rep["manual_stop"] else ""),
        f"  restarts in streak {sup.get('restarts', 0)}, failed launches "
        f"{sup.get('launch_failures', 0)}, next attempt {iso_or_dash(sup.get('next_attempt_at'))}",
        f"watchdog: MemAvailable {wd.get('mem_available_bytes', 0) // mib} MiB, MemFree "
        f"{wd.get('mem_free_bytes', 0) // mib} MiB, trips {wd.get('trips', 0)}, "
        f"updated {iso_or_dash(wd.get('updated'))}",
        f"probe: {probe.get('last_result', 'unknown')}, consecutive failures "
        f"{probe.get('consecutive_failures', 0)}, last ok {iso_or_dash(probe.get('last_ok'))}",
        kernel_line(rep["kernel_errors"], rep.get("table_device")),
        f"incidents in 24 h: {len(rep['incidents_24h'])}",
    ]
    if rep["table"]:
        table = rep["table"]
        lines.append(
            f"table: {table['state']}" + (f" ({table['error']})" if "error" in table else "")
        )
    if rep["table_drive"]:
        lines.append(nvme.line(rep["table_drive"]))
    if rep["pair"]:
        lines.insert(2, pair_line(rep["pair"]))
    lines += [f"  {m['time_iso']} {m['kind']}: {m['reason']}" for m in rep["incidents_24h"]]
    print("\n".join(lines))
    return 0


def iso_or_dash(t: Any) -> str:
    return iso(t) if isinstance(t, int | float) else "-"
