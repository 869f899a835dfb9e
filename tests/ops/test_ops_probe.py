"""The health probe against the real stand-in server: healthy, down, protected by an API key,
and wedged (its engine process SIGSTOPped while the API front still answers /health)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

from ops_helpers import markers, program, read_json


def probe(state, url: str, *args: object) -> subprocess.CompletedProcess:
    argv = program(
        "ple_probe.py", "--state-dir", state, "--url", url, "--generation-timeout-s", 0.5, *args
    )
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_a_healthy_server_passes(tmp_path, standin):
    standin.start()
    done = probe(tmp_path / "state", standin.url)
    assert done.returncode == 0, done.stdout + done.stderr
    state = read_json(tmp_path / "state" / "probe.json")
    assert state["last_result"] == "healthy" and state["consecutive_failures"] == 0
    assert state["last_detail"].startswith("16 tokens")


def test_a_wedged_engine_is_declared_after_five_failures(tmp_path, standin):
    standin.start()
    state = tmp_path / "state"
    acted = tmp_path / "wedge-action-ran"
    engine = standin.pid("engine")
    os.kill(engine, signal.SIGSTOP)
    try:
        started = time.monotonic()
        for attempt in range(1, 5):
            done = probe(state, standin.url, "--wedged-cmd", f"touch {acted}")
            assert done.returncode == 1
            assert "generation failing" in done.stdout and f"({attempt}/5)" in done.stdout
            assert "HTTP no response after 0.5 s" in done.stdout, "it hung, not failed"
            assert markers(state, "wedged") == []
        with urllib.request.urlopen(standin.url + "/health", timeout=2) as r:
            assert r.status == 200, "the front still says healthy"
        done = probe(state, standin.url, "--wedged-cmd", f"touch {acted}")
        took = time.monotonic() - started
    finally:
        os.kill(engine, signal.SIGCONT)
    assert done.returncode == 1 and "WEDGED" in done.stdout
    [marker] = markers(state, "wedged")
    assert "/health 200 but 5 generations in a row failed" in marker["reason"]
    assert acted.exists() and marker["action_exit"] == 0, "the wedge action ran"
    st = read_json(state / "probe.json")
    assert st["last_result"] == "wedged" and st["consecutive_failures"] == 0
    assert st["wedged_total"] == 1
    print(f"wedge declared after 5 probes in {took:.1f} s")
    # Once the engine runs again, the next probe is healthy.
    assert probe(state, standin.url).returncode == 0


def test_a_down_server_is_not_a_wedge(tmp_path, standin):
    state = tmp_path / "state"
    for _ in range(6):
        done = probe(state, standin.url)  # nothing listens on the port
        assert done.returncode == 1 and "down: /health: HTTP no response" in done.stdout
    assert markers(state, "wedged") == []
    assert read_json(state / "probe.json")["consecutive_failures"] == 0


def test_the_api_key_comes_from_an_env_file(tmp_path, standin):
    standin.start("--api-key", "s3cret")
    state = tmp_path / "state"
    without = probe(state, standin.url)
    assert without.returncode == 1 and "HTTP 401" in without.stdout
    env = tmp_path / "vllm.env"
    env.write_text("# secrets\nHF_TOKEN=x\nVLLM_API_KEY='s3cret'\n")
    env.chmod(0o600)
    done = probe(state, standin.url, "--api-key-file", env)
    assert done.returncode == 0, done.stdout
    assert "s3cret" not in done.stdout + done.stderr, "the key is never printed"


def test_manual_stop_skips_probing(tmp_path, standin):
    state = tmp_path / "state"
    state.mkdir()
    (state / "manual-stop").write_text("set\n")
    done = probe(state, standin.url)
    assert done.returncode == 0 and "manual stop" in done.stdout
