"""The serving unit of a pair's nodes and of a single Spark, rendered by a real ansible-playbook
run from vllm_service's own template, with the plans `sparkple serving-plan` computes for each
(per rank on the pair's nodes) from a real synthetic snapshot.

The words of `ExecStart=` are read back as systemd reads them (double-quoted, `\\` escapes, `$$`
and `%%` doubled), so what is asserted is the `docker run` each host runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from ansible_local import ansible_playbook
from hf_snapshot import hf_cache_snapshot
from pair_inventory import HEAD_ADDRESS, WORKER_ADDRESS, pair_hostvars

from sparkple.serving.budget import GIB, BudgetKnobs
from sparkple.serving.cli import PairRank, plan
from sparkple.serving.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_service"
RELEASE, MANIFEST = "1f0c2a9be47d3e55", "c0ffee" + "0" * 58
# hosts whose unit serves vLLM's own PLE backend (sparkple_ple_backend) instead of the packed table
BACKENDS = {"spark-e": "vllm-disk", "spark-f": "vllm-pinned"}


def exec_start(unit: str) -> list[str]:
    """The words of ExecStart=, unquoted as systemd does for this template's quoting."""
    (line,) = re.findall(r"^ExecStart=(.*?)\n(?!    )", unit, re.M | re.S)
    words = re.findall(r'"((?:[^"\\]|\\.)*)"|(\S+)', line.replace(" \\\n    ", " "))
    out = []
    for quoted, bare in words:
        word = re.sub(r"\\(.)", r"\1", quoted) if quoted else bare
        out.append(word.replace("$$", "$").replace("%%", "%"))
    return out


def pairs(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag]


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> dict[str, str]:
    found = ansible_playbook()
    work = tmp_path_factory.mktemp("unit")
    snapshot = hf_cache_snapshot(work, files=2, seed=7)
    recipe = Recipe(model="/models/m/snapshots/rev", served_model_name="qwen3.8-flash-next")
    memtotal = int(119.7 * GIB)
    ranks = {
        "spark-a": PairRank(0, HEAD_ADDRESS, 29501),
        "spark-b": PairRank(1, HEAD_ADDRESS, 29501),
    }
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
             "model_checkpoint_snapshot_dir": str(snapshot),
             "sparkple_image": "sparkple:test"}  # fmt: skip
    hosts: dict[str, dict[str, object]] = {
        # a cross-wired worker, and ulimits without memlock: the pair adds it
        **pair_hostvars(
            hcas=("rocep1s0f1", "roceP2p1s0f1"),
            worker={"sparkple_pair_ib_gid_index": 1, "vllm_service_ulimits": ["stack=67108864"]},
        ),
        "spark-c": {"vllm_patches_manifest_sha256": MANIFEST},  # the hash by vllm_patches' fact
        "spark-d": {},  # unpatched, outside a rollout
        # spark-c's unit with vLLM's own PLE backends, for A/B runs (sparkple_ple_backend)
        **{host: {"vllm_patches_manifest_sha256": MANIFEST} for host in BACKENDS},
    }
    # the id and the hash as the release role's deploy hands them (spark-c: the id only)
    for host in ("spark-a", "spark-b", "spark-c", *BACKENDS):
        hosts[host]["vllm_service_release_id"] = RELEASE
    for host in ("spark-a", "spark-b"):
        hosts[host]["vllm_service_patch_manifest_sha256"] = MANIFEST
    for host, hv in hosts.items():
        backend = BACKENDS.get(host, "packed")
        the_plan = plan(snapshot, replace(recipe, ple_backend=backend), BudgetKnobs(), memtotal,
                        ranks.get(host), patch_profile="vllm-0.34")  # fmt: skip
        hv.update(local, vllm_service_plan=the_plan)
    (work / "hosts.json").write_text(json.dumps({"sparks": {"hosts": hosts}}))
    # the role's defaults and vars below the host vars, as the role's defaults are
    (work / "group_vars" / "all").mkdir(parents=True)
    for part in ("defaults", "vars"):
        shutil.copy(ROLE / part / "main.yml", work / "group_vars" / "all" / f"{part}.yml")
    (work / "play.yml").write_text(
        "- hosts: sparks\n  gather_facts: false\n  roles: [sparkple_common]\n  tasks:\n"
        "    - ansible.builtin.template:\n"
        f"        src: {ROLE}/templates/vllm.service.j2\n"
        "        dest: '{{ playbook_dir }}/{{ inventory_hostname }}.service'\n"
        "        mode: '0644'\n"
    )
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"),
               ANSIBLE_FILTER_PLUGINS=str(ROLE / "filter_plugins"))  # fmt: skip
    env.pop("ANSIBLE_CONFIG", None)
    run = subprocess.run([found, "-i", "hosts.json", "play.yml"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return {h: (work / f"{h}.service").read_text() for h in hosts}


def test_each_node_of_the_pair_gets_its_flags_env_and_devices(units: dict[str, str]) -> None:
    head, worker, single = (exec_start(units[h]) for h in ("spark-a", "spark-b", "spark-c"))
    for words in (head, worker, single):
        assert pairs(words, "--network") == ["host"] and pairs(words, "--ipc") == ["host"]
    for words in (head, worker):
        assert pairs(words, "--device") == ["/dev/infiniband"]
        assert pairs(words, "--ulimit").count("memlock=-1") == 1
        assert words[words.index("--distributed-executor-backend=mp") + 1 :][:5] == [
            "--tensor-parallel-size=2", "--nnodes=2", f"--node-rank={int(words is worker)}",
            f"--master-addr={HEAD_ADDRESS}", "--master-port=29501",
        ]  # fmt: skip
    assert "--headless" in worker and "--headless" not in head
    assert "--ulimit" in worker and pairs(worker, "--ulimit") == ["stack=67108864", "memlock=-1"]
    env = {h: dict(e.split("=", 1) for e in pairs(exec_start(units[h]), "--env")) for h in units}
    link = ("NCCL", "GLOO", "VLLM_")
    # IB forced (a missing IB path fails NCCL's init), its init lines logged for the head's
    # check; no GID index on the command line: the link check finds it at each start
    assert {k: v for k, v in env["spark-b"].items() if k.startswith(link)} == {
        "VLLM_HOST_IP": WORKER_ADDRESS,
        "NCCL_SOCKET_IFNAME": "enp1s0f1np1",
        "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
        "NCCL_NET": "IB",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_HCA": "roceP2p1s0f1",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
    }  # fmt: skip
    assert (env["spark-a"]["VLLM_HOST_IP"], env["spark-a"]["NCCL_IB_HCA"]) == (
        HEAD_ADDRESS,
        "rocep1s0f1",
    )
    assert "NCCL_IB_GID_INDEX" not in env["spark-a"]
    assert "# Pair p1: the worker (rank 1; head spark-a, worker spark-b)." in units["spark-b"]
    assert "Budget" in units["spark-a"] and "Per rank (rank 0 of 2" in units["spark-a"]


def exec_start_pre(unit: str) -> list[list[str]]:
    """Each ExecStartPre= command's words, unquoted as systemd does."""
    lines = re.findall(r"^ExecStartPre=(.*)$", unit, re.M)
    return [exec_start(f"ExecStart={line}\n") for line in lines]


def test_each_node_checks_its_link_before_each_start(units: dict[str, str]) -> None:
    checks = {h: [c for c in exec_start_pre(units[h]) if "pair-link-check" in c] for h in units}
    assert checks["spark-c"] == [] and "pair-link-check" not in units["spark-c"]
    (worker,) = checks["spark-b"]
    env_file = "/run/sparkple-vllm-link.env"
    # the check runs after the memory gate, with this node's side of the link and the pinned
    # index to verify; the index it finds reaches docker through its env file
    assert worker[worker.index("pair-link-check") :] == [
        "pair-link-check", "--host=spark-b", "--interface=enp1s0f1np1",
        f"--address={WORKER_ADDRESS}", f"--peer-address={HEAD_ADDRESS}", "--peer-port=29501",
        "--mtu=9000", "--transport=ib", "--ib-hca=roceP2p1s0f1", "--gid-index=1",
        f"--env-file={env_file}",
    ]  # fmt: skip
    (head,) = checks["spark-a"]
    assert f"--peer-address={WORKER_ADDRESS}" in head and not [w for w in head if "gid-index" in w]
    pre = re.findall(r"^ExecStartPre=.*?(launch-gate|pair-link-check)", units["spark-a"], re.M)
    assert pre == ["launch-gate", "pair-link-check"]
    for host in ("spark-a", "spark-b"):
        assert pairs(exec_start(units[host]), "--env-file")[-1] == env_file
    assert len(pairs(exec_start(units["spark-c"]), "--env-file")) == 1


def test_a_single_spark_unit_has_nothing_of_a_pair(units: dict[str, str]) -> None:
    single = exec_start(units["spark-c"])
    assert "--device" not in single and "--headless" not in single
    assert pairs(single, "--ulimit") == ["memlock=-1", "stack=67108864"]
    assert not [w for w in single if w.startswith(("--nnodes", "--tensor-parallel", "--master"))]
    env = dict(e.split("=", 1) for e in pairs(single, "--env"))
    assert not [k for k in env if k.startswith(("NCCL", "GLOO", "VLLM_HOST"))]
    assert "Pair" not in units["spark-c"] and "Per rank" not in units["spark-c"]
    # the head's unit is the single Spark's plus the pair's words, its own budget aside
    head = exec_start(units["spark-a"])
    pair_env = [e for e in pairs(head, "--env") if e.startswith(("NCCL", "GLOO", "VLLM_HOST"))]
    added = [["--device", "/dev/infiniband"], ["--env-file", "/run/sparkple-vllm-link.env"],
             *(["--env", e] for e in pair_env),
             ["--tensor-parallel-size=2", "--nnodes=2", "--node-rank=0",
              f"--master-addr={HEAD_ADDRESS}", "--master-port=29501"]]  # fmt: skip
    assert budgetless(without(head, added)) == budgetless(single)


def test_the_unit_names_its_release_to_the_engine(units: dict[str, str]) -> None:
    """The engine's rank check compares these on a pair's two nodes; empty where the unit has
    no release (outside a rollout) or no patches."""
    named = ("SPARKPLE_RELEASE_ID", "SPARKPLE_PATCH_MANIFEST_SHA256")
    for host, expected in (("spark-a", (RELEASE, MANIFEST)), ("spark-b", (RELEASE, MANIFEST)),
                           ("spark-c", (RELEASE, MANIFEST)), ("spark-d", ("", ""))):  # fmt: skip
        words = pairs(exec_start(units[host]), "--env")
        env = dict(e.split("=", 1) for e in words)
        assert tuple(env[name] for name in named) == expected, host
        assert [w.split("=", 1)[0] for w in words].count(named[0]) == 1


def without(words: list[str], parts: list[list[str]]) -> list[str]:
    """words with each of parts (a run of words) taken out once; a part not there fails."""
    for part in parts:
        starts = [i for i in range(len(words)) if words[i : i + len(part)] == part]
        assert starts, f"{part} is not in the unit"
        words = words[: starts[0]] + words[starts[0] + len(part) :]
    return words


def budgetless(words: list[str]) -> list[str]:
    """The words with the budget's values (each rank's own) blanked."""
    out = []
    for i, w in enumerate(words):
        if i and words[i - 1] in ("--memory", "--memory-swap"):
            w = "<budget>"
        out.append("--gpu-memory-utilization=<budget>" if w.startswith("--gpu-memory-") else w)
    return out


def test_vllms_own_backends_drop_the_packed_table_and_add_their_engram_config(
    units: dict[str, str],
) -> None:
    """An A/B unit is the packed one less SPARKPLE_PLE_TABLE_DIR and the table's mount, plus the
    backend's --engram-config; the patches stay mounted (inert without the variable)."""
    packed = exec_start(units["spark-c"])
    table = "/ple/table"
    assert "--env" in packed and f"SPARKPLE_PLE_TABLE_DIR={table}" in pairs(packed, "--env")
    (table_mount,) = [v for v in pairs(packed, "--volume") if v.endswith(f":{table}:ro")]
    assert not [w for w in packed if w.startswith("--engram-config")]
    for host, engram in (("spark-e", '{"disk_offload":true}'), ("spark-f", '{"cpu_offload":true}')):
        words = exec_start(units[host])
        env = dict(e.split("=", 1) for e in pairs(words, "--env"))
        assert "SPARKPLE_PLE_TABLE_DIR" not in env and table_mount not in pairs(words, "--volume")
        assert env["SPARKPLE_RELEASE_ID"] == RELEASE and env["PYTHONPATH"] == "/opt/sparkple"
        assert [w for w in words if w.startswith("--engram-config")] == [
            f"--engram-config={engram}"
        ]
        added = [[f"--engram-config={engram}"]]
        removed = [["--env", f"SPARKPLE_PLE_TABLE_DIR={table}"], ["--volume", table_mount]]
        assert budgetless(without(words, added)) == budgetless(without(packed, removed))
        name = BACKENDS[host]
        assert f"with vLLM's own PLE backend {name} (an A/B run: no packed table)." in units[host]
    assert "with the PLE table read from NVMe." in units["spark-c"]


def test_the_jit_caches_are_kept_on_the_data_volume(units: dict[str, str]) -> None:
    """Triton's, inductor's and FlashInfer's JIT caches live under vLLM's cache directory, the
    data volume's vllm-cache mounted read-write: the --rm container keeps them across starts."""
    for host in ("spark-a", "spark-c", "spark-d"):
        words = exec_start(units[host])
        env = dict(e.split("=", 1) for e in pairs(words, "--env"))
        (cache,) = [v for v in pairs(words, "--volume") if v.endswith(":/root/.cache/vllm:rw")]
        assert cache.startswith("/") and "vllm-cache" in cache, cache
        assert env["TRITON_CACHE_DIR"] == "/root/.cache/vllm/triton"
        assert env["TORCHINDUCTOR_CACHE_DIR"] == "/root/.cache/vllm/inductor"
        assert env["FLASHINFER_WORKSPACE_BASE"] == "/root/.cache/vllm/flashinfer"


def test_the_unit_starts_vllm_serve_itself(units: dict[str, str]) -> None:
    """`--entrypoint vllm` and `serve` after the image: the unit does not rely on the image's own
    entrypoint (vllm/vllm-openai's is `vllm serve`, NGC's vLLM image has none)."""
    for host in ("spark-a", "spark-c", "spark-d"):
        words = exec_start(units[host])
        image = words.index("sparkple:test")
        assert pairs(words[:image], "--entrypoint") == ["vllm"], host
        assert words[image + 1] == "serve", words[image : image + 3]
