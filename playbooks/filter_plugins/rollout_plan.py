"""rollout_plan: the order and batches of a rollout, a pair counting as one backend.

    groups[rollout_group] | rollout_plan(hostvars, rollout_batch)
      -> {"canary": [hosts], "rest": [hosts], "sizes": [hosts per batch]}

The canary is the first backend of the group (a single Spark or a pair, head then worker); the
others follow in batches of `batch` backends (a number, or a percentage of them as Ansible's
`serial` counts it: at least one). A pair's two hosts are always in the same batch, head first,
so that the rollout's tasks can stop, start and gate them in order.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

CHECKOUT = Path(__file__).resolve().parents[2]


def backends(hosts: list[str], hostvars: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The group's backends in group order: [host] or [head, worker]."""
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from sparkple.errors import SparkpleError
    from sparkple.serving.pair import inventory_view, pairs_of

    described = inventory_view(hostvars, hosts)
    try:
        pairs = pairs_of(described)
    except SparkpleError as exc:
        raise AnsibleFilterError(str(exc)) from None
    out: list[list[str]] = []
    placed: set[str] = set()
    for host in hosts:
        if host in placed:
            continue
        name = described[host].get("sparkple_pair") or ""
        members = [pairs[name].head.host, pairs[name].worker.host] if name else [host]
        out.append(members)
        placed.update(members)
    return out


def batch_size(batch: Any, count: int) -> int:
    text = str(batch).strip()
    try:
        size = int(count * float(text[:-1]) / 100) if text.endswith("%") else int(text)
    except ValueError:
        raise AnsibleFilterError(
            f"rollout batch {batch!r}: use a number of backends or a percentage such as 25%"
        ) from None
    return max(size, 1)


def rollout_plan(hosts: Iterable[str], hostvars: Mapping[str, Any], batch: Any) -> dict[str, Any]:
    groups = backends(list(hosts), hostvars)
    if not groups:
        return {"canary": [], "rest": [], "sizes": []}
    rest = groups[1:]
    per_batch = batch_size(batch, len(rest))
    sizes = [sum(len(b) for b in rest[i : i + per_batch]) for i in range(0, len(rest), per_batch)]
    return {"canary": groups[0], "rest": [h for b in rest for h in b], "sizes": sizes or [1]}


class FilterModule:
    def filters(self) -> dict:
        return {"rollout_plan": rollout_plan}
