"""serving_supervisor's flags on a pair's nodes and on a single Spark, rendered by Ansible from
the role's real vars and parsed by the supervisor's own parser."""

from __future__ import annotations

import json
import shlex
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
