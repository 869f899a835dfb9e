"""What a test needs to run lab/lab_server.py outside its container: a `vllm` package whose one
"patched" file is listed in a patch manifest (the server checks it as the serving container
checks the rendered patches), and a free local port."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path


def patched_site(root: Path) -> tuple[Path, Path]:
    """(site directory for PYTHONPATH, patch directory with its manifest) under root."""
    vllm = root / "site" / "vllm"
    vllm.mkdir(parents=True)
    (vllm / "__init__.py").write_text("")
    (vllm / "patched.py").write_text("# patched\n")
    patches = root / "patches"
    patches.mkdir()
    digest = hashlib.sha256((vllm / "patched.py").read_bytes()).hexdigest()
    manifest = {"files": [{"path": "patched.py", "patched_sha256": digest}]}
    (patches / "manifest.json").write_text(json.dumps(manifest))
    return root / "site", patches


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
