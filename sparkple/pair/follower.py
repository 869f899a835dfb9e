"""The worker's supervisor of a pair: it follows the head's (sparkple.pair.member says how a
pair is supervised): it starts its unit for the generation the head wants, stops it when the head
no longer wants it, and counts nothing.
"""

from __future__ import annotations

from typing import Any

from ..supervise.commands import run_command
from .member import PairMember


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
