"""What a test needs to run lab/lab_server.py outside its container: a `vllm` package whose one
"patched" file is listed in a patch manifest (the server checks it as the serving container
checks the rendered patches), a free local port, and the server itself on this machine."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def lab_server(
    root: Path, snap: Path, table: Path, args: list[str], env: dict[str, str] | None = None
) -> Iterator[int]:
    """lab/lab_server.py serving `snap` with `table` on a free port of this machine (its port),
    its log in root/server.log, healthy within 60 s; stopped (SIGTERM, then SIGKILL after 15 s)
    on leaving."""
    site, patches = patched_site(root)
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}",
                "SPARKPLE_PLE_TABLE_DIR": str(table), "SPARKPLE_PATCH_DIR": str(patches),
                **(env or {})}  # fmt: skip
    argv = [sys.executable, str(ROOT / "lab" / "lab_server.py"), "--model", str(snap),
            "--port", str(port), *args]  # fmt: skip
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not healthy(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no /health 200: {(root / 'server.log').read_text()}")
            time.sleep(0.1)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
