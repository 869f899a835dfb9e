"""serving_supervisor's flags on a pair's nodes and on a single Spark, rendered by Ansible from
the role's real vars and parsed by the supervisor's own parser."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from ansible_local import run_playbook

from sparkple.ops.supervisor import parse_args
from sparkple.serving.pair import pair_of

ROOT = Path(__file__).resolve().parents[2]
NODE = {"sparkple_pair": "p1", "sparkple_pair_link_interface": "enp1s0f0np0"}
HOSTVARS = {
    "spark-a": {**NODE, "sparkple_pair_rank": 0, "sparkple_pair_link_address": "192.168.100.10",
                "sparkple_pair_ib_hca": "rocep1s0f0"},
    "spark-b": {**NODE, "sparkple_pair_rank": 1, "sparkple_pair_link_address": "192.168.100.11",
                "sparkple_pair_ib_hca": "rocep1s0f1"},
}  # fmt: skip
PLAY = """
- hosts: localhost
  gather_facts: false
  vars_files:
    - {root}/roles/sparkple_common/defaults/main.yml
    - {root}/roles/serving_supervisor/defaults/main.yml
    - {root}/roles/serving_supervisor/vars/main.yml
  vars:
    rendered:
      flags: "{{{{ serving_supervisor_flags }}}}"
      units: "{{{{ serving_supervisor_units }}}}"
  tasks:
    - ansible.builtin.copy: {{dest: "{{{{ out }}}}", content: "{{{{ rendered | to_json }}}}"}}
"""


def rendered(tmp_path: Path, pair_info: dict) -> dict:
    out = tmp_path / "out.json"
    done = run_playbook(
        tmp_path,
        PLAY.format(root=ROOT),
        {"out": str(out), "sparkple_pair_info": pair_info, "inventory_hostname": "spark-x"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("host", ["spark-a", "spark-b"])
def test_a_pair_node_gets_its_rank_link_and_peer(tmp_path, host):
    pair = pair_of(HOSTVARS, host)
    assert pair is not None
    info = pair.describe(host)
    got = rendered(tmp_path, info)
    args = parse_args(["run", *shlex.split(got["flags"])])
    peer = HOSTVARS["spark-b" if host == "spark-a" else "spark-a"]["sparkple_pair_link_address"]
    assert args.pair == "p1" and args.pair_rank == info["rank"]
    assert args.pair_listen == f"{HOSTVARS[host]['sparkple_pair_link_address']}:8470"
    assert args.pair_peer_url == f"http://{peer}:8470" and args.pair_peer_timeout_s == 30
    timer = {u["name"]: u["start"] for u in got["units"]}["sparkple-relaunch.timer"]
    # the head's weekly relaunch relaunches both; the worker runs none of its own
    assert bool(timer) is (info["role"] == "head")


def test_a_single_spark_gets_no_pair_flags(tmp_path):
    got = rendered(tmp_path, {})
    assert "--pair" not in got["flags"]
    assert parse_args(["run", *shlex.split(got["flags"])]).pair_rank is None
    assert {u["name"]: u["start"] for u in got["units"]}["sparkple-relaunch.timer"] is True


STATUS_PLAY = """
- hosts: localhost
  gather_facts: false
  vars_files:
    - {root}/roles/sparkple_common/defaults/main.yml
    - {root}/roles/serving_supervisor/defaults/main.yml
    - {root}/roles/serving_supervisor/vars/main.yml
  tasks:
    - ansible.builtin.include_tasks: {root}/roles/serving_supervisor/tasks/status.yml
    - ansible.builtin.copy:
        dest: "{{{{ out }}}}"
        content: "{{{{ serving_supervisor_status_line }}}}"
"""


@pytest.mark.parametrize("paired", [True, False], ids=["pair", "single"])
def test_the_status_line_names_the_pair_on_a_pair_node_only(tmp_path, paired):
    """The role's status task runs the real `supervisor status --json` on a state dir."""
    state = tmp_path / "state"
    st: dict = {"state": "running", "history": []}
    if paired:
        peer = {"host": "spark-a", "reachable": True, "unit_active": True}
        st["pair"] = {"name": "p1", "role": "worker", "host": "spark-b", "generation": 3}
        st["pair"]["peer"] = peer
    state.mkdir()
    (state / "supervisor.json").write_text(json.dumps(st))
    out = tmp_path / "line"
    done = run_playbook(
        tmp_path,
        STATUS_PLAY.format(root=ROOT),
        {"out": str(out), "sparkple_ops_state_dir": str(state),
         "sparkple_host_python": f"env PYTHONPATH={ROOT} {sys.executable}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    line = out.read_text()
    assert line.startswith("supervisor=running MemAvailable=")
    if paired:
        assert line.endswith(" pair=p1/worker peer=reachable generation=3"), line
    else:
        assert "pair=" not in line and line.endswith(tuple("0123456789-")), line
