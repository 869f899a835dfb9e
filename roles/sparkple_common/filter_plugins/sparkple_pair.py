"""sparkple_pair: this host's side of its pair (sparkple.pair.plan), {} for a single Spark;
sparkple_pair_disagreements: what a pair's two nodes differ in (preflight, tasks_from: pair).

    sparkple_pair_info: "{{ hostvars | sparkple_pair(inventory_hostname, groups['all']) }}"
    head_identity | sparkple_pair_disagreements(worker_identity)

Every pair of the inventory is checked, so a half-described pair fails on every host with the
host and the variable to fix. The package is this checkout's, the one sparkple_package installs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

CHECKOUT = Path(__file__).resolve().parents[3]


def sparkple_pair(hostvars: Mapping[str, Any], host: str, hosts: Iterable[str]) -> dict[str, Any]:
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from sparkple.errors import SparkpleError
    from sparkple.pair.plan import inventory_view, pair_of

    # in inventory order (a set would name the hosts of an error in any order)
    described = inventory_view(hostvars, dict.fromkeys([*hosts, host]))
    try:
        pair = pair_of(described, host)
    except SparkpleError as exc:
        raise AnsibleFilterError(str(exc)) from None
    return pair.describe(host) if pair else {}


def sparkple_pair_disagreements(head: Mapping[str, Any], worker: Mapping[str, Any]) -> list[str]:
    """What the two nodes' identities (preflight, tasks_from: pair) differ in, one line each."""
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from sparkple.pair.plan import disagreements

    return disagreements(head, worker)


class FilterModule:
    def filters(self) -> dict[str, Callable[..., object]]:
        return {
            "sparkple_pair": sparkple_pair,
            "sparkple_pair_disagreements": sparkple_pair_disagreements,
        }
