"""The health probe against the real lab server (lab/lab_server.py): healthy, down, starting,
protected by an API key, congested then wedged (its engine process SIGSTOPped while the API
front still answers /health), and dead after readiness (/health failing)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

from ops_helpers import markers, program, read_json, wait_for


def probe(state, lab, *args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    """One probe run against the lab server; its instance id is the front's pid while it runs."""
    pidfile = lab.dir / "front.pid"
    argv = program(
        "probe",
        "--state-dir", state,
        "--url", lab.url,
        "--generation-timeout-s", 0.5,
        "--instance-cmd", f"sh -c 'kill -0 $(cat {pidfile}) 2>/dev/null && cat {pidfile}'",
        *args,
    )  # fmt: skip
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})}
    )


def test_a_healthy_server_passes(tmp_path, lab):
    lab.start()
    done = probe(tmp_path / "state", lab)
    assert done.returncode == 0, done.stdout + done.stderr
    state = read_json(tmp_path / "state" / "probe.json")
    assert state["last_result"] == "healthy" and state["consecutive_failures"] == 0
    assert state["last_detail"].startswith("16 tokens") and state["ready"] is True


def test_generations_failing_with_health_200_alert_congested_and_stop_only_later(
    tmp_path, lab, receiver
):
    """The engine process is stopped (SIGSTOP): /health stays 200, generations time out."""
    url, got = receiver
    lab.start()
    state = tmp_path / "state"
    acted = tmp_path / "stop-ran"
    window = 4
    flags = (
        "--congested-after", 2, "--congested-stop-s", window, "--stop-cmd", f"touch {acted}"
    )  # fmt: skip
    env = {"PLE_ALERT_URL": url}
    assert probe(state, lab, *flags).returncode == 0
    engine = lab.pid("engine")
    os.kill(engine, signal.SIGSTOP)
    try:
        first = probe(state, lab, *flags, env=env)
        assert first.returncode == 1 and "generation failing" in first.stdout, first.stdout
        assert "(1/2)" in first.stdout and "HTTP no response after 0.5 s" in first.stdout
        # the deadline is the probe's own: congested_since (its state file) plus the window
        since = read_json(state / "probe.json")["congested_since"]
        deadline = since + window
        # congested: alerted, but nothing stopped (requests stay in flight) while a run starts
        # before the deadline, however slowly the runs come
        congested_runs = 0
        while True:
            done = probe(state, lab, *flags, env=env)
            if read_json(state / "probe.json")["last_run"] >= deadline:
                break  # this run started past the deadline: it must have stopped the engine
            assert done.returncode == 1 and "congested:" in done.stdout, done.stdout
            assert not acted.exists() and markers(state, "wedged") == []
            congested_runs += 1
            with urllib.request.urlopen(lab.url + "/health", timeout=2) as r:
                assert r.status == 200, "the front still says healthy"
            if congested_runs >= 2:
                # then wait out the window (by the wall clock the probe uses) and probe again
                while time.time() < deadline:
                    time.sleep(min(0.2, max(0.0, deadline - time.time())))
        assert congested_runs >= 1, "no probe ran inside the window: make it longer"
        wait_for(lambda: any(a["event"] == "congested" for a in got), 5, "the congested alert")
    finally:
        os.kill(engine, signal.SIGCONT)
    assert done.returncode == 1 and "WEDGED" in done.stdout, done.stdout
    [marker] = markers(state, "wedged")
    assert "/health 200 but generations failed for" in marker["reason"]
    assert acted.exists() and marker["action_exit"] == 0, "the stop command ran"
    st = read_json(state / "probe.json")
    assert st["last_result"] == "wedged" and st["consecutive_failures"] == 0
    assert st["wedged_total"] == 1
    wait_for(lambda: any(a["event"] == "engine-wedged" for a in got), 5, "the wedged alert")
    assert [a["event"] for a in got].count("congested") == 1, "rate-limited, not one per run"
    # Once the engine runs again, the next probe is healthy.
    assert probe(state, lab, *flags).returncode == 0


def test_health_failing_after_readiness_stops_the_engine(tmp_path, lab, receiver):
    url, got = receiver
    lab.start()
    state = tmp_path / "state"
    flags = ("--health-fail-after", 3, "--stop-cmd", lab.cmd("stop"))
    env = {"PLE_ALERT_URL": url}
    assert probe(state, lab, *flags).returncode == 0  # ready: /health answered 200
    (lab.dir / "health-fail").touch()  # the engine core died: /health 503
    for attempt in (1, 2):
        done = probe(state, lab, *flags, env=env)
        assert done.returncode == 1 and f"health failing: /health: HTTP 503 ({attempt}/3)" in (
            done.stdout
        ), done.stdout
        assert lab.active() and markers(state, "unhealthy") == []
    done = probe(state, lab, *flags, env=env)
    assert done.returncode == 1 and "UNHEALTHY" in done.stdout, done.stdout
    [marker] = markers(state, "unhealthy")
    assert "/health failed 3 times in a row after the server was ready" in marker["reason"]
    assert marker["action_exit"] == 0 and not lab.active(), "stopped for the supervisor"
    wait_for(lambda: any(a["event"] == "engine-dead" for a in got), 5, "the alert")
    assert read_json(state / "probe.json")["unhealthy_total"] == 1


def test_a_starting_server_is_left_to_the_supervisor(tmp_path, lab):
    """A new instance whose /health never answered 200 is not counted, however long it takes."""
    lab.start()
    (lab.dir / "health-fail").touch()
    state = tmp_path / "state"
    for _ in range(5):
        done = probe(state, lab, "--health-fail-after", 1, "--stop-cmd", lab.cmd("stop"))
        assert done.returncode == 1 and "starting: /health: HTTP 503" in done.stdout, done.stdout
    assert lab.active() and markers(state, "unhealthy") == []


def test_a_down_server_is_not_a_wedge(tmp_path, lab):
    state = tmp_path / "state"
    for _ in range(6):
        done = probe(state, lab)  # nothing runs
        assert done.returncode == 1 and "down: the unit is not running" in done.stdout
    assert markers(state, "wedged") == [] and markers(state, "unhealthy") == []
    assert read_json(state / "probe.json")["consecutive_failures"] == 0


def test_the_api_key_comes_from_an_env_file(tmp_path, lab):
    lab.start("--api-key", "s3cret")
    state = tmp_path / "state"
    without = probe(state, lab)
    assert without.returncode == 1 and "HTTP 401" in without.stdout
    env = tmp_path / "vllm.env"
    env.write_text("# secrets\nHF_TOKEN=x\nVLLM_API_KEY='s3cret'\n")
    env.chmod(0o600)
    done = probe(state, lab, "--api-key-file", env)
    assert done.returncode == 0, done.stdout
    assert "s3cret" not in done.stdout + done.stderr, "the key is never printed"


def test_manual_stop_skips_probing(tmp_path, lab):
    state = tmp_path / "state"
    state.mkdir()
    (state / "manual-stop").write_text("set\n")
    done = probe(state, lab)
    assert done.returncode == 0 and "manual stop" in done.stdout
