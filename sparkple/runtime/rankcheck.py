"""What the tensor-parallel ranks check about each other's tables at load.

Each node serves its own copy of the packed table, built from its own copy of the checkpoint.
The ranks' bytes are summed row by row, so two copies built from different checkpoint
revisions would give garbled rows without any error. At load every rank describes its table
(`describe`), the descriptions are exchanged over the group, and `check_ranks` refuses a group
whose tables differ, naming both sides, or whose row ranges do not give each row one owner.
A rank whose own checks failed says so in its description: its peers stop with it, at load,
instead of waiting for it in their next collective.
"""

from __future__ import annotations

import socket
from typing import Any

from ..errors import TableError
from .rowshard import OwnedRows, check_tiling
from .tablemeta import TableMeta


def describe(
    rank: int,
    table_dir: object,
    meta: TableMeta,
    owned: OwnedRows,
    problems: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """One rank's side of the exchange (plain values: it is pickled over the group);
    problems: what this rank's own checks of its table against its checkpoint found."""
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "table_dir": str(table_dir),
        "snapshot": meta.source.snapshot_id,
        "fingerprint": meta.fingerprint(),
        "fields": meta.fingerprinted(),
        "owned": (owned.start, owned.end),
        "total_rows": meta.total_rows,
        "problems": list(problems),
    }


def _side(entry: dict[str, Any]) -> str:
    return (
        f"rank {entry['rank']} on {entry['host']} (table {entry['table_dir']}, snapshot "
        f"{entry['snapshot']}, fingerprint {entry['fingerprint'][:16]})"
    )


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [key for key in keys if a.get(key) != b.get(key)]


def check_ranks(entries: list[dict[str, Any]]) -> None:
    """No rank may have failed its own checks, every rank's table must have rank 0's
    fingerprint, and their ranges must tile it."""
    entries = sorted(entries, key=lambda entry: entry["rank"])
    for entry in entries:
        if entry["problems"]:
            raise TableError(
                f"{_side(entry)} refused its PLE table: {'; '.join(entry['problems'])}. "
                "A pair starts only when both ranks can serve their tables"
            )
    first = entries[0]
    for other in entries[1:]:
        if other["fingerprint"] != first["fingerprint"]:
            differ = ", ".join(_differences(first["fields"], other["fields"]))
            raise TableError(
                f"the tensor-parallel ranks serve different PLE tables: {_side(first)} and "
                f"{_side(other)} differ in {differ}. Summing their rows would garble the "
                "output: build both tables from the same checkpoint revision (`sparkple "
                "build-table SNAPSHOT OUT_DIR --force` on each node) before starting the pair"
            )
    check_tiling([tuple(entry["owned"]) for entry in entries], first["total_rows"])
