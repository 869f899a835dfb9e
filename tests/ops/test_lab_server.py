"""The lab server (lab/lab_server.py) as real processes: its API front, its engine child, a real
table built through the synth + build path, and a patch manifest checked against real files.
A SIGSTOPped engine must look wedged (/health 200, completions 504 within the bound)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lab_inputs import free_port
from ops_helpers import LAB, ROOT, alive, children, wait_for

ENGINE_TIMEOUT_S = 0.5


def request(
    port: int, path: str, body: dict | None = None, timeout: float = 10
) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def complete(port: int, max_tokens: int = 8) -> tuple[int, dict]:
    return request(port, "/v1/completions", {"prompt": "hello spark", "max_tokens": max_tokens})


def gone(pid: int) -> bool:
    return not alive(pid)


@pytest.fixture
def lab_server(lab_data: dict, tmp_path: Path) -> Iterator[Callable[..., tuple]]:
    """Start the server; returns (front Popen, port). Everything is killed at teardown."""
    started: list[subprocess.Popen] = []

    def start(
        patch_dir: Path | None = None,
        extra_args: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
    ) -> tuple[subprocess.Popen, int]:
        port = free_port()
        env = {**os.environ,
               "PYTHONPATH": f"{ROOT}{os.pathsep}{lab_data['site']}",
               "SPARKPLE_PLE_TABLE_DIR": str(lab_data["table"]),
               "SPARKPLE_PATCH_DIR": str(patch_dir or lab_data["patches"]),
               "SPARKPLE_LAB_ENGINE_TIMEOUT_S": str(ENGINE_TIMEOUT_S),
               **(extra_env or {})}  # fmt: skip
        argv = [sys.executable, str(LAB / "lab_server.py"), "--model", str(lab_data["snap"]),
                "--port", str(port),
                "--gpu-memory-utilization", "0.9", *extra_args]  # fmt: skip
        with open(tmp_path / f"server-{len(started)}.log", "wb") as log:
            front = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        started.append(front)
        wait_for(lambda: front.poll() is not None or health(port) is not None, 30, "listening")
        return front, port

    yield start
    for front in started:
        for child in children(front.pid):
            os.kill(child, signal.SIGKILL)
        if front.poll() is None:
            front.kill()
        front.wait()


def health(port: int) -> int | None:
    try:
        return request(port, "/health", timeout=2)[0]
    except OSError:
        return None


def engine_of(front: subprocess.Popen) -> int:
    found = children(front.pid)
    assert len(found) == 1, f"the front should have one child, the engine: {found}"
    return found[0]


def test_completion_from_real_lookups_in_the_engine(lab_server, lab_data) -> None:
    front, port = lab_server()
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    engine_of(front)
    code, reply = complete(port, 8)
    assert code == 200, reply
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["sparkple_lab"]["ple_rows_gathered"] >= 8 * lab_data["heads"]
    assert (lab_data["table"] / Path(reply["sparkple_lab"]["table"]).name).is_file()


def test_stopped_engine_looks_wedged_and_recovers(lab_server) -> None:
    front, port = lab_server()
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    engine = engine_of(front)
    os.kill(engine, signal.SIGSTOP)
    try:
        assert health(port) == 200
        started = time.monotonic()
        code, reply = complete(port)
        took = time.monotonic() - started
        assert code == 504, reply
        assert "did not answer" in reply["error"]
        # waited its timeout, then gave up rather than hanging with the stopped engine (a
        # ratio: +2 s was tight on a loaded machine)
        assert ENGINE_TIMEOUT_S <= took < 10 * ENGINE_TIMEOUT_S
        assert health(port) == 200
    finally:
        os.kill(engine, signal.SIGCONT)
    code, reply = complete(port)
    assert code == 200 and reply["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    "engine_signal",
    [signal.SIGSTOP, signal.SIGTERM],
    ids=["engine-stopped", "engine-terminated-too"],  # the latter: systemd signals every process
)
def test_sigterm_to_the_front_is_a_clean_stop(lab_server, engine_signal) -> None:
    front, port = lab_server()
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    engine = engine_of(front)
    os.kill(engine, engine_signal)
    front.send_signal(signal.SIGTERM)
    assert front.wait(10) == 0
    assert gone(engine)


def test_engine_stopped_alone_stops_the_front_cleanly(lab_server) -> None:
    front, port = lab_server()
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    os.kill(engine_of(front), signal.SIGTERM)
    assert front.wait(10) == 0


def test_sigterm_while_starting(lab_server) -> None:
    front, port = lab_server()
    front.send_signal(signal.SIGTERM)
    assert front.wait(10) == 0


def test_engine_death_makes_the_front_exit_nonzero(lab_server) -> None:
    front, port = lab_server()
    wait_for(lambda: health(port) == 200, 30, "/health 200")
    os.kill(engine_of(front), signal.SIGKILL)
    assert front.wait(10) == 1


def test_unmounted_patches_keep_health_503_with_the_reason(lab_server, tmp_path: Path) -> None:
    front, port = lab_server(patch_dir=tmp_path / "nonexistent")

    def reason_shown() -> bool:
        code, body = request(port, "/health")
        return code == 503 and "no patch manifest" in body["error"]

    wait_for(reason_shown, 30, "/health 503 with the reason")
    assert front.poll() is None, "the front stays up to show the reason"
    assert complete(port)[0] == 503
