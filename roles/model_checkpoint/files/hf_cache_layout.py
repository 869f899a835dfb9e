"""Publish a directory of model files as a revision in the Hugging Face cache layout.

Usage: hf_cache_layout.py SOURCE_DIR REPO_DIR REVISION
Each file of SOURCE_DIR moves to REPO_DIR/blobs/<sha256> and REPO_DIR/snapshots/REVISION/<name>
becomes a relative symlink to it (`../../blobs/<sha256>`), as `snapshot_download` lays a
revision out. The snapshot directory appears at once (built under a temporary name, then
renamed); SOURCE_DIR is removed. Prints the number of files published.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def publish(source: Path, repo: Path, revision: str) -> int:
    snapshot = repo / "snapshots" / revision
    if snapshot.exists():
        raise SystemExit(f"{snapshot} exists already: remove it first to publish again")
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    staging = repo / "snapshots" / f".{revision}.links"
    shutil.rmtree(staging, ignore_errors=True)
    count = 0
    for path in sorted(p for p in source.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(source)
        blob = blobs / sha256(path)
        os.replace(path, blob)
        link = staging / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        count += 1
    os.rename(staging, snapshot)
    shutil.rmtree(source)
    return count


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    print(publish(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
