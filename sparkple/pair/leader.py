"""The head's supervisor of a pair: it leads (sparkple.pair.member says how a pair is supervised).

It owns backoff, hold and breaker for the pair: a launch is a new generation with the worker
wanted, the head's unit starts once the worker reports its unit active for it, and a break of
either unit stops the head, writes one pair-broken marker and relaunches both after the backoff.
"""

from __future__ import annotations

import argparse
import secrets
import time
from pathlib import Path
from typing import Any

from ..atomicfile import write_text
from ..supervise.commands import run_command
from ..supervise.state import INCIDENT_KINDS, PAIR_BROKEN, read_markers, write_marker
from .member import PairMember


class PairLeader(PairMember):
    """The head's supervisor: launches, watches and relaunches the pair, counting it once."""

    pair_role = "head"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.kinds = {PAIR_BROKEN}  # each break once, whatever caused it, on either node

    def fresh_pair(self) -> dict[str, Any]:
        return {
            **super().fresh_pair(),
            "generation": 0,
            "want_worker": None,  # None: not decided since this state began; the worker waits
            "head_started": False,
            "up": False,
            "up_since": None,
            "stopping_since": None,
        }

    def step(self, st: dict[str, Any], now: float) -> None:
        self.observe(st, now)
        pair = st["pair"]
        self.after_boot(st, now)
        if self.hands_off_pair(st, now):
            # the units are the operator's now: afterwards the pair is adopted or relaunched
            pair.update(up=False, head_started=False, stopping_since=None)
            return
        if self.latched(st, now):
            pair["want_worker"] = False
            return
        if st["launch_at"] is not None and not pair["head_started"]:
            self.await_worker(st, now)
            return
        worker = self.worker_state(st, now)
        head = self.unit_active
        if pair["up"]:
            if not head or worker == "down":
                self.break_pair(st, now, worker)
                return
            if worker == "lost" and not self.head_serves(st, now):
                self.break_pair(st, now, worker)
                return
            st.update(down_since=None, next_attempt_at=None)
            if st["launch_at"] is None:
                st["state"] = "running"
            elif not self.watch_launch(st, now):
                # missed the readiness deadline: watch_launch stopped the head and counted it
                pair.update(want_worker=False, up=False, head_started=False, stopping_since=now)
                self.after_failure(st, now)
            return
        if head:
            if self.adopt(st, now):
                return
            if worker == "unknown":
                st["state"] = "starting"  # the worker's side is not known yet
                return
            # a head without its worker (started by hand, or left by a state that was lost)
            stop = run_command(self.args.stop_cmd, self.values, timeout_s=self.args.stop_timeout_s)
            self.unit_active = self.running()
            self.record(st, now, "half-pair-stopped", worker=worker, stop_exit=stop.returncode)
        self.pair_down(st, now)

    def head_serves(self, st: dict[str, Any], now: float) -> bool:
        """The worker's supervisor is lost and the head's unit is active: True while that alone
        is no reason to stop. During a launch the readiness deadline decides; after it the
        head's API /health must answer 200 (a head whose worker died fails its steps, and then
        /health): evidence that the engine, both ranks, serves."""
        if st["launch_at"] is not None and st["ready_at"] is None:
            self.serving_alone(st, now, "head unit active, launch within its readiness deadline")
            return True
        if not self.healthy():
            return False
        self.serving_alone(st, now, "head unit active and its API /health 200")
        return True

    def after_boot(self, st: dict[str, Any], now: float) -> None:
        """The first check after this node booted (its boot marker in /run, a tmpfs cleared at
        every boot, is new): the pair that ran before is gone with the boot, not broken: no
        incident. Neither unit starts at boot by itself
        (a pair node's serving unit is not enabled); this launches the pair at once, in its
        order (worker first), with the readiness deadline."""
        boot = boot_token(self.args.boot_marker)
        pair = st["pair"]
        before = pair.get("boot")
        pair["boot"] = boot
        if before is None or boot is None or before == boot:
            return
        was_up = bool(pair["up"])
        pair.update(up=False, head_started=False, want_worker=False, stopping_since=None)
        st.update(launch_at=None, ready_at=None, healthy_since=None)
        st.update(down_since=now, next_attempt_at=now, restarts=0)
        self.record(st, now, "boot", pair_was_up=was_up, generation=pair["generation"])

    def worker_state(self, st: dict[str, Any], now: float) -> str:
        """up: its unit runs for this generation; down; unknown: unreachable for now, or its
        supervisor has not finished its first check; lost: unreachable past the bound."""
        if self.peer is None:
            return "lost" if self.peer_lost(st, now) else "unknown"
        if not self.peer_checked():
            return "unknown"
        mine = self.peer.get("generation")
        if self.peer.get("unit_active") and mine in (None, st["pair"]["generation"]):
            return "up"
        return "down"

    def adopt(self, st: dict[str, Any], now: float) -> bool:
        """Both units run but this supervisor did not launch them (after a manual stop, a
        restart with a fresh state): take the pair over, watched to readiness, no relaunch."""
        pair, peer = st["pair"], self.peer
        if peer is None or not self.peer_checked() or not peer.get("unit_active"):
            return False
        theirs = peer.get("generation")
        if theirs is not None and theirs < pair["generation"]:
            return False  # a worker of an older launch: its head is gone
        pair["generation"] = max(pair["generation"], theirs or 0)
        pair.update(want_worker=True, head_started=True, up=True, up_since=now)
        pair["stopping_since"] = None
        st.update(state="launched", launch_at=now, ready_at=None, healthy_since=None)
        st.update(down_since=None, next_attempt_at=None)
        self.record(st, now, "adopted", generation=pair["generation"], worker=peer.get("host"))
        return True

    def await_worker(self, st: dict[str, Any], now: float) -> None:
        """A launch before the head's start: the worker must report its unit active for this
        generation within the readiness deadline."""
        pair, peer = st["pair"], self.peer
        after = round(now - st["launch_at"], 1)
        if self.mixed:
            # the worker refuses too; nothing was started, nothing is counted: hold off
            pair.update(want_worker=False, up=False, head_started=False, stopping_since=now)
            st.update(launch_at=None, ready_at=None, healthy_since=None)
            self.refuse_mixed(st, now)
            st.update(down_since=now, next_attempt_at=now)
            return
        if peer is not None and peer.get("generation") == pair["generation"]:
            if not peer.get("unit_active"):  # its start failed, or it exited already
                self.launch_failed(
                    st, now, "launch-failed", side="worker", start_exit=peer.get("start_exit")
                )
                return
            if self.going_down():
                return
            self.record(st, now, "worker-joined", after_s=after, worker=peer.get("host"))
            start = run_command(
                self.args.start_cmd, self.values, timeout_s=self.args.start_timeout_s
            )
            self.unit_active = self.running()
            if not start.ok:
                self.launch_failed(
                    st, now, "launch-failed", side="head", exit=start.returncode,
                    stderr=start.stderr[-500:],
                )  # fmt: skip
                return
            pair.update(head_started=True, up=True, up_since=now)
            self.record(st, time.time(), "head-started", after_s=round(time.time() - now, 1))
            st["state"] = "launched"
            return
        if now - st["launch_at"] < self.args.ready_timeout_s:
            st["state"] = "launched"
            return
        self.launch_failed(st, now, "ready-timeout", after_s=after, worker="never joined")
        self.alerter.send(
            "not-ready",
            f"pair {self.args.pair}: the worker did not join within "
            f"{self.args.ready_timeout_s:g} s of the launch; will relaunch after the backoff",
            {"after_s": after, "launch_failures": st["launch_failures"]},
        )

    def launch_failed(self, st: dict[str, Any], now: float, event: str, **details: Any) -> None:
        """Stop both (the head's unit if it came up, the worker's by dropping want_worker),
        count the launch once, back off."""
        if self.unit_active:
            run_command(self.args.stop_cmd, self.values, timeout_s=self.args.stop_timeout_s)
            self.unit_active = self.running()
        st["launch_failures"] += 1
        self.record(st, now, event, generation=st["pair"]["generation"], **details)
        st["pair"].update(want_worker=False, up=False, head_started=False, stopping_since=now)
        st.update(launch_at=None, ready_at=None, healthy_since=None)
        self.after_failure(st, now)

    def after_failure(self, st: dict[str, Any], now: float) -> None:
        st.update(down_since=now, next_attempt_at=now + self.delay(st["restarts"]))
        if not self.hold_if_exhausted(st, now):
            st["state"] = "backoff"

    def break_pair(self, st: dict[str, Any], now: float, worker: str) -> None:
        """One side of a running pair is gone: stop the other at once, record one incident."""
        pair = st["pair"]
        head = self.unit_active
        if head:
            cause = "worker-down" if worker == "down" else "worker-unreachable"
        else:
            cause = "both-down" if worker == "down" else "head-down"
        stop_exit = None
        if head:
            stop = run_command(self.args.stop_cmd, self.values, timeout_s=self.args.stop_timeout_s)
            stop_exit = stop.returncode
            self.unit_active = self.running()
        since = float(pair["up_since"] or now)
        # A marker explains the first break after it. The watchdog stamps its marker with the
        # sample that tripped it, which can precede the relaunch that the stop then ends: so
        # the markers since the previous break count, not only those since the pair came up.
        breaks = [h["time"] for h in st["history"] if h["event"] == "pair-broken"]
        explain_from = min(since, breaks[-1]) if breaks else since
        explained = [
            f"{m['kind']} on {self.args.pair_host}"
            for m in read_markers(self.state_dir, INCIDENT_KINDS - {PAIR_BROKEN}, explain_from)
        ] + [
            f"{m.get('kind')} on {(self.peer or {}).get('host')}"
            for m in (self.peer or {}).get("incidents") or []
            if isinstance(m, dict) and float(m.get("time") or 0) >= explain_from
        ]
        worker_host = pair["peer"].get("host")
        reason = (
            f"pair {self.args.pair}: {cause} (head {self.args.pair_host}, worker {worker_host})"
        )
        marker = write_marker(
            self.state_dir,
            PAIR_BROKEN,
            now,
            {"reason": reason, "cause": cause, "generation": pair["generation"],
             "head": self.args.pair_host, "worker": worker_host, "explained_by": explained},
        )  # fmt: skip
        self.record(
            st, now, "pair-broken", cause=cause, generation=pair["generation"],
            after_s=round(now - since, 1), explained_by=explained, stop_exit=stop_exit,
            marker=str(marker),
        )  # fmt: skip
        self.alerter.send("pair-broken", f"{reason}; stopped both, relaunching after the backoff")
        pair.update(want_worker=False, up=False, head_started=False, stopping_since=now)
        st.update(launch_at=None, ready_at=None, healthy_since=None, state="backoff")
        st.update(down_since=now, next_attempt_at=now + self.delay(st["restarts"]))
        self.pair_stopped(st, time.time())

    def pair_stopped(self, st: dict[str, Any], now: float) -> bool:
        """After a break or a failed launch: True once both units are down (recorded once), or
        the worker's supervisor is unreachable past the bound (it stops its unit itself then)."""
        pair = st["pair"]
        if pair["stopping_since"] is None:
            return True
        if self.unit_active:
            return False
        if self.peer is not None and (self.peer.get("unit_active") or not self.peer_checked()):
            return False
        if self.peer is None and not self.peer_lost(st, now):
            return False
        worker = "stopped" if self.peer is not None else "unreachable"
        after = round(now - pair["stopping_since"], 2)
        self.record(st, now, "pair-stopped", after_s=after, worker=worker)
        pair["stopping_since"] = None
        return True

    def pair_down(self, st: dict[str, Any], now: float) -> None:
        """The head's unit is down and the pair is not up: back off, then launch both."""
        pair = st["pair"]
        pair["want_worker"] = False
        if not self.pair_stopped(st, now):
            st["state"] = "backoff"  # the worker's unit is still going down
            return
        self.check_table_io(st, now)
        if st["down_since"] is None:
            self.record(st, now, "down")
            st.update(down_since=now, next_attempt_at=now + self.delay(st["restarts"]))
        if self.hold_if_exhausted(st, now):
            return
        if now < st["next_attempt_at"]:
            st["state"] = "backoff"
            return
        if self.mixed:
            self.refuse_mixed(st, now)  # until both are on one release
            return
        waited = round(now - st["down_since"], 2)
        backoff = round(st["next_attempt_at"] - st["down_since"], 3)
        self.clean_shm(st, now)
        st["restarts"] += 1
        # past any generation the worker has seen, should this state have been lost
        theirs = (self.peer or {}).get("generation")
        latest = max(pair["generation"], theirs if isinstance(theirs, int) else 0)
        pair.update(generation=latest + 1, want_worker=True, head_started=False)
        self.record(
            st, now, "relaunch", attempt=st["restarts"], waited_s=waited, backoff_s=backoff,
            generation=pair["generation"],
        )  # fmt: skip
        st.update(state="launched", launch_at=now, down_since=None, next_attempt_at=None)
        st.update(ready_at=None, healthy_since=None)

    def restart_unit(self, st: dict[str, Any], now: float) -> tuple[bool, dict[str, Any]]:
        """The weekly relaunch of a pair: stop the head and drop want_worker; the loop then
        relaunches both, worker first, without a backoff and without counting an incident."""
        stop = run_command(self.args.stop_cmd, self.values, timeout_s=self.args.stop_timeout_s)
        st["pair"].update(want_worker=False, up=False, head_started=False, stopping_since=now)
        st.update(state="backoff", launch_at=None, ready_at=None, healthy_since=None)
        st.update(down_since=now, next_attempt_at=now)
        return stop.ok, {"stop_exit": stop.returncode, "pair": "both relaunched, worker first"}


def boot_token(path: Path) -> str | None:
    """This boot's token: the one in `path` (under /run, emptied at every boot), else a new
    one written there. A restarted supervisor finds its boot's token, a booted node a new one.
    (Not the kernel's boot_id: a lab node, a container, keeps its host's across a restart.)
    None where it can be neither read nor written."""
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        token = secrets.token_hex(8)
        try:
            write_text(path, token + "\n")
        except OSError:
            return None
        return token
    except OSError:
        return None
