"""The supervisor relaunching the real lab server (lab/lab_server.py) as its service, with the
real watchdog stopping it (its floor set above this machine's real MemAvailable), backoff, hold
and circuit breaker."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ops_helpers import (
    SHM,
    above_real_memory,
    markers,
    output,
    program,
    read_json,
    wait_for,
    watchdog_cmd,
)

from sparkple.supervise.state import count_markers, read_markers, write_marker

BASE = 0.5


def supervisor(state, service, *args: object) -> list[str]:
    return program(
        "supervisor", "run",
        "--state-dir", state,
        "--check-cmd", service.cmd("is-active"),
        "--start-cmd", service.cmd("start"),
        "--stop-cmd", service.cmd("stop"),
        "--poll-s", 0.1,
        "--backoff-base-s", BASE,
        "--backoff-cap-s", 30,
        "--stable-s", 60,
        *args,
    )  # fmt: skip


def sup_state(state) -> dict:
    return read_json(state / "supervisor.json")


def events(state, name: str) -> list[dict]:
    return [h for h in sup_state(state).get("history", []) if h["event"] == name]


def test_relaunch_with_backoff_until_the_breaker_opens_then_reset(tmp_path, lab, procs):
    state = tmp_path / "state"
    lab.start()
    sup = procs(supervisor(state, lab))
    wait_for(lambda: sup_state(state).get("state") == "running", 10, "supervisor sees it up")
    started = time.monotonic()
    wd = procs(
        # 5 samples x 0.2 s: longer than the lab service's start command (it waits for /health),
        # so a trip does not land inside a start on a loaded machine
        watchdog_cmd(
            state,
            "--avail-floor-mib",
            above_real_memory(),
            *lab.watchdog_args(),
            interval_s=0.2,
        )
    )
    wait_for(lambda: sup_state(state).get("state") == "breaker-open", 30, "the breaker")
    took = time.monotonic() - started
    # The marker is written before the stop; the breaker may open while the third stop runs.
    emergencies = wait_for(
        lambda: (
            [m for m in markers(state, "emergency") if m["stopped"] is not None]
            == (all_markers := markers(state, "emergency"))
            and all_markers
        ),
        20,
        "the third stop to finish",
    )
    assert isinstance(emergencies, list)
    assert len(emergencies) == 3 and all(m["stopped"] for m in emergencies)
    history = sup_state(state)["history"]
    # A relaunch attempt is a `relaunch`, or, where the watchdog stopped the service while its
    # start command still waited for /health (a loaded machine), a `down` that the emergency
    # explains, with the attempt's number and backoff.
    relaunches = [
        h for h in history if h["event"] == "relaunch" or (h["event"] == "down" and "attempt" in h)
    ]
    assert [r["attempt"] for r in relaunches] == [1, 2], f"relaunched twice only: {history}"
    assert all(r["event"] == "relaunch" or r["cause"] == "emergency" for r in relaunches), history
    # the backoff doubles, and no relaunch came before its backoff was over (the supervisor's
    # own record: no bound on how late a loaded machine lets it run)
    assert [r["backoff_s"] for r in relaunches] == [BASE, 2 * BASE], relaunches
    assert all(r["waited_s"] >= r["backoff_s"] for r in relaunches), relaunches
    assert events(state, "launch-failed") == [], "emergency stops are not launch failures"
    for marker, relaunch in zip(emergencies[1:], relaunches, strict=True):
        # a relaunched service gets the whole debounce: no sample from while it was down counts
        assert marker["readings"][0]["time"] >= relaunch["time"]
    assert len(events(state, "breaker-open")[0]["incidents"]) == 3

    # The breaker latches: nothing relaunches the service while it is open.
    time.sleep(2 * BASE)
    assert not lab.active()
    assert sup_state(state)["state"] == "breaker-open"
    shown = subprocess.run(
        program("supervisor", "status", "--state-dir", state),
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert shown.returncode == 0 and "supervisor: breaker-open" in shown.stdout
    assert "incidents in 24 h: 3" in shown.stdout

    # With the memory pressure gone (watchdog stopped), a reset relaunches after the first delay.
    wd.terminate()
    wd.wait(5)
    reset_at = time.time()
    subprocess.run(program("supervisor", "reset", "--state-dir", state), check=True, timeout=20)
    wait_for(lambda: sup_state(state).get("state") == "running", 10, "running after reset")
    assert lab.active()
    after = [r for r in events(state, "relaunch") if r["time"] >= reset_at]
    assert len(after) == 1 and after[0]["attempt"] == 1
    assert after[0]["backoff_s"] == BASE and after[0]["waited_s"] >= BASE, after
    print(f"three emergencies and the breaker in {took:.2f} s")
    assert "breaker-open" in output(sup)


def test_holds_after_repeated_launch_failures(tmp_path, lab, procs):
    state = tmp_path / "state"
    sup = procs(
        supervisor(state, lab, "--start-cmd", "false", "--hold-after", 3, "--backoff-base-s", 0.1)
    )
    wait_for(lambda: sup_state(state).get("state") == "hold", 10, "hold")
    failures = events(state, "launch-failed")
    assert [f["attempt"] for f in failures] == [1, 2, 3]
    assert [f["backoff_s"] for f in failures] == [0.1, 0.2, 0.4], failures  # doubling
    assert all(f["waited_s"] >= f["backoff_s"] for f in failures), failures
    assert sup_state(state)["hold_reason"] == "3 launches in a row failed"
    time.sleep(0.5)
    assert len(events(state, "launch-failed")) == 3, "no attempt while holding"
    assert sup.poll() is None


def test_a_start_failed_by_an_emergency_stop_is_not_a_launch_failure(tmp_path, lab, procs):
    """The watchdog may stop the service while its start command still runs: the start fails,
    but the marker says why, as it does for a service stopped after it came up."""
    state = tmp_path / "state"
    script = tmp_path / "start.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from sparkple.supervise.state import write_marker\n"
        f"write_marker(Path({str(state)!r}), 'emergency', time.time(), {{'reason': 'test'}})\n"
        "sys.exit(1)\n"
    )
    sup = procs(
        supervisor(
            state,
            lab,
            "--start-cmd",
            f"{sys.executable} {script}",
            "--hold-after",
            1,
            "--backoff-base-s",
            0.1,
            "--breaker-count",
            100,
        )  # fmt: skip
    )
    wait_for(lambda: len(events(state, "down")) >= 3, 15, "three explained failed starts")
    downs = [d for d in events(state, "down") if "attempt" in d]
    assert downs and all(d["cause"] == "emergency" and d["exit"] == 1 for d in downs)
    assert events(state, "launch-failed") == []
    assert sup_state(state)["state"] != "hold" and sup_state(state)["launch_failures"] == 0
    assert sup.poll() is None


def test_a_service_that_dies_right_after_launch_counts_as_a_failed_launch(tmp_path, procs):
    state = tmp_path / "state"
    pidfile = tmp_path / "pid"

    check = tmp_path / "is-active.sh"  # the pid is running and not yet reaped
    check.write_text(
        f'read -r pid < {pidfile} && read -r _ _ s _ < /proc/$pid/stat && [ "$s" != Z ]'
    )

    class Dying:
        @staticmethod
        def cmd(command: str) -> str:
            return {
                "is-active": f"sh {check}",
                # starts fine, exits 0.2 s later
                "start": f"sh -c 'sleep 0.2 >/dev/null 2>&1 & echo $! > {pidfile}'",
                "stop": "true",
            }[command]

    procs(supervisor(state, Dying, "--hold-after", 2, "--backoff-base-s", 0.1))
    wait_for(lambda: sup_state(state).get("state") == "hold", 15, "hold")
    failed = events(state, "launch-failed")
    assert len(failed) == 2 and all("exited_after_s" in f for f in failed)
    assert len(events(state, "relaunch")) == 2


def test_manual_stop_flag_is_respected(tmp_path, lab, procs):
    state = tmp_path / "state"
    subprocess.run(
        program("supervisor", "manual-stop", "--state-dir", state), check=True, timeout=20
    )
    procs(supervisor(state, lab, "--backoff-base-s", 0.1))
    wait_for(lambda: sup_state(state).get("state") == "manual-stop", 10, "manual-stop state")
    time.sleep(1.0)
    assert not lab.active() and events(state, "relaunch") == []
    subprocess.run(program("supervisor", "resume", "--state-dir", state), check=True, timeout=20)
    wait_for(lambda: sup_state(state).get("state") == "running", 10, "relaunch after resume")
    assert lab.active()


def relaunch(state: Path, lab, *extra) -> subprocess.CompletedProcess:
    """`supervisor relaunch` (the weekly drain and relaunch) of the lab service."""
    return subprocess.run(
        program(
            "supervisor", "relaunch",
            "--state-dir", state,
            "--check-cmd", lab.cmd("is-active"),
            "--start-cmd", lab.cmd("start"),
            "--stop-cmd", lab.cmd("stop"),
            *extra,
        ),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_maintenance_relaunch_drains_and_restarts_without_a_down_event(tmp_path, lab, procs):
    state = tmp_path / "state"
    lab.start()
    procs(supervisor(state, lab))
    wait_for(lambda: sup_state(state).get("state") == "running", 10, "running")
    before = lab.pid("front")
    done = relaunch(state, lab, "--drain-metrics-url", lab.url + "/metrics", "--drain-timeout-s", 5)
    assert done.returncode == 0, done.stdout + done.stderr
    assert lab.active() and lab.pid("front") != before
    relaunched = events(state, "maintenance-relaunch")
    assert len(relaunched) == 1 and relaunched[0]["drained"] is True
    time.sleep(0.5)
    assert events(state, "down") == [] and sup_state(state)["state"] == "running"


def test_markers_are_read_by_kind_and_time_oldest_first(tmp_path):
    state = tmp_path / "state"
    for kind, t in (("emergency", 1_000.0), ("emergency", 3_000.0), ("wedged", 2_000.0)):
        write_marker(state, kind, t, {"reason": f"{kind} at {t}"})
    (state / "markers" / "emergency-19700101T000000.000001Z.json").write_text("not json")
    (state / "markers" / "other-19700101T010000.000000Z.json").write_text('{"time": 5000}')
    found = read_markers(state, {"emergency", "wedged"}, 1_500.0)
    assert [(m["kind"], m["time"]) for m in found] == [("wedged", 2_000.0), ("emergency", 3_000.0)]
    assert count_markers(state, {"emergency", "wedged"}) == {"emergency": 3, "wedged": 1}


# ------------------------------------------------------------------ readiness and stability


def test_a_start_that_never_gets_healthy_is_stopped_counted_and_alerted(
    tmp_path, lab, procs, receiver, monkeypatch
):
    """The unit is up but /health never answers 200: past the readiness deadline the launch is
    stopped and counted (not taken for a stable service), and an alert goes out."""
    url, got = receiver
    monkeypatch.setenv("PLE_ALERT_URL", url)
    state = tmp_path / "state"
    flag = lab.dir / "health-fail"  # the start itself waits for /health: set it after
    broken_start = f'sh -c "rm -f {flag}; {lab.cmd("start")} && touch {flag}"'
    procs(
        supervisor(
            state,
            lab,
            "--start-cmd",
            broken_start,
            "--url",
            lab.url,
            "--ready-timeout-s",
            1,
            "--stable-s",
            0.2,
            "--hold-after",
            2,
            "--backoff-base-s",
            0.1,
        )  # fmt: skip
    )
    wait_for(lambda: sup_state(state).get("state") == "hold", 30, "hold")
    timeouts = events(state, "ready-timeout")
    assert len(timeouts) == 2 and all(t["after_s"] >= 1 and t["stop_exit"] == 0 for t in timeouts)
    assert events(state, "stable") == [] and events(state, "ready") == []
    assert sup_state(state)["launch_failures"] == 2 and not lab.active()
    wait_for(lambda: any(a["event"] == "not-ready" for a in got), 5, "the not-ready alert")


def test_stable_means_healthy_for_stable_s_not_merely_up(tmp_path, lab, procs):
    """A /health failure restarts the stable clock (healthy_since in the supervisor's state);
    "stable" comes stable_s after the new clock started, asserted on the supervisor's record."""
    stable_s = 3.0
    state = tmp_path / "state"
    procs(supervisor(state, lab, "--url", lab.url, "--stable-s", stable_s))
    wait_for(lambda: sup_state(state).get("healthy_since"), 15, "healthy (the clock runs)")
    first = sup_state(state)["healthy_since"]
    failed_at = time.time()
    (lab.dir / "health-fail").touch()  # up, but /health failing: the clock stops
    wait_for(lambda: sup_state(state).get("healthy_since") is None, 15, "the clock stopped")
    assert lab.active(), "up all along: only /health failed"
    assert events(state, "stable") == [], "the clock reached stable_s before /health failed"
    (lab.dir / "health-fail").unlink()
    wait_for(lambda: sup_state(state).get("healthy_since"), 15, "the clock runs again")
    second = sup_state(state)["healthy_since"]
    # a new clock, started by a poll after the one that saw /health fail (so after the
    # failure began), not the first one resumed
    assert second > failed_at > first
    (stable,) = wait_for(lambda: events(state, "stable"), 30, "stable")
    assert stable["time"] >= second + stable_s, (stable, second)
    st = sup_state(state)
    assert st["state"] == "running" and st["restarts"] == 0 and st["launch_failures"] == 0


# ------------------------------------------------------------------ shared memory


def test_leaked_shared_memory_is_removed_before_a_relaunch(tmp_path, lab, procs, shm_prefix):
    leaked = [SHM / f"{shm_prefix}psm_{i}" for i in range(3)]
    for seg in leaked:
        seg.write_bytes(b"\0" * 8192)
    state = tmp_path / "state"
    procs(supervisor(state, lab, "--shm-patterns", f"{shm_prefix}*"))
    # a bound for a hang, not a timing: a loaded machine starts the supervisor and the lab late
    wait_for(lambda: events(state, "relaunch"), 60, "the first launch")
    [cleaned] = events(state, "shm-cleaned")
    assert sorted(cleaned["removed"]) == sorted(map(str, leaked)) and cleaned["bytes"] == 3 * 8192
    assert not any(seg.exists() for seg in leaked)
    assert cleaned["time"] <= events(state, "relaunch")[0]["time"]


def test_shared_memory_a_live_process_holds_is_kept(tmp_path, lab, procs, shm_prefix):
    held, other = SHM / f"{shm_prefix}psm_held", SHM / f"{shm_prefix}psm_other"
    for seg in (held, other):
        seg.write_bytes(b"\0" * 4096)
    code = "import mmap,sys; f=open(sys.argv[1],'r+b'); m=mmap.mmap(f.fileno(),4096); "
    code += "print('holding',flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(held)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == b"holding"
        state = tmp_path / "state"
        procs(supervisor(state, lab, "--shm-patterns", f"{shm_prefix}*"))
        wait_for(lambda: events(state, "relaunch"), 60, "the launch")
        [kept] = events(state, "shm-held")
        assert kept["held"] == {str(held): [holder.pid]}
        assert held.exists() and other.exists(), "nothing removed while one is held"
        assert events(state, "shm-cleaned") == []
    finally:
        holder.stdin.close()
        holder.wait(10)


# ------------------------------------------------------------------ manual stop, smoke, heartbeat


def test_a_stop_under_the_manual_stop_flag_is_no_failure(tmp_path, lab, procs):
    """What a rollout does: set the flag, stop, switch, start, clear the flag."""
    state = tmp_path / "state"
    lab.start()
    procs(supervisor(state, lab, "--backoff-base-s", 0.1, "--url", lab.url))
    wait_for(lambda: sup_state(state).get("state") == "running", 10, "running")
    sup = ["supervisor"]
    subprocess.run(
        program(*sup, "manual-stop", "--state-dir", state, "--reason", "rollout"),
        check=True, timeout=20,
    )  # fmt: skip
    assert "by rollout" in (state / "manual-stop").read_text()
    since = time.time()
    subprocess.run(shlex.split(lab.cmd("stop")), check=True, timeout=20)
    time.sleep(1.0)  # ten backoff periods
    lab.start()
    subprocess.run(program(*sup, "resume", "--state-dir", state), check=True, timeout=20)
    wait_for(lambda: sup_state(state).get("state") == "running", 10, "running again")
    later = [h["event"] for h in sup_state(state)["history"] if h["time"] >= since]
    assert not {"down", "relaunch", "launch-failed", "ready-timeout"} & set(later), later


def test_a_rollback_is_recorded_as_one_incident_that_status_shows(tmp_path):
    """What a failed rollout leaves on the node that failed: one `rollback` marker, shown by
    status among the incidents of the last 24 h and counted by the metrics."""
    state = tmp_path / "state"
    reason = "release 0123abcd (B) rolled back: Start the new release: exit 1"
    out = subprocess.run(
        program("supervisor", "incident", "--state-dir", state, "--kind", "rollback",
                "--reason", reason),
        check=True, capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert Path(out.stdout.strip()).parent == state / "markers"
    shown = subprocess.run(
        program("supervisor", "status", "--state-dir", state, "--json"),
        check=True, capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    incidents = json.loads(shown.stdout)["incidents_24h"]
    assert [(m["kind"], m["reason"]) for m in incidents] == [("rollback", reason)]
    assert count_markers(state, {"rollback"}) == {"rollback": 1}
    refused = subprocess.run(
        program("supervisor", "incident", "--state-dir", state, "--kind", "emergency",
                "--reason", "x"),
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert refused.returncode == 2 and "invalid choice: 'emergency'" in refused.stderr


def test_maintenance_relaunch_ends_with_a_smoke_generation(tmp_path, lab, procs):
    state = tmp_path / "state"
    lab.start()
    procs(supervisor(state, lab))
    wait_for(lambda: sup_state(state).get("state") == "running", 10, "running")
    done = relaunch(state, lab, "--url", lab.url, "--ready-timeout-s", 10)
    assert done.returncode == 0, done.stdout + done.stderr
    [smoke] = events(state, "maintenance-smoke")
    assert smoke["ok"] is True and smoke["detail"].startswith("16 tokens"), smoke


def test_daily_heartbeat_carries_the_status_line_with_kernel_error_counts(
    tmp_path, lab, procs, receiver, monkeypatch
):
    url, got = receiver
    monkeypatch.setenv("PLE_ALERT_URL", url)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "6,1,100,-;NVRM: loading NVIDIA UNIX Open Kernel Module\n"
        "4,2,200,-;NVRM: Xid (PCI:000f:01:00): 31, pid=1234, name=python3, Ch 00000008\n"
        "4,3,300,-;NVRM: nvAssertOkFailedNoLog: Assertion failed: NV_ERR_NO_MEMORY\n"
        "4,4,400,-;NVRM: Xid (PCI:000f:01:00): 43, pid=1234, name=python3, Ch 00000008\n"
    )
    state = tmp_path / "state"
    lab.start()
    procs(supervisor(state, lab, "--heartbeat-s", 86400, "--kmsg", kmsg))
    beat = wait_for(lambda: [a for a in got if a["event"] == "heartbeat"], 10, "a heartbeat")
    assert "supervisor running" in beat[0]["text"], beat
    assert "Xid 2, NV_ERR_NO_MEMORY 1" in beat[0]["text"]
    time.sleep(0.5)
    assert len([a for a in got if a["event"] == "heartbeat"]) == 1, "once a day, not every poll"
    shown = subprocess.run(
        program("supervisor", "status", "--state-dir", state, "--kmsg", kmsg),
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert "kernel log: Xid 2, NV_ERR_NO_MEMORY 1" in shown.stdout, shown.stdout


def test_io_errors_on_the_tables_device_are_alerted_with_what_to_do(
    tmp_path, lab, procs, receiver, monkeypatch
):
    """A server down after new kernel I/O errors on the table's device: one alert saying to
    verify and rebuild the table, again only when more errors come; the status line counts them."""
    url, got = receiver
    monkeypatch.setenv("PLE_ALERT_URL", url)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "3,1,100,-;blk_update_request: I/O error, dev sdz, sector 2048 op 0x0:(READ) flags 0x0\n"
        "3,2,200,-;Buffer I/O error on dev sdz, logical block 256, async page read\n"
        "3,3,300,-;blk_update_request: I/O error, dev sda, sector 8 op 0x0:(READ) flags 0x0\n"
    )
    state = tmp_path / "state"
    table = tmp_path / "table"
    args: tuple[object, ...] = ("--kmsg", kmsg, "--table-dir", table, "--table-device", "sdz")
    args += ("--alert-min-interval-s", 0, "--hold-after", 10)
    procs(supervisor(state, lab, "--start-cmd", "false", *args))
    (alert,) = wait_for(
        lambda: [a for a in got if a["event"] == "table-io-errors"], 10, "the I/O error alert"
    )
    assert "logged 2 new I/O errors on sdz, the device of " + str(table) in alert["text"]
    assert f"Run `sparkple verify-table --full {table}` and rebuild the table" in alert["text"]
    # the supervisor goes on with its backoff; the same errors are not alerted again
    wait_for(lambda: len(events(state, "launch-failed")) >= 2, 30, "two failed launches")
    assert len([a for a in got if a["event"] == "table-io-errors"]) == 1
    with kmsg.open("a") as f:
        f.write("3,4,400,-;blk_update_request: I/O error, dev sdz, sector 4096 op 0x0:(READ)\n")
    again = wait_for(
        lambda: [a for a in got if a["event"] == "table-io-errors"][1:], 30, "a second alert"
    )
    assert "logged 1 new I/O errors on sdz" in again[0]["text"]
    shown = subprocess.run(
        program("supervisor", "status", "--state-dir", state, "--kmsg", kmsg),
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert "table I/O errors 3 (sdz)" in shown.stdout, shown.stdout
    assert [e["count"] for e in events(state, "table-io-errors")] == [2, 3]
