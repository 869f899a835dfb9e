"""Fixtures for the operations tests."""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lab_inputs import free_port, patched_site
from ops_helpers import SHM, LabService

from sparkple.builder.build import build_table
from sparkple.builder.plan import plan_build
from sparkple.builder.synth import synth_checkpoint


@pytest.fixture(scope="session")
def lab_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | int]:
    """A snapshot, its table, and a `vllm` package whose one "patched" file is in a manifest:
    what the lab server opens and checks, as in the lab's serving container."""
    root = tmp_path_factory.mktemp("lab-server")
    snap = synth_checkpoint(root / "snap", vocab_base=4_000, files=1, seed=5)
    build_table(snap, root / "table", quiet=True)
    site, patches = patched_site(root)
    heads = plan_build(snap).geometry.num_heads
    return {"snap": snap, "table": root / "table", "site": site, "patches": patches,
            "heads": heads}  # fmt: skip


@pytest.fixture
def lab(tmp_path: Path, lab_data: dict) -> Iterator[LabService]:
    """The lab server as the service under test (not started)."""
    server = LabService(tmp_path / "service", free_port(), lab_data)
    yield server
    server.kill_all()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[[list[str]], subprocess.Popen]]:
    """Start long-running programs, output into <tmp>/proc-N.log (read it with `output(p)`);
    every one is terminated at teardown."""
    started: list[subprocess.Popen] = []

    def spawn(argv: list[str]) -> subprocess.Popen:
        log = tmp_path / f"proc-{len(started)}.log"
        with open(log, "wb") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        p.log_path = log  # type: ignore[attr-defined]
        started.append(p)
        return p

    yield spawn
    for p in started:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def receiver():
    """A webhook receiver on 127.0.0.1: (its URL, the JSON bodies it got)."""
    got: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append(json.loads(body))
            self.send_response(204)
            self.end_headers()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", got
    server.shutdown()
    server.server_close()


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A per-test name prefix for POSIX shm segments; whatever carries it is removed after."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this machine")
    name = f"sparkple-test-{uuid.uuid4().hex[:8]}-"
    yield name
    for leftover in SHM.glob(name + "*"):
        leftover.unlink()
