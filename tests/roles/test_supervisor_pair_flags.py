"""serving_supervisor's flags on a pair's nodes and on a single Spark, rendered by Ansible from
the role's real vars and parsed by the supervisor's own parser."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from ansible_local import run_playbook
from pair_inventory import pair_hostvars

from sparkple.pair.plan import pair_of
from sparkple.pair.supervisor_cli import parse_args
from sparkple.supervise import supervisor_cli as single_spark

ROOT = Path(__file__).resolve().parents[2]
HOSTVARS = pair_hostvars(interface="enp1s0f0np0", hcas=("rocep1s0f0", "rocep1s0f1"))
PLAY = """
- hosts: localhost
  gather_facts: false
  vars_files:
    - {root}/roles/sparkple_common/defaults/main.yml
    - {root}/roles/serving_supervisor/defaults/main.yml
    - {root}/roles/serving_supervisor/vars/main.yml
  vars:
    rendered:
      cmd: "{{{{ serving_supervisor_cmd }}}}"
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
    assert got["cmd"].endswith(" -m sparkple.pair.supervisor_cli")  # the pair's program
    args = parse_args(["run", *shlex.split(got["flags"])])
    peer = HOSTVARS["spark-b" if host == "spark-a" else "spark-a"]["sparkple_pair_link_address"]
    assert args.pair == "p1" and args.pair_rank == info["rank"]
    assert args.pair_listen == f"{HOSTVARS[host]['sparkple_pair_link_address']}:8470"
    assert args.pair_peer_url == f"http://{peer}:8470" and args.pair_peer_timeout_s == 30
    # the link's key by path (never its value on a command line), the release by its file
    assert args.pair_key_file == Path("/var/lib/sparkple/ops/pair.key")
    assert args.release_file == Path("/srv/sparkple/releases/current/release.json")
    timer = {u["name"]: u["start"] for u in got["units"]}["sparkple-relaunch.timer"]
    # the head's weekly relaunch relaunches both; the worker runs none of its own
    assert bool(timer) is (info["role"] == "head")


def test_a_single_spark_gets_no_pair_flags(tmp_path):
    got = rendered(tmp_path, {})
    assert got["cmd"].endswith(" -m sparkple.supervise.supervisor_cli")  # one Spark's program
    assert "--pair" not in got["flags"]
    assert single_spark.parse_args(["run", *shlex.split(got["flags"])]).state_dir
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
         "sparkple_host_python": f"env PYTHONPATH={ROOT} {sys.executable}",
         # which supervisor program the node runs (a pair's or a single Spark's)
         "sparkple_pair_info": {"name": "p1", "rank": 1} if paired else {}},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    line = out.read_text()
    assert line.startswith("supervisor=running MemAvailable=")
    if paired:
        assert line.endswith(" pair=p1/worker peer=reachable generation=3"), line
    else:
        assert "pair=" not in line and line.endswith(tuple("0123456789-")), line


KEY_PLAY = """
- hosts: localhost
  gather_facts: false
  vars_files:
    - {root}/roles/sparkple_common/defaults/main.yml
    - {root}/roles/serving_supervisor/defaults/main.yml
    - {root}/roles/serving_supervisor/vars/main.yml
  handlers:
    - name: Restart the supervisor
      ansible.builtin.debug: {{msg: restart}}
  tasks:
    - ansible.builtin.add_host: {{name: spark-b, serving_supervisor_pair_key: "{{{{ peer_key }}}}"}}
    - ansible.builtin.set_fact: {{serving_supervisor_pair_key: "{{{{ my_key }}}}"}}
    - ansible.builtin.include_tasks: {root}/roles/serving_supervisor/tasks/pair_key.yml
"""
GOOD_KEY = "0123456789abcdef0123"


@pytest.mark.parametrize(
    ("mine", "theirs"), [("", ""), ("short", "short"), (GOOD_KEY, GOOD_KEY + "x")],
    ids=["unset", "short", "different"],
)  # fmt: skip
def test_a_pair_node_without_one_key_for_both_nodes_is_refused(tmp_path, mine, theirs):
    key = tmp_path / "pair.key"
    done = run_playbook(
        tmp_path, KEY_PLAY.format(root=ROOT),
        {"my_key": mine, "peer_key": theirs, "serving_supervisor_pair_key_file": str(key),
         "sparkple_pair_info": {"name": "p1", "role": "head", "peer": "spark-b"}},
    )  # fmt: skip
    assert done.returncode != 0 and not key.exists()
    assert "localhost is the head of pair p1: serving_supervisor_pair_key must be set" in (
        done.stdout
    )
    assert "the same for spark-b" in done.stdout
    if mine:
        assert mine not in done.stdout, "the key is never printed"


def test_a_pair_nodes_key_is_written_0600(tmp_path):
    key = tmp_path / "pair.key"
    done = run_playbook(
        tmp_path, KEY_PLAY.format(root=ROOT),
        {"my_key": GOOD_KEY, "peer_key": GOOD_KEY, "serving_supervisor_pair_key_file": str(key),
         "sparkple_pair_info": {"name": "p1", "role": "head", "peer": "spark-b"}},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert key.read_text() == GOOD_KEY + "\n" and key.stat().st_mode & 0o777 == 0o600
    assert GOOD_KEY not in done.stdout
