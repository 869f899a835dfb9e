"""What the tensor-parallel ranks check about each other's tables and releases at load.

Each node serves its own copy of the packed table, built from its own copy of the checkpoint.
The ranks' bytes are summed row by row, so two copies built from different checkpoint
revisions would give garbled rows without any error. At load every rank describes its table
(`describe`), the descriptions are exchanged over the group, and `check_ranks` refuses a group
whose tables differ, naming both sides, or whose row ranges do not give each row one owner.
A rank whose own checks failed says so in its description: its peers stop with it, at load,
instead of waiting for it in their next collective.

Each rank also says which release it runs: the release id and the sha256 of the patch manifest,
which the serving unit passes in SPARKPLE_RELEASE_ID and SPARKPLE_PATCH_MANIFEST_SHA256. Two
nodes of one pair on different releases (one rolled forward, the other back) are refused at
load, naming both. A value that is not set is compared as not set: two ranks that set neither
(a run outside the serving unit: a test, a benchmark, `vllm serve` by hand) agree, and the table
fingerprint is then what they compare; a rank that sets a value its peer does not is refused,
since nothing shows that the two run the same thing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ReleaseError, TableError
from .rowshard import OwnedRows, check_tiling
from .tablemeta import TableMeta

RELEASE_ID_ENV = "SPARKPLE_RELEASE_ID"
PATCH_MANIFEST_ENV = "SPARKPLE_PATCH_MANIFEST_SHA256"


@dataclass(frozen=True)
class Release:
    """What a node runs, as its serving unit names it ("" where it names nothing)."""

    release_id: str = ""
    patch_manifest_sha256: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Release:
        env = os.environ if environ is None else environ
        return cls(env.get(RELEASE_ID_ENV, "").strip(), env.get(PATCH_MANIFEST_ENV, "").strip())

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> Release:
        """The release in an exchanged description (a peer without one names nothing)."""
        return cls(
            str(entry.get("release_id") or ""), str(entry.get("patch_manifest_sha256") or "")
        )

    def entry(self) -> dict[str, str]:
        return {"release_id": self.release_id, "patch_manifest_sha256": self.patch_manifest_sha256}

    def __str__(self) -> str:
        return (
            f"release {self.release_id or '(not set)'}, patch manifest sha256 "
            f"{self.patch_manifest_sha256 or '(not set)'}"
        )


def release_mismatch(first: tuple[str, Release], other: tuple[str, Release]) -> str | None:
    """None when both sides run one release; otherwise a sentence naming both sides (name,
    release) and both values, and the fix. Shared by the engine's rank check and the lab pair."""
    (first_name, a), (other_name, b) = first, other
    if a == b:
        return None
    differ = [
        what
        for what, mine, theirs in (
            ("release id", a.release_id, b.release_id),
            ("patch manifest", a.patch_manifest_sha256, b.patch_manifest_sha256),
        )
        if mine != theirs
    ]
    return (
        f"{first_name} runs {a} and {other_name} runs {b} (they differ in {' and '.join(differ)})."
        " A pair serves one release on both nodes: roll both nodes out to the same release "
        "(playbooks/rollout.yml), or roll both back, and start the pair again"
    )


def describe(
    rank: int,
    table_dir: object,
    meta: TableMeta,
    owned: OwnedRows,
    problems: list[str] | tuple[str, ...] = (),
    *,
    release: Release,
) -> dict[str, Any]:
    """One rank's side of the exchange (plain values: it is pickled over the group);
    problems: what this rank's own checks of its table against its checkpoint found;
    release: what this rank runs (Release.from_env() in the engine)."""
    return {
        **release.entry(),
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


def _name(entry: dict[str, Any]) -> str:
    return f"rank {entry['rank']} on {entry['host']}"


def check_ranks(entries: list[dict[str, Any]]) -> None:
    """No rank may have failed its own checks, every rank must run rank 0's release and have
    its table fingerprint, and their ranges must tile the table."""
    entries = sorted(entries, key=lambda entry: entry["rank"])
    for entry in entries:
        if entry["problems"]:
            raise TableError(
                f"{_side(entry)} refused its PLE table: {'; '.join(entry['problems'])}. "
                "A pair starts only when both ranks can serve their tables"
            )
    first = entries[0]
    for other in entries[1:]:
        mismatch = release_mismatch(
            (_name(first), Release.of(first)), (_name(other), Release.of(other))
        )
        if mismatch:
            raise ReleaseError(f"the tensor-parallel ranks run different releases: {mismatch}")
        if other["fingerprint"] != first["fingerprint"]:
            differ = ", ".join(_differences(first["fields"], other["fields"]))
            raise TableError(
                f"the tensor-parallel ranks serve different PLE tables: {_side(first)} and "
                f"{_side(other)} differ in {differ}. Summing their rows would garble the "
                "output: build both tables from the same checkpoint revision (`sparkple "
                "build-table SNAPSHOT OUT_DIR --force` on each node) before starting the pair"
            )
    check_tiling([tuple(entry["owned"]) for entry in entries], first["total_rows"])
