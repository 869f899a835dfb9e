"""Check a deployed patch directory against its manifest (and, optionally, compile it)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .profile import sha256_file
from .render import MANIFEST_NAME


def check(out_dir: str | os.PathLike[str], *, compile_files: bool = False) -> list[str]:
    """Compare a deployed directory against its manifest; return the problems (empty: OK).

    compile_files: also compile every listed file with this interpreter (run it with the
    serving image's Python to learn that the patch compiles where it will run).
    """
    out = Path(out_dir)
    manifest_path = out / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{manifest_path}: no readable manifest ({exc})"]
    problems = []
    listed = set()
    for entry in files:
        rel = entry["path"]
        listed.add(rel)
        path = out / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        actual = sha256_file(path)
        if actual != entry["patched_sha256"]:
            problems.append(
                f"{rel}: sha256 {actual} differs from the manifest's {entry['patched_sha256']}"
            )
        elif compile_files:
            try:
                compile(path.read_bytes(), str(path), "exec")
            except (SyntaxError, ValueError) as exc:
                version = ".".join(map(str, sys.version_info[:3]))
                problems.append(f"{rel}: does not compile with Python {version}: {exc}")
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out).as_posix()
        if path.is_file() and rel != MANIFEST_NAME and rel not in listed:
            problems.append(f"{rel}: not in the manifest")
    return problems
