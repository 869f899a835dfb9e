"""ple_metrics' unit on a pair's nodes and on a single Spark, rendered by Ansible from the role's
own template with the pair description sparkple.pair.plan gives each host, and parsed by the
metrics program's own parser: a pair node reads its own side of the link."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_local import run_playbook
from pair_inventory import TWIN_HCAS, pair_hostvars

from sparkple.metrics.collect import parse_args
from sparkple.pair.plan import pair_of

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "ple_metrics"
# a cross-wired worker: another interface and device
HOSTVARS = pair_hostvars(
    hcas=("rocep1s0f1", "roceP2p1s0f1"),
    worker={"sparkple_pair_link_interface": "enP2p1s0f1np1"},
)
PLAY = """
- hosts: localhost
  gather_facts: false
  vars_files:
    - {root}/roles/sparkple_common/defaults/main.yml
    - {root}/roles/ple_metrics/defaults/main.yml
  tasks:
    - ansible.builtin.template:
        src: {root}/roles/ple_metrics/templates/sparkple-metrics.service.j2
        dest: "{{{{ out }}}}"
        mode: "0644"
"""


def exec_start(tmp_path: Path, pair_info: dict) -> list[str]:
    out = tmp_path / "sparkple-metrics.service"
    done = run_playbook(
        tmp_path,
        PLAY.format(root=ROOT),
        {"out": str(out), "sparkple_pair_info": pair_info, "inventory_hostname": "spark-x"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = re.findall(r"^ExecStart=(.*?)\n(?!    )", out.read_text(), re.M | re.S)
    words = shlex.split(line.replace("\\\n", " "))
    # sparkple_host_python is `/usr/bin/env PYTHONPATH=... python3`: the program's words follow
    start = words.index("sparkple.metrics.collect")
    assert words[start - 1] == "-m" and words[start - 2].endswith("python3"), words
    return words[start + 1 :]


# both nodes naming both ports of their ConnectX-7
TWIN_HOSTVARS = pair_hostvars(hcas=(TWIN_HCAS, TWIN_HCAS))


@pytest.mark.parametrize("hostvars", [HOSTVARS, TWIN_HOSTVARS], ids=["cross-wired", "twin-ports"])
@pytest.mark.parametrize("host", ["spark-a", "spark-b"])
def test_a_pair_node_reads_its_own_link(tmp_path, host, hostvars):
    pair = pair_of(hostvars, host)
    assert pair is not None
    words = exec_start(tmp_path, pair.describe(host))
    args = parse_args(words)
    assert args.link_interface == hostvars[host]["sparkple_pair_link_interface"]
    assert args.rdma_device == hostvars[host]["sparkple_pair_ib_hca"]
    assert args.sysfs_root == Path("/sys")


def test_a_single_spark_has_no_link(tmp_path):
    args = parse_args(exec_start(tmp_path, {}))
    assert args.link_interface == "" and args.rdma_device == ""


def program_words(*args: object) -> list[str]:
    return [sys.executable, "-m", "sparkple.metrics.collect", *map(str, args)]


def run_link_check(tmp_path: Path, pair_info: dict):
    """The role's own check of the pair link's names (the metrics program's --check-args, then
    the refusal), alone in a play, with this Python as the host's."""
    tasks = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text())
    names = ("Check the pair link's names with the metrics program",
             "Refuse a pair link the metrics program cannot read")  # fmt: skip
    check = [t for t in tasks if t["name"] in names]
    assert [t["name"] for t in check] == list(names)
    play = [{"hosts": "localhost", "gather_facts": False, "tasks": check}]
    return run_playbook(
        tmp_path,
        yaml.safe_dump(play),
        {"sparkple_pair_info": pair_info, "inventory_hostname": "spark-x",
         "sparkple_host_python": sys.executable},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("interface", "hca", "ok"),
    [
        ("enp1s0f1np1", "rocep1s0f1", True),
        ("enp1s0f1np1", "=mlx5_0:1", True),
        # a ConnectX-7's twin ports, as docs/two-sparks.md recommends (sparkple.rdma)
        ("enp1s0f1np1", "rocep1s0f1,roceP2p1s0f1", True),
        ("enp1s0f1np1", "^mlx5_1", False),
        ("../../etc", "rocep1s0f1", False),
        ("enp1s0f1np1", "mlx5_0:x", False),
    ],
)
def test_the_role_refuses_link_names_the_program_would(tmp_path, interface, hca, ok):
    info = {"node": {"link_interface": interface, "ib_hca": hca}}
    done = run_link_check(tmp_path, info)
    assert (done.returncode == 0) is ok, done.stdout + done.stderr
    refused = subprocess.run(
        program_words("--out", tmp_path / "m.prom", "--link-interface", interface,
                      "--rdma-device", hca, "--sysfs-root", tmp_path),
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (refused.returncode == 0) is ok, refused.stderr
    if not ok:
        assert "spark-x: " in done.stdout
        assert "set the pair's link in the inventory" in done.stdout
