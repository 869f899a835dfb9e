"""The operations state directory shared by the watchdog, supervisor and probe.

Layout of the state dir (one per host):
  markers/<kind>-<UTC stamp>.json   one file per incident (kind: emergency, unhealthy,
                                    wedged, pair-broken); kept for forensics, counted by the
                                    supervisor's circuit breaker
  manual-stop                       flag: an operator stopped the service; nothing relaunches it
  <program>.json                    each program's current state, for `status` output
  alerts.json                       when each alert kind was last sent (rate limit)
  supervisor.lock                   serialises the supervisor's loop and the drain-and-relaunch

Standard library only: these programs run on the host's system Python.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from ..atomicfile import write_text

MARKERS = "markers"
# Markers that record an incident: a memory emergency stop, a server stopped by the probe
# because /health kept failing after readiness (unhealthy) or generations kept failing with
# /health 200 (wedged), on a pair's head one per break of the pair (pair-broken: either
# side went down, whatever stopped it; the breaker of a pair counts these alone), and one per
# rollout that failed on the node and was rolled back (rollback, written by the rollout; no
# breaker counts it: the rollout stopped, nothing relaunches into the failed release).
PAIR_BROKEN = "pair-broken"
ROLLBACK = "rollback"
INCIDENT_KINDS = frozenset({"emergency", "unhealthy", "wedged", PAIR_BROKEN, ROLLBACK})
MANUAL_STOP = "manual-stop"
# Every state the supervisor records in supervisor.json (the metrics export one gauge each).
SUPERVISOR_STATES = (
    "starting",
    "running",
    "launched",
    "backoff",
    "hold",
    "breaker-open",
    "manual-stop",
    "reset",
    "standby",  # a pair's worker whose unit is off until its head wants it
    "mixed-release",  # a pair's node whose peer is on another release: nothing is launched
)


def utc_stamp(t: float) -> str:
    """A sortable, filename-safe UTC stamp with microseconds."""
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ")


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


def write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", durable=durable)


def read_json(path: Path, default: Any) -> Any:
    """The parsed file, or `default` when it is missing or unreadable (a torn or hand-edited
    state file must not stop the protection loops)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when it is missing, unreadable or not an object."""
    data = read_json(path, {})
    return data if isinstance(data, dict) else {}


def update_json(path: Path, fields: dict[str, Any]) -> None:
    """Merge `fields` into the JSON object in `path` (written atomically)."""
    write_json(path, {**read_json_object(path), **fields})


def write_marker(state_dir: Path, kind: str, t: float, payload: dict[str, Any]) -> Path:
    """Record one incident; the marker's name sorts by time."""
    path = state_dir / MARKERS / f"{kind}-{utc_stamp(t)}.json"
    write_json(path, {"kind": kind, "time": t, "time_iso": iso(t), **payload})
    return path


def _marker_paths(state_dir: Path, kind: str) -> list[Path]:
    return list((state_dir / MARKERS).glob(f"{kind}-*.json"))


def read_markers(state_dir: Path, kinds: Collection[str], since: float) -> list[dict[str, Any]]:
    """Markers of the given kinds whose time is at or after `since`, oldest first.

    Markers are never pruned and the supervisor asks every few seconds, so the name (kind and
    a stamp that sorts by time) decides which files are worth parsing at all.
    """
    oldest = utc_stamp(since) if since > 0 else ""
    found = []
    for kind in kinds:
        for path in _marker_paths(state_dir, kind):
            if path.name[len(kind) + 1 : -len(".json")] < oldest:
                continue
            data = read_json(path, None)
            if not isinstance(data, dict) or data.get("kind") != kind:
                continue
            t = data.get("time")
            if isinstance(t, int | float) and t >= since:
                data["path"] = str(path)
                found.append(data)
    return sorted(found, key=lambda marker: marker["time"])


def count_markers(state_dir: Path, kinds: Collection[str]) -> dict[str, int]:
    """How many markers of each kind were ever recorded (counted by name, none parsed)."""
    return {kind: len(_marker_paths(state_dir, kind)) for kind in kinds}


def manual_stop_path(state_dir: Path) -> Path:
    return state_dir / MANUAL_STOP


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if needed) for the block's duration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
