"""rollout_plan: the order and batches of a rollout, a pair counting as one backend.

    groups[rollout_group] | rollout_plan(hostvars, rollout_batch, rollout_canary)
      -> {"canary": [hosts], "rest": [hosts], "sizes": [hosts per batch]}

The canary is the backend of `canary` (a host name; "" = the first backend of the group), a
single Spark or a pair, head then worker; the others follow in group order, in batches of
`batch` backends (a number, or a percentage of them as Ansible's `serial` counts it: at least
one). A pair is a batch of its own, head first: the rollout's tasks stop, start and gate its two
hosts in order, and a failure on either node fails both (the block's any_errors_fatal, which
Ansible applies to every host of the batch), so nothing else may share its batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

CHECKOUT = Path(__file__).resolve().parents[2]


def backends(hosts: list[str], hostvars: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The group's backends in group order: [host] or [head, worker]."""
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from sparkple.errors import SparkpleError
    from sparkple.pair.plan import inventory_view, pairs_of

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


def batches(rest: list[list[str]], per_batch: int) -> list[list[str]]:
    """Up to `per_batch` single Sparks per batch, in order; a pair alone in its batch."""
    out: list[list[str]] = []
    singles: list[str] = []
    for backend in rest:
        if len(backend) == 1:
            singles += backend
            if len(singles) == per_batch:
                out.append(singles)
                singles = []
            continue
        if singles:
            out.append(singles)
            singles = []
        out.append(backend)
    return out + ([singles] if singles else [])


def rollout_plan(
    hosts: Iterable[str], hostvars: Mapping[str, Any], batch: Any, canary: Any = ""
) -> dict[str, Any]:
    hosts = list(hosts)
    groups = backends(hosts, hostvars)
    if not groups:
        return {"canary": [], "rest": [], "sizes": []}
    first = 0
    if canary:
        found = [i for i, b in enumerate(groups) if canary in b]
        if not found:
            raise AnsibleFilterError(
                f"rollout canary {canary!r} is not a host of the rollout's group "
                f"({', '.join(hosts)}): name one of them, or leave sparkple_rollout_canary unset"
            )
        first = found[0]
    rest = groups[:first] + groups[first + 1 :]
    planned = batches(rest, batch_size(batch, len(rest)))
    return {
        "canary": groups[first],
        "rest": [h for b in planned for h in b],
        "sizes": [len(b) for b in planned] or [1],
    }


class FilterModule:
    def filters(self) -> dict[str, Callable[..., object]]:
        return {"rollout_plan": rollout_plan}
