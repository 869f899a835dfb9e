"""The pair description (sparkple.pair.plan) and the roles' sparkple_pair_info, through a
real ansible-playbook run on an inventory that names a pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_local import ansible_playbook
from pair_inventory import pair_hostvars, pair_node

from sparkple.pair.plan import pair_of, pairs_of
from sparkple.serving.recipe import ServingError

ROOT = Path(__file__).resolve().parents[2]


def inventory() -> dict[str, dict[str, object]]:
    return {
        **pair_hostvars(
            hcas=("rocep1s0f1", "roceP2p1s0f1"), worker={"sparkple_pair_ib_gid_index": 1}
        ),
        "spark-c": {},
    }


def test_a_pair_gives_each_node_its_flags_and_its_own_link() -> None:
    hosts = inventory()
    pair = pair_of(hosts, "spark-b")
    assert pair is not None and pair_of(hosts, "spark-c") is None
    assert (pair.head.host, pair.worker.host, pair.master_port) == ("spark-a", "spark-b", 29501)
    common = ["--tensor-parallel-size=2", "--nnodes=2"]
    rendezvous = ["--master-addr=192.168.100.10", "--master-port=29501"]
    assert pair.vllm_args("spark-a") == [*common, "--node-rank=0", *rendezvous]
    assert pair.vllm_args("spark-b") == [*common, "--node-rank=1", *rendezvous, "--headless"]
    assert pair.env("spark-a")["VLLM_HOST_IP"] == "192.168.100.10"
    worker_env = pair.env("spark-b")
    # IB by default, forced (no silent socket fallback), with NCCL's init lines logged; the GID
    # index is not in the env: the link check finds it at each start (its env file)
    assert worker_env == {
        "VLLM_HOST_IP": "192.168.100.11",
        "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
        "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
        "NCCL_NET": "IB",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "roceP2p1s0f1",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
    }
    assert pair.describe("spark-a")["peer"] == "spark-b"
    assert pair.describe("spark-b")["role"] == "worker"
    assert pair.describe("spark-b")["transport"] == "ib"
    # the link check verifies the worker's pinned index and finds the head's
    assert pair.link_check_args("spark-b") == [
        "--host=spark-b", "--interface=enp1s0f1np1", "--address=192.168.100.11",
        "--peer-address=192.168.100.10", "--peer-port=29501", "--mtu=9000", "--transport=ib",
        "--ib-hca=roceP2p1s0f1", "--gid-index=1",
    ]  # fmt: skip
    assert pair.link_check_args("spark-a")[-1] == "--ib-hca=rocep1s0f1"


def test_a_socket_pair_is_chosen_explicitly_and_disables_ib() -> None:
    hosts = {
        h: {**hv, "sparkple_pair_transport": "socket", "sparkple_pair_link_mtu": 1500}
        for h, hv in inventory().items()
        if hv
    }
    del hosts["spark-a"]["sparkple_pair_ib_hca"]  # no RDMA device to name
    pair = pair_of(hosts, "spark-a")
    assert pair is not None
    env = pair.env("spark-a")
    assert (env["NCCL_NET"], env["NCCL_IB_DISABLE"]) == ("Socket", "1")
    assert "NCCL_IB_HCA" not in env and "NCCL_IB_GID_INDEX" not in env
    assert env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    args = pair.link_check_args("spark-a")
    assert "--transport=socket" in args and "--mtu=1500" in args
    assert not [a for a in args if a.startswith(("--ib-hca", "--gid-index"))]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"spark-b": None}, "pair p1 has 1 host(s) (spark-a)"),
        ({"spark-c": pair_node(1, "192.168.100.12")}, "pair p1 has 3 host(s)"),
        ({"spark-b": pair_node(0, "192.168.100.11")}, "both have sparkple_pair_rank 0"),
        ({"spark-b": pair_node(2, "192.168.100.11")}, "spark-b: sparkple_pair_rank is 2"),
        ({"spark-b": pair_node(1, "")}, "spark-b is in pair 'p1' but sparkple_pair_link_address"),
        ({"spark-b": pair_node(1, "192.168.100.10")}, "the same sparkple_pair_link_address"),
        (
            {"spark-b": pair_node(1, "192.168.100.11", sparkple_pair_master_port=29600)},
            "sparkple_pair_master_port differs between spark-a and spark-b",
        ),
        (
            {"spark-b": pair_node(1, "192.168.100.11", sparkple_pair_ib_gid_index="x")},
            "spark-b: sparkple_pair_ib_gid_index is 'x'",
        ),
        (
            {"spark-b": pair_node(1, "192.168.100.11", sparkple_pair_transport="tcp")},
            "spark-b: sparkple_pair_transport is 'tcp': use ib",
        ),
        (
            {"spark-b": pair_node(1, "192.168.100.11", sparkple_pair_transport="socket")},
            "sparkple_pair_transport is ib on spark-a and socket on spark-b",
        ),
        (
            {"spark-b": pair_node(1, "192.168.100.11", sparkple_pair_link_mtu=1500)},
            "sparkple_pair_link_mtu is 9000 on spark-a and 1500 on spark-b",
        ),
        (
            {"spark-b": pair_node(1, "192.168.100.11", sparkple_pair_ib_hca="")},
            "spark-b is in pair 'p1' but sparkple_pair_ib_hca is not set",
        ),
    ],
)
def test_a_pair_described_wrong_is_refused_naming_host_and_variable(
    change: dict[str, dict[str, object] | None], message: str
) -> None:
    hosts = inventory()
    for host, hv in change.items():
        if hv is None:
            del hosts[host]
        else:
            hosts[host] = hv
    with pytest.raises(ServingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pairs_of(hosts)


def test_the_roles_see_each_hosts_side_of_its_pair(tmp_path: Path) -> None:
    found = ansible_playbook()
    hosts = inventory()
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    (tmp_path / "hosts.json").write_text(
        json.dumps({"sparks": {"hosts": {h: {**hv, **local} for h, hv in hosts.items()}}})
    )
    (tmp_path / "play.yml").write_text(
        "- hosts: sparks\n  gather_facts: false\n  roles: [sparkple_common]\n  tasks:\n"
        "    - ansible.builtin.copy:\n        content: '{{ sparkple_pair_info | to_json }}'\n"
        "        dest: '{{ playbook_dir }}/{{ inventory_hostname }}.json'\n"
    )
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"))
    env.pop("ANSIBLE_CONFIG", None)
    run = subprocess.run(
        [found, "-i", "hosts.json", "play.yml"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    seen = {h: json.loads((tmp_path / f"{h}.json").read_text()) for h in hosts}
    assert seen["spark-c"] == {}
    assert (seen["spark-a"]["role"], seen["spark-a"]["peer"]) == ("head", "spark-b")
    assert seen["spark-b"]["vllm_args"][-1] == "--headless"
    assert seen["spark-b"]["env"]["NCCL_IB_HCA"] == "roceP2p1s0f1"

    hosts["spark-b"]["sparkple_pair_rank"] = 0
    (tmp_path / "hosts.json").write_text(
        json.dumps({"sparks": {"hosts": {h: {**hv, **local} for h, hv in hosts.items()}}})
    )
    run = subprocess.run(
        [found, "-i", "hosts.json", "play.yml"], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode != 0
    assert "spark-a and spark-b both have sparkple_pair_rank 0" in run.stdout + run.stderr
