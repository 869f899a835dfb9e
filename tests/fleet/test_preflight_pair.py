"""A pair's link and agreement (preflight, tasks_from: pair) through a real ansible-playbook run
on an inventory that names a pair: each node checks its side of the link (`sparkple
pair-link-check` on a saved sysfs tree, its peer reached for real over the loopback link), reads
its own real PLE table (built by `sparkple build-table` from a synthetic checkpoint in the HF cache
layout) and hashes its own manifests; a node whose link is not ready is refused naming the host,
the thing and the fix, and a pair whose nodes differ is refused on both, naming both hosts and
what differs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_local import ansible_playbook
from hf_snapshot import hf_cache_snapshot
from pair_inventory import pair_hostvars

from sparkple.pair.link import ipv4_mapped_gid
from sparkple.pair.plan import disagreements

pytestmark = pytest.mark.slow  # a few ansible-playbook runs

ROOT = Path(__file__).resolve().parents[2]
REVISION = "1f0c" * 10
OTHER_REVISION = "2e9d" * 10
PLAY = """
- hosts: sparks
  gather_facts: false
  tasks:
    - name: The pair's agreement
      ansible.builtin.import_role:
        name: preflight
        tasks_from: pair
    - name: Keep what this node described
      ansible.builtin.copy:
        content: "{{ preflight_pair_identity | default({}) | to_json }}"
        dest: "{{ playbook_dir }}/{{ inventory_hostname }}.json"
        mode: "0644"
"""


def sha256_manifest(snapshot: Path, out: Path) -> Path:
    """The snapshot's files in `sha256sum` format, as model_checkpoint verifies them."""
    lines = [
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}"
        for p in sorted(snapshot.iterdir())
    ]
    out.write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Three node states: A and A2 built apart from one checkpoint (as two Sparks do), B from
    another one; each with its table, its snapshot manifest and a patch manifest."""
    root = tmp_path_factory.mktemp("pair-nodes")
    found = {}
    for name, seed in (("A", 1), ("A2", 1), ("B", 2)):
        snapshot = hf_cache_snapshot(root / name, files=2, seed=seed, rev=REVISION)
        table = root / name / "table"
        build = [sys.executable, "-m", "sparkple.cli", "build-table", str(snapshot), str(table),
                 "--quiet"]  # fmt: skip
        subprocess.run(build, check=True, capture_output=True, cwd=ROOT)
        patches = root / name / "patches"
        patches.mkdir()
        (patches / "manifest.json").write_text(json.dumps({"profile": "vllm-0.33", "files": []}))
        found[name] = {
            "preflight_pair_table_dir": str(table),
            "preflight_pair_snapshot_manifest": str(
                sha256_manifest(snapshot, root / name / "snapshot.sha256")
            ),
            "preflight_pair_patch_manifest": str(patches / "manifest.json"),
            "preflight_pair_checkpoint_revision": REVISION,
        }
    return found


# The link is the loopback interface: both nodes' addresses are local, so each node's
# connection to its peer's address is answered for real by this machine's kernel.
LINK = {"spark-a": "127.0.0.10", "spark-b": "127.0.0.11"}


def link_tree(root: Path, address: str, gid_index: int, mtu: int = 9000) -> list[str]:
    """A Spark's link as sysfs and `ip -j` show it (the RoCE v2 GID of `address` at
    gid_index); the pair-link-check arguments that read it."""

    def put(path: str, text: str) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")

    put("sys/class/net/lo/operstate", "up")
    put("sys/class/net/lo/mtu", str(mtu))
    port = "sys/class/infiniband/rocep1s0f1/ports/1"
    put(f"{port}/state", "4: ACTIVE")
    link_local = "fe80:0000:0000:0000:0000:0000:0000:0001"
    table = {0: (link_local, "IB/RoCE v1"), gid_index: (ipv4_mapped_gid(address), "RoCE v2")}
    for index, (gid, kind) in table.items():
        put(f"{port}/gids/{index}", gid)
        put(f"{port}/gid_attrs/types/{index}", kind)
        put(f"{port}/gid_attrs/ndevs/{index}", "lo")
    put("proc/sys/kernel/osrelease", "6.17.0-1032-nvidia")
    put("proc/cmdline", "ro quiet")
    put(
        "ip.json",
        json.dumps([{"ifname": "lo", "addr_info": [{"family": "inet", "local": address}]}]),
    )
    return [f"--root={root}", f"--ip-json={root / 'ip.json'}", "--timeout=2"]


def run_pair(
    work: Path, head: dict, worker: dict, *limit: str, link: dict | None = None
) -> subprocess.CompletedProcess:
    found = ansible_playbook()
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "sparkple_host_python": f"/usr/bin/env PYTHONPATH={ROOT} {sys.executable}",
    }
    work.mkdir(exist_ok=True)
    trees = {h: link_tree(work / f"{h}-tree", a, 5 if h == "spark-a" else 2)
             for h, a in LINK.items()}  # fmt: skip
    hosts: dict[str, dict[str, object]] = {
        **pair_hostvars(
            addresses=(LINK["spark-a"], LINK["spark-b"]), interface="lo", both=local,
            head={**head, "preflight_pair_link_check_args": trees["spark-a"]},
            worker={**worker, "preflight_pair_link_check_args": trees["spark-b"]},
        ),
        "spark-c": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
    }  # fmt: skip
    for host, more in (link or {}).items():
        hosts[host].update(more(work / f"{host}-tree") if callable(more) else more)
    (work / "hosts.json").write_text(json.dumps({"sparks": {"hosts": hosts}}))
    (work / "play.yml").write_text(PLAY)
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"))
    env.pop("ANSIBLE_CONFIG", None)
    cmd = [found, "-i", "hosts.json", "play.yml", *(("--limit", ",".join(limit)) if limit else ())]
    return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)


def fingerprint(node: dict) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "sparkple.cli", "inspect-table", node["preflight_pair_table_dir"],
         "--json"], capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    return json.loads(out)["fingerprint"]


def test_a_pair_built_from_one_checkpoint_agrees(tmp_path: Path, nodes: dict) -> None:
    run = run_pair(tmp_path, nodes["A"], nodes["A2"])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert fingerprint(nodes["A"]) == fingerprint(nodes["A2"])
    # both described themselves with what they read; the single Spark skipped the check
    seen = {h: json.loads((tmp_path / f"{h}.json").read_text())
            for h in ("spark-a", "spark-b", "spark-c")}  # fmt: skip
    assert seen["spark-c"] == {}
    head, worker = seen["spark-a"], seen["spark-b"]
    assert head["table_fingerprint"] == fingerprint(nodes["A"])
    assert head == {**worker, "host": "spark-a"}
    assert head["checkpoint_revision"] == REVISION and len(head["snapshot_manifest"]) == 64
    assert len(head["patch_manifest"]) == 64


def test_tables_from_different_checkpoints_are_refused_on_both(tmp_path: Path, nodes: dict) -> None:
    run = run_pair(tmp_path, nodes["A"], nodes["B"])
    assert run.returncode != 0
    out = run.stdout
    head, worker = fingerprint(nodes["A"]), fingerprint(nodes["B"])
    assert head != worker
    refusal = "pair p1: spark-a (head) and spark-b (worker) disagree, so neither starts"
    for host in ("spark-a", "spark-b"):
        (fatal,) = [line for line in out.splitlines() if line.startswith(f"fatal: [{host}]")]
        assert refusal in fatal, out[-4000:]
    assert f"PLE table fingerprint (sparkple inspect-table --json): spark-a has '{head}', " \
           f"spark-b has '{worker}'" in out  # fmt: skip
    # the checkpoints' own manifests differ too (other weights), the revision string does not
    assert "snapshot manifest sha256" in out and "checkpoint revision (" not in out


def test_a_revision_or_patch_manifest_apart_is_named(tmp_path: Path, nodes: dict) -> None:
    worker = {**nodes["A2"], "preflight_pair_checkpoint_revision": OTHER_REVISION}
    patches = tmp_path / "other-patches.json"
    patches.write_text(json.dumps({"profile": "vllm-0.33", "files": [{"path": "x.py"}]}))
    worker["preflight_pair_patch_manifest"] = str(patches)
    run = run_pair(tmp_path / "run", nodes["A"], worker)
    assert run.returncode != 0
    assert (
        f"checkpoint revision (model_checkpoint_revision): spark-a has '{REVISION}', "
        f"spark-b has '{OTHER_REVISION}'"
    ) in run.stdout
    assert "vLLM patch manifest sha256 (vllm_patches): spark-a has '" in run.stdout
    assert "PLE table fingerprint" not in run.stdout.split("disagree, so neither starts")[1]


def test_a_node_whose_link_is_not_ready_is_refused_naming_host_thing_and_fix(
    tmp_path: Path, nodes: dict
) -> None:
    # the worker's link at MTU 1500; the head pins a GID index that is not its link's entry
    run = run_pair(tmp_path, nodes["A"], nodes["A2"], link={
        "spark-b": lambda tree: {"preflight_pair_link_check_args":
                                 link_tree(tree, LINK["spark-b"], 2, mtu=1500)},
        "spark-a": {"sparkple_pair_ib_gid_index": 3}})  # fmt: skip
    assert run.returncode != 0
    fatal = {h: [ln for ln in run.stdout.splitlines() if ln.startswith(f"fatal: [{h}]")]
             for h in ("spark-a", "spark-b")}  # fmt: skip
    assert (
        "pair p1: spark-b: link interface lo has MTU 1500, not 9000: set MTU 9000 on both "
        "nodes' link" in fatal["spark-b"][0]
    ), run.stdout[-4000:]
    assert (
        "pair p1: spark-a: sparkple_pair_ib_gid_index is 3 (that entry is empty), but the RoCE "
        "v2 GID of 127.0.0.10 on lo is at index 5: remove sparkple_pair_ib_gid_index"
    ) in fatal["spark-a"][0]
    # neither went on to compare identities
    assert not (tmp_path / "spark-a.json").exists() and not (tmp_path / "spark-b.json").exists()


def test_a_node_whose_peer_is_silent_is_refused(tmp_path: Path, nodes: dict) -> None:
    # the worker's peer address is one nobody answers on the loopback link
    run = run_pair(tmp_path, nodes["A"], nodes["A2"],
                   link={"spark-a": {"sparkple_pair_link_address": "192.0.2.10"}})  # fmt: skip
    assert run.returncode != 0
    assert "pair p1: spark-b: the peer 192.0.2.10 does not answer over lo" in run.stdout


def test_a_node_without_its_peer_in_the_run_is_refused(tmp_path: Path, nodes: dict) -> None:
    run = run_pair(tmp_path, nodes["A"], nodes["A2"], "spark-a")
    assert run.returncode != 0
    assert "pair p1: spark-b has not described itself in this run" in run.stdout


def test_disagreements_name_both_hosts_and_both_values() -> None:
    head = {"host": "a", "checkpoint_revision": "r1", "snapshot_manifest": "m",
            "patch_manifest": "", "table_fingerprint": "f1"}  # fmt: skip
    assert disagreements(head, {**head, "host": "b"}) == []
    found = disagreements(
        head, {**head, "host": "b", "patch_manifest": "p", "table_fingerprint": ""}
    )
    assert found == [
        "vLLM patch manifest sha256 (vllm_patches): a has none, b has 'p'",
        "PLE table fingerprint (sparkple inspect-table --json): a has 'f1', b has none",
    ]
    both_empty = {"host": "a"}
    assert disagreements(both_empty, {"host": "b"}) == [
        "checkpoint revision (model_checkpoint_revision): neither a nor b has one",
        "PLE table fingerprint (sparkple inspect-table --json): neither a nor b has one",
    ]
