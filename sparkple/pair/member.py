"""A pair is one unit of service: the supervisors of a pair's two nodes (sparkple.pair.plan)
keep both units up together or neither.

vLLM's multi-node engine does not: a worker whose head died waits for the next step forever,
and a head whose worker died answers /health 200 until a step times out (docs/tensor-parallel.md).
So each supervisor serves its side on the pair link (sparkple.pair.pairlink) and reads the other's
(what both sides do is here, the head's lead in sparkple.pair.leader, the worker's part in
sparkple.pair.follower):

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
import time
from typing import Any

from ..supervise.state import (
    INCIDENT_KINDS,
    PAIR_BROKEN,
    manual_stop_path,
    read_json_object,
    read_markers,
)
from ..supervise.supervisor import Supervisor, log
from .pairlink import PairLink, read_key

ROLES = ("head", "worker")


class PairMember(Supervisor):
    """What both sides share: the link, the view of the peer, the side they publish."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.link = PairLink(
            args.pair_listen,
            args.pair_peer_url,
            read_key(args.pair_key_file),
            pair=args.pair,
            rank=args.pair_rank,
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
