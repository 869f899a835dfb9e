"""Whole-file replacement that readers never see half done: a temporary file beside the target,
then a rename over it.

Standard library only: the serving backend (stats), the host programs (sparkple.supervise) and the
table tools share it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text(path: Path, text: str, mode: int = 0o644, *, durable: bool = True) -> None:
    """Write `text` to `path` so readers see the old or the new content, never a part.

    durable: fsync before the rename, so the content also survives a crash of the host;
    a status file rewritten every few seconds skips it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
