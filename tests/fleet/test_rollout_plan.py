"""The rollout's order and batches (playbooks/filter_plugins/rollout_plan.py): a pair is one
backend, head then worker, alone in its batch; the canary is the first backend or the one named."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError
from pair_inventory import pair_hostvars

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "rollout_plan", ROOT / "playbooks" / "filter_plugins" / "rollout_plan.py"
)
assert spec and spec.loader
plugin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plugin)

PAIR = pair_hostvars(hosts=("h", "w"), pair="p", addresses=("10.0.0.1", "10.0.0.2"),
                     interface="eth0")  # fmt: skip
HOSTVARS = {
    # the worker listed before its head: the plan still puts the head first
    "w": PAIR["w"],
    "a": {},
    "h": PAIR["h"],
    "b": {},
    "c": {},
}


def test_a_pair_canary_is_both_of_its_hosts_head_first() -> None:
    plan = plugin.rollout_plan(["w", "a", "h", "b", "c"], HOSTVARS, "25%")
    assert plan == {"canary": ["h", "w"], "rest": ["a", "b", "c"], "sizes": [1, 1, 1]}


def test_batches_count_backends_and_keep_a_pair_together_and_alone() -> None:
    plan = plugin.rollout_plan(["a", "w", "b", "h", "c"], HOSTVARS, 2)
    # backends after the canary a: [h, w], [b], [c] -> the pair alone, then two singles
    assert plan == {"canary": ["a"], "rest": ["h", "w", "b", "c"], "sizes": [2, 2]}
    plan = plugin.rollout_plan(["a", "b", "w", "c", "h"], HOSTVARS, "50%")
    # three backends after a: 50% is one per batch
    assert plan["rest"] == ["b", "h", "w", "c"] and plan["sizes"] == [1, 2, 1]
    # singles before the pair close their batch early: the pair never shares one
    plan = plugin.rollout_plan(["a", "b", "w", "h", "c"], HOSTVARS, 3)
    assert plan["rest"] == ["b", "h", "w", "c"] and plan["sizes"] == [1, 2, 1]


def test_the_named_canary_goes_first_and_the_rest_keep_their_order() -> None:
    plan = plugin.rollout_plan(["w", "a", "h", "b", "c"], HOSTVARS, 1, "b")
    assert plan == {"canary": ["b"], "rest": ["h", "w", "a", "c"], "sizes": [2, 1, 1]}
    # naming either node of a pair makes the pair the canary, head first
    assert plugin.rollout_plan(["a", "h", "w"], HOSTVARS, 1, "w")["canary"] == ["h", "w"]
    with pytest.raises(AnsibleFilterError, match="rollout canary 'z' is not a host"):
        plugin.rollout_plan(["a", "b"], HOSTVARS, 1, "z")


def test_a_bad_batch_or_pair_is_refused() -> None:
    with pytest.raises(AnsibleFilterError, match="rollout batch 'x'"):
        plugin.rollout_plan(["a", "b"], HOSTVARS, "x")
    broken = {**HOSTVARS, "w": {**HOSTVARS["w"], "sparkple_pair_rank": 0}}
    with pytest.raises(AnsibleFilterError, match="both have sparkple_pair_rank 0"):
        plugin.rollout_plan(["a", "h", "w"], broken, 1)
