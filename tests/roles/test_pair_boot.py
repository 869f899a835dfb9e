"""After a power cycle a pair's serving units must not start unordered: on a pair's nodes the
serving unit is not enabled at boot (the supervisors start the pair, worker first, with the
readiness deadline: tests/ops/test_ops_pair.py, the power cycle), on a single Spark it is.
The enablement is vllm_service's own task field, evaluated by a real ansible-playbook run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from ansible_local import run_playbook

ROOT = Path(__file__).resolve().parents[2]
PLAY = """
- hosts: localhost
  gather_facts: false
  vars_files:
    - {root}/roles/sparkple_common/defaults/main.yml
    - {root}/roles/serving_supervisor/defaults/main.yml
    - {root}/roles/serving_supervisor/vars/main.yml
  vars:
    rendered:
      serving_unit_enabled: {enabled}
      supervisor_units: "{{{{ serving_supervisor_units }}}}"
  tasks:
    - ansible.builtin.copy: {{dest: "{{{{ out }}}}", content: "{{{{ rendered | to_json }}}}"}}
"""


def enable_task() -> dict:
    tasks = yaml.safe_load((ROOT / "roles/vllm_service/tasks/unit.yml").read_text())
    [task] = [
        t["ansible.builtin.systemd_service"]
        for t in tasks
        if "enabled" in t.get("ansible.builtin.systemd_service", {})
    ]
    return task


@pytest.mark.parametrize(
    ("pair_info", "at_boot"),
    [({"name": "p1", "role": "head", "rank": 0}, False),
     ({"name": "p1", "role": "worker", "rank": 1}, False),
     ({}, True)],
    ids=["head", "worker", "single"],
)  # fmt: skip
def test_the_serving_unit_is_enabled_at_boot_on_a_single_spark_only(tmp_path, pair_info, at_boot):
    task = enable_task()
    out = tmp_path / "out.json"
    done = run_playbook(
        tmp_path,
        PLAY.format(root=ROOT, enabled=json.dumps(task["enabled"])),
        {"out": str(out), "sparkple_pair_info": pair_info},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(out.read_text())
    assert got["serving_unit_enabled"] is at_boot
    # the supervisor is what starts at boot, on every node
    units = {u["name"]: u["start"] for u in got["supervisor_units"]}
    assert units["sparkple-supervisor.service"] is True
