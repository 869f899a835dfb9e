"""A pair as one unit of service: two real supervisors (the head's leads, the worker's follows)
on 127.0.0.1, each serving its pair link on its own port, each managing a real process as its
serving unit (tests/ops/pair_units.py: an HTTP server whose /health answers 200)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from lab_inputs import free_port
from link_servers import RawServer, trickle
from ops_helpers import ROOT, above_real_memory, program, read_json, wait_for, watchdog_cmd

from sparkple.pair.pairlink import PAIR_FIELDS, PairLink
from sparkple.supervise.state import PAIR_BROKEN, SUPERVISOR_STATES, count_markers

UNITS = Path(__file__).with_name("pair_units.py")
BASE = 0.5  # backoff base (s)
READY_S = 10.0
KEY = b"lab-pair-key-0123456789abcdef"


class Node:
    """One Spark of the pair: its state dir, its unit, its link port."""

    def __init__(self, root: Path, role: str) -> None:
        self.role = role
        self.rank = 0 if role == "head" else 1
        self.host = f"spark-{role}"
        self.state = root / f"state-{role}"
        self.unit = root / role
        self.unit.mkdir(parents=True)
        self.port = free_port()
        (self.unit / "port").write_text(f"{self.port}\n")
        self.link = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = root / f"pair-{role}.key"  # the pair's shared key, as the role writes it
        self.key.write_bytes(KEY + b"\n")
        self.boot = root / f"run-{role}" / "supervisor-boot"  # /run's boot marker
        self.release = root / f"release-{role}.json"  # the current release.json
        self.set_release("r1")

    def set_release(self, release: str, patches: str = "p1") -> None:
        self.release.write_text(
            json.dumps({"id": release, "inputs": {"patch_manifest_sha256": patches}})
        )

    def cmd(self, command: str) -> str:
        return f"'{sys.executable}' -S '{UNITS}' {command} '{self.unit}'"

    def run_unit(self, command: str) -> int:
        words = [sys.executable, "-S", str(UNITS), command, str(self.unit)]
        return subprocess.run(words, timeout=60).returncode

    def active(self) -> bool:
        return self.run_unit("is-active") == 0

    def kill_unit(self) -> None:
        """What a crash does: SIGKILL, no stop command."""
        os.kill(int((self.unit / "pid").read_text()), signal.SIGKILL)

    def supervisor(self, peer: Node, *extra: object) -> list[str]:
        return program(
            "pair-supervisor", "run",
            "--state-dir", self.state,
            "--check-cmd", self.cmd("is-active"),
            "--start-cmd", self.cmd("start"),
            "--stop-cmd", self.cmd("stop"),
            "--poll-s", 0.2,
            "--backoff-base-s", BASE,
            "--backoff-cap-s", 30,
            "--stable-s", 60,
            "--ready-timeout-s", READY_S,
            "--shm-patterns", "",
            "--pair", "p1",
            "--pair-rank", self.rank,
            "--pair-host", self.host,
            "--pair-listen", f"127.0.0.1:{self.link}",
            "--pair-peer-url", f"http://127.0.0.1:{peer.link}",
            "--pair-peer-timeout-s", 2,
            "--pair-key-file", self.key,
            "--release-file", self.release,
            "--boot-marker", self.boot,
            *(("--url", self.url) if self.role == "head" else ()),
            *extra,
        )  # fmt: skip

    def st(self) -> dict:
        return read_json(self.state / "supervisor.json")

    def events(self, name: str, since: float = 0.0) -> list[dict]:
        history = self.st().get("history", [])
        return [h for h in history if h["event"] == name and h["time"] >= since]

    def side(self) -> dict:
        """Its /pair answer, read and verified as its peer reads it."""
        # read as its peer (the other rank of p1) reads it
        answer = PairLink(f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{self.link}", KEY,
                          pair="p1", rank=1 - self.rank).fetch()  # fmt: skip
        assert answer.side is not None, answer.error
        return answer.side

    def ops(self, *args: object) -> subprocess.CompletedProcess:
        return subprocess.run(
            program("pair-supervisor", *args, "--state-dir", self.state),
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip


@pytest.fixture
def pair(tmp_path):
    head, worker = Node(tmp_path, "head"), Node(tmp_path, "worker")
    yield head, worker
    for node in (head, worker):
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((node.unit / "pid").read_text()), signal.SIGKILL)


def starts(root: Path) -> list[str]:
    log = root / "starts.log"
    return log.read_text().split() if log.exists() else []


def running(head: Node) -> bool:
    st = head.st()
    return st.get("state") == "running" and bool(st.get("ready_at"))


def up_and_ready(head: Node, worker: Node, what: str, timeout_s: float = 30) -> None:
    wait_for(
        lambda: head.st().get("ready_at") and worker.st().get("state") == "running", timeout_s, what
    )


def test_the_worker_starts_first_and_a_killed_worker_stops_both_and_both_come_back(
    tmp_path, pair, procs
):
    head, worker = pair
    procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    assert starts(tmp_path) == ["worker", "head"], "the worker's unit starts first"
    [launch] = head.events("relaunch")
    [joined] = head.events("worker-joined")
    [started] = head.events("head-started")
    assert launch["generation"] == 1 and launch["time"] <= joined["time"] <= started["time"]
    assert worker.events("worker-started")[0]["generation"] == 1
    side = head.side()
    assert set(side) == set(worker.side()) == set(PAIR_FIELDS)
    assert side["want_worker"] is True and side["generation"] == 1 and side["unit_active"]
    assert worker.side()["generation"] == 1 and worker.side()["role"] == "worker"

    killed = time.time()
    worker.kill_unit()
    [broken] = wait_for(lambda: head.events("pair-broken"), 10, "the break")
    assert broken["cause"] == "worker-down" and broken["generation"] == 1
    [stopped] = wait_for(lambda: head.events("pair-stopped"), 10, "both stopped")
    assert not head.active() and not worker.active()
    # within the wait above (10 s): how soon is the scheduler's to say on a loaded machine
    assert stopped["time"] >= killed
    wait_for(lambda: len(head.events("ready")) == 2, 30, "both relaunched and the head healthy")
    assert starts(tmp_path) == ["worker", "head", "worker", "head"]
    [again] = head.events("relaunch", since=killed)
    # the second launch of the streak (the first was not yet stable): base x 2
    assert again["generation"] == 2 and again["backoff_s"] == 2 * BASE
    assert again["waited_s"] >= 2 * BASE and again["time"] >= stopped["time"]
    ready = head.events("ready")[-1]
    assert head.active() and worker.active() and head.st()["state"] == "running"
    # one incident for the pair, counted by its head's breaker; the worker counts nothing
    assert count_markers(head.state, {PAIR_BROKEN}) == {PAIR_BROKEN: 1}
    assert not (worker.state / "markers").exists()
    assert head.events("launch-failed") == [] and head.st()["launch_failures"] == 0
    print(
        f"worker killed: both stopped in {stopped['time'] - killed:.1f} s, "
        f"healthy again in {ready['time'] - killed:.1f} s, 1 incident"
    )

    shown = head.ops("status", "--json")
    rep = json.loads(shown.stdout)
    assert rep["pair"]["name"] == "p1" and rep["pair"]["role"] == "head"
    assert rep["pair"]["peer"] == "spark-worker" and rep["pair"]["peer_reachable"]
    assert rep["pair"]["generation"] == 2 and rep["pair"]["peer_generation"] == 2
    assert [m["kind"] for m in rep["incidents_24h"]] == [PAIR_BROKEN]
    text = worker.ops("status").stdout
    assert re.search(r"pair p1: worker spark-worker, peer spark-head reachable \(unit active", text)
    assert "generation 2" in text, text


def test_a_killed_head_stops_the_worker_and_both_come_back(tmp_path, pair, procs):
    head, worker = pair
    procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    killed = time.time()
    head.kill_unit()
    [broken] = wait_for(lambda: head.events("pair-broken"), 10, "the break")
    assert broken["cause"] == "head-down"
    [stopped] = wait_for(lambda: head.events("pair-stopped"), 10, "the worker stopped")
    # within the wait above (10 s); how soon is the scheduler's to say on a loaded machine
    assert stopped["worker"] == "stopped" and stopped["time"] >= killed
    [why] = worker.events("worker-stopped")
    assert why["reason"] == "head-does-not-want-it" and why["exit"] == 0
    wait_for(lambda: len(head.events("ready")) == 2, 30, "both relaunched")
    assert starts(tmp_path) == ["worker", "head", "worker", "head"]
    assert head.active() and worker.active()
    assert count_markers(head.state, {PAIR_BROKEN}) == {PAIR_BROKEN: 1}


def test_a_worker_that_never_joins_fails_the_launch_within_the_readiness_deadline(
    tmp_path, pair, procs
):
    """No worker supervisor answers: the head's unit is never started, the launch fails at the
    readiness deadline, counted once, and nothing of the pair runs."""
    head, worker = pair
    procs(head.supervisor(worker, "--ready-timeout-s", 2, "--hold-after", 1))
    wait_for(lambda: head.st().get("state") == "hold", 20, "the failed launch")
    [timeout] = head.events("ready-timeout")
    assert timeout["worker"] == "never joined" and 2 <= timeout["after_s"] < 5
    assert head.st()["launch_failures"] == 1
    # the check publishes its side on the link just after it saved the state: read it then
    wait_for(lambda: head.side()["want_worker"] is False, 10, "the head's side to drop the worker")
    assert starts(tmp_path) == [] and not head.active()


def test_a_worker_whose_start_fails_fails_the_launch_at_once(tmp_path, pair, procs):
    head, worker = pair
    procs(worker.supervisor(head, "--start-cmd", "false"))
    procs(head.supervisor(worker, "--hold-after", 2))
    wait_for(lambda: head.st().get("state") == "hold", 20, "two failed launches")
    failed = head.events("launch-failed")
    assert [(f["side"], f["start_exit"], f["generation"]) for f in failed] == [
        ("worker", 1, 1),
        ("worker", 1, 2),
    ]
    assert head.events("ready-timeout") == [] and starts(tmp_path) == []
    # the worker started once per launch, never again for the same one
    assert [s["generation"] for s in worker.events("worker-started")] == [1, 2]


def test_a_manual_stop_is_hands_off_and_resume_adopts_the_running_pair(tmp_path, pair, procs):
    """What a pair's rollout does: the flag on both, stop the head then the worker, start the
    worker then the head, clear both flags: nothing is relaunched, the pair is adopted."""
    head, worker = pair
    procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    since = time.time()
    head.ops("manual-stop", "--reason", "rollout")
    wait_for(lambda: worker.st().get("state") == "manual-stop", 10, "the worker hands off too")
    # the head's flag alone: the worker's supervisor leaves its stopped unit alone
    assert worker.run_unit("stop") == 0
    time.sleep(1.0)
    assert not worker.active() and worker.events("worker-started", since) == []
    worker.ops("manual-stop", "--reason", "rollout")
    assert head.run_unit("stop") == 0
    time.sleep(1.0)
    assert worker.run_unit("start") == 0 and head.run_unit("start") == 0
    head.ops("resume")
    time.sleep(1.0)
    assert head.st()["state"] == "manual-stop", "the worker's flag is still set"
    worker.ops("resume")
    [adopted] = wait_for(lambda: head.events("adopted", since), 10, "the pair adopted")
    assert adopted["generation"] == 1
    wait_for(lambda: running(head) and head.events("ready", since), 10, "running again")
    assert worker.st()["state"] == "running"
    time.sleep(1.0)
    for node, names in (
        (head, {"relaunch", "pair-broken", "launch-failed", "ready-timeout", "half-pair-stopped"}),
        (worker, {"worker-started", "worker-stopped"}),
    ):
        later = [h["event"] for h in node.st()["history"] if h["time"] >= since]
        assert not names & set(later), later
    assert starts(tmp_path) == ["worker", "head", "worker", "head"]  # the rollout's starts only
    assert head.side()["generation"] == worker.side()["generation"] == 1


def test_emergency_stops_on_the_worker_count_once_each_until_the_breaker_opens(
    tmp_path, pair, procs
):
    """The real watchdog on the worker's node (floor above this machine's memory) stops the
    worker's unit each time it runs: each stop is one pair incident, explained by the worker's
    emergency marker, and the head's breaker opens at its count with both units stopped."""
    head, worker = pair
    procs(worker.supervisor(head))
    procs(head.supervisor(worker, "--breaker-count", 2))
    up_and_ready(head, worker, "the pair launched")
    procs(
        watchdog_cmd(
            worker.state,
            "--avail-floor-mib",
            above_real_memory(),
            "--running-cmd",
            worker.cmd("is-active"),
            "--stop-cmd",
            worker.cmd("stop"),
            "--logs-cmd",
            "true",
            interval_s=0.2,
        )  # fmt: skip
    )
    wait_for(lambda: head.st().get("state") == "breaker-open", 60, "the breaker")
    broken = head.events("pair-broken")
    assert len(broken) == 2
    assert all(b["explained_by"] == ["emergency on spark-worker"] for b in broken), broken
    assert count_markers(head.state, {PAIR_BROKEN}) == {PAIR_BROKEN: 2}
    assert len(head.events("breaker-open")[0]["incidents"]) == 2
    wait_for(lambda: not head.active() and not worker.active(), 10, "both stopped")
    time.sleep(1.0)
    assert not head.active() and not worker.active(), "nothing relaunched while it is open"


def test_pair_flags_are_checked():
    bad = subprocess.run(
        program("pair-supervisor", "run", "--state-dir", "/nonexistent", "--pair-rank", "0"),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 2 and "--pair-listen '': use ADDRESS:PORT" in bad.stderr
    bad = subprocess.run(
        program(
            "pair-supervisor", "run", "--state-dir", "/nonexistent", "--pair-rank", "1",
            "--pair-listen", "127.0.0.1:8470",
        ),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 2 and "--pair-rank needs --pair NAME and --pair-peer-url" in bad.stderr


def test_every_state_the_pair_supervisors_write_has_a_gauge():
    source = "".join(
        (ROOT / "sparkple" / "pair" / name).read_text()
        for name in ("member.py", "leader.py", "follower.py")
    )
    written = set(re.findall(r"""(?:state=|"state": |\["state"\] = )"([a-z-]+)\"""", source))
    assert {"standby", "launched", "starting"} <= written
    assert written <= set(SUPERVISOR_STATES)


def test_the_weekly_relaunch_on_the_head_relaunches_both_worker_first_without_an_incident(
    tmp_path, pair, procs
):
    head, worker = pair
    procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    since = time.time()
    # the loop's flags (after "run"), without the smoke generation (the stand-in has no API)
    loop_flags = [*head.supervisor(worker)[4:], "--url", ""]
    done = subprocess.run(
        [*program("pair-supervisor", "relaunch"), *loop_flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert head.events("maintenance-relaunch", since)[0]["stop_exit"] == 0
    wait_for(lambda: running(head) and head.events("ready", since), 20, "both relaunched")
    assert starts(tmp_path) == ["worker", "head", "worker", "head"]
    [relaunched] = head.events("relaunch", since)
    assert relaunched["generation"] == 2 and relaunched["backoff_s"] == 0
    assert head.events("pair-broken") == [] and not (head.state / "markers").exists()
    skipped = subprocess.run(
        [*program("pair-supervisor", "relaunch"), *worker.supervisor(head)[4:]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert skipped.returncode == 0 and "the head's relaunch relaunches the pair" in skipped.stdout


def test_a_reset_without_the_pair_flags_keeps_the_pairs_state(tmp_path, pair, procs):
    """`sparkple-ops reset` passes the state dir alone: the head's generation survives it, so
    the next launch is a new one for the worker too."""
    head, worker = pair
    procs(worker.supervisor(head))
    sup = procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    sup.terminate()
    sup.wait(10)
    head.ops("reset")
    assert head.st()["pair"]["generation"] == 1 and head.st()["state"] == "reset"


def test_an_unreachable_peer_supervisor_alone_never_stops_a_serving_pair(tmp_path, pair, procs):
    """Either supervisor killed (its node's unit left running): past --pair-peer-timeout-s the
    other side still has evidence its engine serves (head: unit active and /health 200;
    worker: unit active), so nothing is stopped; each records it once for an operator."""
    head, worker = pair
    worker_sup = procs(worker.supervisor(head))
    head_sup = procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    since = time.time()
    worker_sup.kill()
    worker_sup.wait(10)
    [alone] = wait_for(lambda: head.events("peer-unreachable-serving", since), 10, "the note")
    assert alone["evidence"] == "head unit active and its API /health 200"
    time.sleep(2.0)  # well past the 2 s bound
    assert head.active() and worker.active()
    assert head.events("pair-broken") == [] and head.st()["state"] == "running"
    assert len(head.events("peer-unreachable-serving")) == 1, "recorded once per outage"
    shown = json.loads(head.ops("status", "--json").stdout)["pair"]
    assert shown["peer_unreachable_serving_since"] == alone["time"] and not shown["peer_reachable"]

    # the worker's supervisor back: the running pair goes on, nothing is relaunched
    procs(worker.supervisor(head))
    wait_for(lambda: head.events("peer-reachable", since), 10, "the worker's supervisor back")
    assert head.st()["pair"].get("peer_unreachable_since") is None

    since = time.time()
    head_sup.kill()
    head_sup.wait(10)
    [alone] = wait_for(lambda: worker.events("peer-unreachable-serving", since), 10, "the note")
    assert alone["evidence"] == "worker unit active"
    time.sleep(2.0)
    # since the head's supervisor died (a loaded machine may have relaunched the pair while it
    # first came up: those stops are the launch's, not this outage's)
    assert worker.active() and head.active() and worker.events("worker-stopped", since) == []
    assert starts(tmp_path) == ["worker", "head"], "never stopped, never relaunched"


def test_a_lost_worker_supervisor_and_a_failing_head_health_break_the_pair(tmp_path, pair, procs):
    """Evidence the engine is down (the head's /health fails) while the worker's supervisor is
    unreachable: the pair is broken as before."""
    head, worker = pair
    worker_sup = procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    (head.unit / "www" / "health").unlink()  # the head's API answers 404 now
    worker_sup.kill()
    worker_sup.wait(10)
    [broken] = wait_for(lambda: head.events("pair-broken"), 15, "the break")
    assert broken["cause"] == "worker-unreachable" and not head.active()
    assert head.events("peer-unreachable-serving") == []


def test_a_starting_supervisor_answers_starting_and_its_peer_waits(tmp_path, pair, procs):
    """A worker supervisor restarted with a slow first check (longer than the peer bound):
    meanwhile it answers "starting" with who it is, the head reads it as reachable and not yet
    checked, and decides nothing on it."""
    head, worker = pair
    worker_sup = procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    worker_sup.terminate()
    worker_sup.wait(10)
    (worker.unit / "pause-once").write_text("5")
    since = time.time()
    procs(worker.supervisor(head))
    side = wait_for(lambda: _side_or_none(worker), 10, "the worker's link")
    assert side is not None
    assert side["state"] == "starting" and side["updated"] is None
    assert (side["pair"], side["host"], side["rank"], side["role"]) == (
        "p1", "spark-worker", 1, "worker",
    )  # fmt: skip
    assert side["unit_active"] is None and side["generation"] is None
    wait_for(lambda: head.st()["pair"]["peer"].get("state") == "starting", 5, "the head reads it")
    read_starting = time.time()
    assert head.st()["pair"]["peer"]["reachable"] is True
    wait_for(lambda: (worker.unit / "pause-once").exists() is False, 10, "the slow check")
    wait_for(lambda: worker.side()["state"] == "running", 10, "the worker's first check")
    history = head.st()["history"]
    # until the new supervisor listens, the head may find no one (on a loaded machine a Python
    # start outlasts a poll): that is recorded, and decides nothing
    later = {h["event"] for h in history if h["time"] >= since}
    assert not later & {"peer-mismatch", "pair-broken", "relaunch"}, later
    # once it answers "starting", it is reachable throughout its slow first check
    answering = {h["event"] for h in history if h["time"] >= read_starting}
    assert "peer-unreachable" not in answering, answering
    assert head.active() and worker.active() and starts(tmp_path) == ["worker", "head"]


def _side_or_none(node: Node) -> dict | None:
    try:
        return node.side()
    except (AssertionError, OSError):
        return None


def test_a_peer_with_another_key_is_not_the_peer(tmp_path, pair, procs):
    """The worker's supervisor holds another key: each side reads the other's answers as not
    the peer's (a wrong MAC), and the worker never starts its unit for the head."""
    head, worker = pair
    worker.key.write_bytes(b"another-pair-key-fedcba9876543210\n")
    procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    for node in (head, worker):
        [bad] = wait_for(partial(node.events, "peer-mismatch"), 10, "the refusal")
        assert "wrong MAC" in bad["error"] and "serving_supervisor_pair_key" in bad["error"]
    wait_for(lambda: head.events("relaunch"), 10, "the head's launch")
    time.sleep(1.5)
    assert worker.events("worker-started") == [] and starts(tmp_path) == []
    assert head.st()["pair"]["peer"]["reachable"] is False


def test_a_supervisor_reading_a_trickling_peer_keeps_checking(pair, procs):
    """A host on the link that answers one byte every 0.5 s: each read ends at its deadline
    (2 s in all), so the loop goes on checking (on the old reader, a deadline per recv, the
    first check never ended)."""
    head, _ = pair
    with RawServer(trickle) as server:
        procs(head.supervisor(SimpleNamespace(link=server.port)))
        wait_for(lambda: head.st().get("updated"), 10, "the first check")
        first = head.st()["updated"]
        time.sleep(6.0)
        assert head.st()["updated"] - first >= 3.0, "the loop was stalled by the answer"
        assert server.requests >= 3 and head.st()["pair"]["peer"]["reachable"] is False


def test_a_pair_supervisor_without_its_key_refuses_to_start(tmp_path, pair):
    head, worker = pair
    argv = head.supervisor(worker)
    i = argv.index("--pair-key-file")
    bad = subprocess.run(
        argv[:i] + argv[i + 2 :], capture_output=True, text=True, timeout=30
    )  # fmt: skip
    assert bad.returncode == 2
    assert "spark-head: --pair-rank needs --pair-key-file" in bad.stderr
    assert "serving_supervisor_pair_key" in bad.stderr
    head.key.write_text("\n")
    bad = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "has 0 bytes, fewer than 16" in bad.stderr


def test_a_pair_of_two_releases_is_never_launched_until_they_agree(tmp_path, pair, procs):
    """The pair runs release r1; the worker's node moves to r2 (a rollout half done) and its
    unit dies: the head breaks the pair and then neither side launches into the mixed pair,
    both naming both releases, until the worker is back on r1."""
    head, worker = pair
    procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    assert (head.side()["release"], head.side()["patch_manifest_sha256"]) == ("r1", "p1")
    assert worker.side()["release"] == "r1"

    worker.set_release("r2", "p2")
    for node in (head, worker):
        [mixed] = wait_for(partial(node.events, "release-mismatch"), 10, "the mismatch")
        assert {mixed["release"], mixed["peer_release"]} == {"r1", "r2"}
        assert "r1" in mixed["note"] and "r2" in mixed["note"] and "roll it back" in mixed["note"]
    assert head.active() and worker.active(), "a serving pair is not stopped for it"

    since = time.time()
    worker.kill_unit()
    wait_for(lambda: head.events("pair-broken", since), 10, "the break")
    wait_for(lambda: head.st()["state"] == "mixed-release", 10, "the head holds")
    time.sleep(3 * BASE + 1.0)  # past the backoff: a launch would have come by now
    assert head.events("relaunch", since) == [] and worker.events("worker-started", since) == []
    assert starts(tmp_path) == ["worker", "head"] and not head.active()
    assert head.st()["state"] == "mixed-release"
    text = head.ops("status").stdout
    assert "MIXED RELEASES: r1 here, r2 on the peer" in text, text
    assert len(head.events("release-mismatch")) == 1, "recorded once"

    worker.set_release("r1", "p1")  # rolled back
    wait_for(lambda: head.events("release-agreed", since), 10, "the releases agree")
    wait_for(lambda: running(head) and head.events("ready", since), 20, "the pair relaunched")
    assert starts(tmp_path) == ["worker", "head", "worker", "head"]


def test_a_worker_refuses_a_head_of_another_release(tmp_path, pair, procs):
    """From the start: the head on r1, the worker on r1 with other patches: nothing starts."""
    head, worker = pair
    worker.set_release("r1", "p-other")
    procs(worker.supervisor(head))
    procs(head.supervisor(worker))
    [mixed] = wait_for(lambda: worker.events("release-mismatch"), 10, "the worker's refusal")
    assert mixed["patch_manifest_sha256"] == "p-other"
    assert mixed["peer_patch_manifest_sha256"] == "p1"
    wait_for(lambda: head.st().get("state") == "mixed-release", 10, "the head holds")
    held = time.time()
    time.sleep(2.0)
    assert starts(tmp_path) == [] and head.events("relaunch", held) == []
    assert worker.events("worker-started") == [] and head.st()["state"] == "mixed-release"


def test_after_a_power_cycle_the_pair_starts_in_its_order_without_an_incident(
    tmp_path, pair, procs
):
    """Both nodes lose power (supervisors and units gone at once) and boot (a new boot id);
    neither unit starts by itself (a pair node's unit is not enabled at boot). The head's
    supervisor comes back first: it launches the pair at once, worker first, with the
    readiness deadline, and counts no incident; a worker supervisor that comes up later
    still joins before the head's unit starts."""
    head, worker = pair
    worker_sup = procs(worker.supervisor(head))
    head_sup = procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    # a supervisor restarted within the same boot finds its boot's marker: nothing happens
    restarted = time.time()
    head_sup.kill()
    head_sup.wait(10)
    head_sup = procs(head.supervisor(worker))
    wait_for(lambda: head.st()["updated"] > restarted + 1.0, 10, "checks after the restart")
    assert head.events("boot") == [] and head.events("pair-broken") == []
    assert head.active() and worker.active()
    for sup in (head_sup, worker_sup):
        sup.kill()
        sup.wait(10)
    head.kill_unit()
    worker.kill_unit()
    before = head.boot.read_text()
    head.boot.unlink()  # /run is emptied at boot (the head's supervisor alone keeps a marker)
    since = time.time()
    procs(head.supervisor(worker))
    [boot] = wait_for(lambda: head.events("boot", since), 10, "the boot seen")
    assert boot["pair_was_up"] is True and head.boot.read_text() != before
    [launch] = wait_for(lambda: head.events("relaunch", since), 10, "the launch after the boot")
    assert launch["generation"] == 2 and launch["backoff_s"] == 0
    time.sleep(1.5)  # the worker's node is slower to boot
    assert not head.active(), "the head's unit waits for its worker"
    procs(worker.supervisor(head))
    wait_for(lambda: running(head) and head.events("ready", since), 20, "the pair serving")
    assert starts(tmp_path) == ["worker", "head", "worker", "head"]
    assert head.events("pair-broken") == [] and not (head.state / "markers").exists()
    assert head.events("launch-failed") == [] and head.events("ready-timeout") == []


def test_a_supervisor_told_to_stop_mid_check_starts_nothing(tmp_path, pair, procs):
    """A reboot of both nodes, one after the other (the head first): the head's supervisor,
    booted, launches a new generation while the worker's node is going down. The worker's
    supervisor, stopping its old generation's unit when SIGTERM arrives, starts nothing more (on
    a node shutting down that start fails, and its failure, saved, was read after the worker's
    boot as the launch's: a `launch-failed` and a backoff in every power cycle of the lab pair).
    After its boot the pair launches at once, without a failure."""
    head, worker = pair
    worker_sup = procs(worker.supervisor(head))
    head_sup = procs(head.supervisor(worker))
    up_and_ready(head, worker, "the pair launched")
    head_sup.kill()
    head_sup.wait(10)
    head.kill_unit()
    head.boot.unlink()
    (worker.unit / "slow-stop").write_text("2")
    since = time.time()
    procs(head.supervisor(worker))
    wait_for(lambda: (worker.unit / "stopping").exists(), 20, "the worker stopping generation 1")
    worker_sup.terminate()  # SIGTERM, as systemd stops the unit at shutdown
    assert worker_sup.wait(20) == 0
    [stopped] = worker.events("worker-stopped", since)
    assert stopped["reason"] == "generation-moved-on"
    assert worker.events("worker-started", since) == [], "a start after SIGTERM"
    assert worker.st()["pair"]["generation"] == 1 and not worker.active()
    # its boot: a new supervisor (the marker gone with /run)
    (worker.unit / "slow-stop").unlink()
    worker.boot.unlink(missing_ok=True)
    procs(worker.supervisor(head))
    wait_for(lambda: running(head) and head.events("ready", since), 20, "the pair serving")
    assert [s["generation"] for s in worker.events("worker-started", since)] == [2]
    assert head.events("launch-failed", since) == [] and head.events("pair-broken") == []
