"""A pair is one unit of service: the supervisors of a pair's two nodes (sparkple.serving.pair)
keep both units up together or neither.

vLLM's multi-node engine does not: a worker whose head died waits for the next step forever,
and a head whose worker died answers /health 200 until a step times out (docs/tensor-parallel.md).
So each supervisor serves its side on the pair link (sparkple.ops.pairlink) and reads the other's:

  - the head's supervisor leads. It owns backoff, hold and breaker for the pair. A launch is a
    new `generation` with `want_worker` set; the head's unit starts only once the worker reports
    its unit active for that generation (worker first), and the readiness deadline runs from
    the generation's start, so a worker that never joins is a failed launch. When either unit
    goes down while the pair is up, it stops the head at once, drops `want_worker`, writes one
    `pair-broken` marker (the pair's breaker counts these alone, whatever stopped it, on
    either node) and relaunches both after the backoff, once the worker reports its unit down;
  - the worker's supervisor follows. It starts its unit when the head wants it for a
    generation its unit is not running for (a unit of an older generation is restarted: its
    head is gone), stops it when the head no longer wants it, never restarts a unit that went
    down for the same generation (the head must see the break), and counts nothing;
  - a peer supervisor that does not answer (past --pair-peer-timeout-s) is no evidence that
    its engine is down: the head stops the pair on it only while its own /health fails (after
    the launch's readiness; a head whose worker died fails its steps, then /health), the worker
    never (its unit active is all it knows). Both record `peer-unreachable-serving` once;
  - a supervisor before its first check answers "starting": reachable, nothing decided on it;
  - both sides publish their release (id and patch manifest hash, from --release-file): while
    they differ neither launches (state mixed-release; the head does not relaunch, the worker
    does not start), and both record `release-mismatch` naming both, until they agree;
  - the manual-stop flag on either node means hands off for the pair: neither side starts or
    stops anything. Afterwards a running pair is adopted: its generation is kept (or taken from
    the worker's) and the head is watched to readiness as after a launch, with no relaunch.

History events (supervisor.json, the head's unless said): relaunch (with the generation),
worker-joined, head-started, ready, stable, pair-broken (cause: worker-down,
worker-unreachable, head-down, both-down; explained_by: the incident markers of either node
since the pair came up or, when it broke before, since that break: a marker explains the first
break after it), pair-stopped (after_s: from the break until both units were down),
launch-failed, ready-timeout, adopted, half-pair-stopped; the worker's: worker-started,
worker-stopped (reason), adopted; both: peer-reachable, peer-unreachable, peer-mismatch (an
answer that is not the peer's: another pair or rank, or a MAC that does not verify),
peer-unreachable-serving (evidence), release-mismatch, release-agreed.
"""

from __future__ import annotations

import argparse
import secrets
import time
from pathlib import Path
from typing import Any

from ..atomicfile import write_text
from .host import run_command
from .pairlink import PairLink, read_key
from .state import (
    INCIDENT_KINDS,
    PAIR_BROKEN,
    manual_stop_path,
    read_json_object,
    read_markers,
    write_marker,
)
from .supervision import Supervisor, log

ROLES = ("head", "worker")


class PairMember(Supervisor):
    """What both sides share: the link, the view of the peer, the side they publish."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.link = PairLink(
            args.pair_listen,
            args.pair_peer_url,
            read_key(args.pair_key_file),
            starting=self.starting_side(),
        )
        self.link_error: str | None = None
        # the peer's side as read at this check (None: no answer as the peer); "checked" is
        # False while its supervisor has not finished its first check (reachable, nothing
        # known: neither a stop nor a launch is decided on it)
        self.peer: dict[str, Any] | None = None
        self.peer_problem: str | None = None
        self.unit_active = False
        self.release: dict[str, Any] = {"release": None, "patch_manifest_sha256": None}
        self.mixed: str | None = None  # while the two sides' releases differ: both, named
        self.started_at = time.time()

    def starting_side(self) -> dict[str, Any]:
        """What /pair answers until the first check ends: who this is, and nothing else."""
        side: dict[str, Any] = dict.fromkeys(
            ("unit_active", "manual_stop", "generation", "want_worker", "start_exit",
             "release", "patch_manifest_sha256", "updated")
        )  # fmt: skip
        side.update(
            pair=self.args.pair, host=self.args.pair_host, rank=self.args.pair_rank,
            role=self.pair_role, state="starting", incidents=[],
        )  # fmt: skip
        return side

    def read_release(self) -> dict[str, Any]:
        """This node's current release (its release.json: id and patch manifest hash); nulls
        without one (no --release-file, or no release staged yet)."""
        if not self.args.release_file:
            return {"release": None, "patch_manifest_sha256": None}
        data = read_json_object(self.args.release_file)
        raw = data.get("inputs")
        inputs: dict[str, Any] = raw if isinstance(raw, dict) else {}
        release = data.get("id")
        patches = inputs.get("patch_manifest_sha256")
        return {
            "release": release if isinstance(release, str) else None,
            "patch_manifest_sha256": patches if isinstance(patches, str) else None,
        }

    def peer_checked(self) -> bool:
        return self.peer is not None and self.peer.get("checked") is True

    def fresh(self) -> dict[str, Any]:
        return {**super().fresh(), "pair": self.fresh_pair()}

    def fresh_pair(self) -> dict[str, Any]:
        return {
            "name": self.args.pair,
            "role": self.pair_role,
            "host": self.args.pair_host,
            "generation": None,
            "link_error": None,
            "peer": {"reachable": False, "seen_at": None},
        }

    def load(self) -> dict[str, Any]:
        st = super().load()
        saved = st["pair"] if isinstance(st["pair"], dict) else {}
        st["pair"] = {**self.fresh_pair(), **saved, "name": self.args.pair}
        return st

    # -- the link ----------------------------------------------------------------------------
    def tick(self) -> dict[str, Any]:
        # network I/O outside the loop's lock: manual-stop and resume never wait for a peer
        self.link_error = self.link.serve()
        answer = self.link.fetch()
        self.peer, self.peer_problem = self.checked(answer.side)
        self.peer_problem = self.peer_problem or answer.error
        self.release = self.read_release()
        st = super().tick()
        self.link.publish(self.side(st))
        return st

    def checked(self, side: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
        """The peer's side when it is this pair's other node; else None and what is wrong."""
        if side is None:
            return None, None
        rank = 1 - self.args.pair_rank
        if side.get("pair") != self.args.pair or side.get("rank") != rank:
            return None, (
                f"{self.args.pair_peer_url} answers for pair {side.get('pair')!r} rank "
                f"{side.get('rank')!r}, not pair {self.args.pair!r} rank {rank}: check "
                "--pair-peer-url (sparkple_pair_info.peer_address, sparkple_pair_link_port)"
            )
        generation = side.get("generation")
        if not isinstance(generation, int) or isinstance(generation, bool):
            side["generation"] = None  # never compared as a number unless it is one
        side["checked"] = side.get("state") != "starting" or side.get("updated") is not None
        return side, None

    def side(self, st: dict[str, Any]) -> dict[str, Any]:
        now = time.time()
        return {
            "pair": self.args.pair,
            "host": self.args.pair_host,
            "rank": self.args.pair_rank,
            "role": self.pair_role,
            "unit_active": self.unit_active,
            "state": st["state"],
            "manual_stop": manual_stop_path(self.state_dir).exists(),
            "generation": st["pair"]["generation"],
            "want_worker": st["pair"].get("want_worker"),
            "start_exit": st["pair"].get("start_exit"),
            "incidents": [
                {"kind": m["kind"], "time": m["time"], "reason": m.get("reason")}
                for m in read_markers(self.state_dir, INCIDENT_KINDS - {PAIR_BROKEN}, now - 86400)
            ],
            **self.release,
            "updated": st.get("updated", now),
        }

    def observe(self, st: dict[str, Any], now: float) -> None:
        """This check's view of the own unit and of the peer, kept in the state for `status`."""
        self.unit_active = self.running()
        pair = st["pair"]
        if self.link_error != pair["link_error"]:
            if self.link_error:
                self.record(st, now, "link-error", error=self.link_error)
            pair["link_error"] = self.link_error
        if self.peer_problem and self.peer_problem != pair.get("peer_problem"):
            self.record(st, now, "peer-mismatch", error=self.peer_problem)
        pair["peer_problem"] = self.peer_problem
        pair["release"] = self.release
        view = pair["peer"]
        if self.peer is None:
            if view.get("reachable"):
                self.record(st, now, "peer-unreachable", url=self.args.pair_peer_url)
            view["reachable"] = False
            return
        if not view.get("reachable"):
            self.record(st, now, "peer-reachable", host=self.peer.get("host"))
        pair.pop("peer_unreachable_since", None)
        view.update(
            {k: self.peer.get(k) for k in ("host", "unit_active", "state", "manual_stop")},
            generation=self.peer.get("generation"),
            release=self.peer.get("release"),
            patch_manifest_sha256=self.peer.get("patch_manifest_sha256"),
            reachable=True,
            seen_at=now,
        )
        self.compare_releases(st, now)

    def compare_releases(self, st: dict[str, Any], now: float) -> None:
        """Both sides must run one release (id and patch manifest): a mixed pair is never
        launched, and the difference is recorded once, naming both."""
        peer = self.peer or {}
        if not self.peer_checked():
            return
        mine = (self.release["release"], self.release["patch_manifest_sha256"])
        theirs = (peer.get("release"), peer.get("patch_manifest_sha256"))
        pair = st["pair"]
        if mine == theirs:
            if pair.get("mixed_release"):
                self.record(st, now, "release-agreed", release=mine[0])
            pair["mixed_release"] = None
            self.mixed = None
            return
        self.mixed = (
            f"pair {self.args.pair}: {self.pair_role} {self.args.pair_host} is on release "
            f"{mine[0]} (patch manifest {mine[1]}), {peer.get('role')} {peer.get('host')} on "
            f"release {theirs[0]} (patch manifest {theirs[1]}): not launching a mixed pair "
            "until both nodes are on one release (finish the rollout or roll it back)"
        )
        if pair.get("mixed_release") != [list(mine), list(theirs)]:
            pair["mixed_release"] = [list(mine), list(theirs)]
            self.record(
                st, now, "release-mismatch", host=self.args.pair_host, release=mine[0],
                patch_manifest_sha256=mine[1], peer=peer.get("host"), peer_release=theirs[0],
                peer_patch_manifest_sha256=theirs[1], note=self.mixed,
            )  # fmt: skip

    def refuse_mixed(self, st: dict[str, Any], now: float) -> None:
        """Nothing is launched into a mixed pair; alerted when a launch is first refused (not
        while a rollout, hands off, switches one node and then the other)."""
        if st["state"] != "mixed-release" and self.mixed:
            self.alerter.send("release-mismatch", self.mixed)
        st["state"] = "mixed-release"

    def serving_alone(self, st: dict[str, Any], now: float, evidence: str) -> None:
        """The peer's supervisor is unreachable past the bound while this side serves: no
        stop on that alone; recorded (and alerted) once per outage for an operator."""
        pair = st["pair"]
        if pair.get("peer_unreachable_since") is not None:
            return
        pair["peer_unreachable_since"] = now
        note = (
            f"pair {self.args.pair}: the {'worker' if self.pair_role == 'head' else 'head'}'s "
            f"supervisor ({self.args.pair_peer_url}) has not answered for over "
            f"{self.args.pair_peer_timeout_s:g} s, but this side serves ({evidence}): the pair "
            "is left running; check sparkple-supervisor on the peer and the pair link"
        )
        self.record(st, now, "peer-unreachable-serving", evidence=evidence, note=note)
        self.alerter.send("pair-peer-unreachable", note)

    def peer_lost(self, st: dict[str, Any], now: float) -> bool:
        """Unreachable for longer than the bound (counted from this program's start at most:
        a supervisor restarted by systemd gives its peer the whole bound). A peer that answers
        "starting" is reachable."""
        if self.peer is not None:
            return False
        seen = max(float(st["pair"]["peer"].get("seen_at") or 0.0), self.started_at)
        timeout: float = self.args.pair_peer_timeout_s  # argparse type=float
        return now - seen > timeout

    def hands_off_pair(self, st: dict[str, Any], now: float) -> bool:
        """The manual-stop flag of either node (the peer's as last seen): nothing is started
        or stopped."""
        if manual_stop_path(self.state_dir).exists():
            self.hands_off(st, now, "flag present; hands off the pair")
            return True
        if st["pair"]["peer"].get("manual_stop"):
            host = st["pair"]["peer"].get("host")
            self.hands_off(st, now, f"the manual-stop flag of {host}; hands off the pair")
            return True
        return False

    def run(self) -> int:
        host, port = self.link.address
        log(
            f"pair {self.args.pair}: {self.pair_role} {self.args.pair_host}, serving its side on "
            f"http://{host}:{port}/pair, reading {self.link.peer_url}"
        )
        try:
            return super().run()
        finally:
            self.link.close()


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


class PairFollower(PairMember):
    """The worker's supervisor: runs its unit while, and for the generation, the head wants."""

    pair_role = "worker"

    def fresh_pair(self) -> dict[str, Any]:
        return {**super().fresh_pair(), "start_exit": None}

    def step(self, st: dict[str, Any], now: float) -> None:
        self.observe(st, now)
        if self.hands_off_pair(st, now):
            return
        head = self.peer
        if head is None or not self.peer_checked():
            # Its unit active is all a worker knows of its engine (it serves no API): a head
            # supervisor that does not answer is no evidence the head's engine is down, so the
            # unit keeps running. A dead head is seen by the head's supervisor when it is back
            # (its unit down: it stops the pair), or by the head's engine (its steps fail).
            if self.unit_active and self.peer_lost(st, now):
                self.serving_alone(st, now, "worker unit active")
            st["state"] = "running" if self.unit_active else "standby"
            return
        wanted, generation = head.get("want_worker"), head.get("generation")
        mine = st["pair"]["generation"]
        if wanted is None or not isinstance(generation, int):
            st["state"] = "running" if self.unit_active else "standby"
            return
        if not wanted:
            if self.unit_active:
                self.stop_unit(st, now, "head-does-not-want-it")
            st["state"] = "standby"
            return
        if self.unit_active:
            if mine is None:  # running, but not started by this supervisor's state: adopt it
                st["pair"]["generation"] = mine = generation
                self.record(st, now, "adopted", generation=generation)
            if mine == generation:
                st["state"] = "running"
                return
            self.stop_unit(st, now, "generation-moved-on")  # its head is gone: it hangs
        elif mine == generation:
            st["state"] = "standby"  # its unit for this launch went down: the head relaunches
            return
        if self.mixed:
            self.refuse_mixed(st, now)  # never joins a head of another release
            return
        if self.going_down():
            return
        self.clean_shm(st, now)
        start = run_command(self.args.start_cmd, self.values, timeout_s=self.args.start_timeout_s)
        self.unit_active = self.running()
        st["pair"].update(generation=generation, start_exit=start.returncode)
        self.record(
            st, now, "worker-started", generation=generation, exit=start.returncode,
            stderr=start.stderr[-500:],
        )  # fmt: skip
        st["state"] = "running" if self.unit_active else "standby"

    def stop_unit(self, st: dict[str, Any], now: float, reason: str) -> None:
        stop = run_command(self.args.stop_cmd, self.values, timeout_s=self.args.stop_timeout_s)
        self.unit_active = self.running()
        self.record(st, now, "worker-stopped", reason=reason, exit=stop.returncode)


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


def make_supervisor(args: argparse.Namespace) -> Supervisor:
    """The single Spark's supervisor, or a pair node's (--pair-rank 0: leads; 1: follows)."""
    if getattr(args, "pair_rank", None) is None:
        return Supervisor(args)
    return PairLeader(args) if args.pair_rank == 0 else PairFollower(args)
