"""The release role on this machine (connection local): ids, staging, links, rollback, pruning.

Each test runs the real role with ansible-playbook against real files in a temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_local import run_playbook
from hf_snapshot import hf_cache_snapshot

pytestmark = pytest.mark.slow  # about 3 s per ansible-playbook run on an idle machine

ROOT = Path(__file__).resolve().parents[2]
LAB_ROLE = ROOT / "molecule" / "fleet" / "roles" / "lab_release_service"

PLAYBOOK = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role: {name: release}
    - ansible.builtin.include_role: {name: release, tasks_from: activate}
      when: step == 'activate'
    - ansible.builtin.include_role: {name: release, tasks_from: rollback}
      when: step == 'rollback'
    - ansible.builtin.include_role: {name: release, tasks_from: deploy}
      when: step == 'deploy'
    - ansible.builtin.copy:
        content: "{{ {'id': release_id, 'current': release_current_id,
                      'previous': release_previous_id} | to_json }}"
        dest: "{{ out }}"
        mode: "0644"
"""


ROOT = Path(__file__).resolve().parents[2]


def build_table(root: Path, table: Path, seed: int) -> None:
    """A real published table (`sparkple build-table`) from a small synthetic checkpoint."""
    snapshot = hf_cache_snapshot(root / f"checkpoint-{seed}", files=2, seed=seed)
    build = [sys.executable, "-m", "sparkple.cli", "build-table", str(snapshot), str(table),
             "--quiet"]  # fmt: skip
    subprocess.run(build, check=True, capture_output=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict[str, Path]:
    """Two builds of one checkpoint (as two Sparks make them) and one of another."""
    root = tmp_path_factory.mktemp("release-tables")
    built = {}
    for name, seed in (("a", 1), ("a2", 1), ("b", 2)):
        built[name] = root / name
        build_table(root / f"{name}-src", built[name], seed)
    return built


@pytest.fixture
def site(tmp_path: Path, tables: dict[str, Path]) -> Path:
    shutil.copytree(tables["a"], tmp_path / "table")
    patches = tmp_path / "patches"
    (patches / "models").mkdir(parents=True)
    (patches / "models" / "x.py").write_text("x = 1\n")
    (patches / "manifest.json").write_text(json.dumps({"files": [{"path": "models/x.py"}]}))
    # the service role a deploy runs: records which release it was handed
    tasks = tmp_path / "roles" / "record_service" / "tasks"
    tasks.mkdir(parents=True)
    (tasks / "main.yml").write_text(
        "- ansible.builtin.copy:\n"
        "    content: '{{ release_run_dir }}'\n"
        f"    dest: {tmp_path / 'served'}\n"
        "    mode: '0644'\n"
    )
    return tmp_path


def run(site: Path, action: str = "stage", **extra: str) -> tuple[dict, int]:
    variables: dict[str, object] = {
        "sparkple_release_dir": str(site / "releases"),
        "sparkple_table_dir": str(site / "table"),
        # the host's Python with the checkout's package (sparkple inspect-table)
        "sparkple_host_python": sys.executable,
        "release_patch_dir": str(site / "patches"),
        "release_patch_profile": "vllm-0.33",
        "release_vllm_path": "/usr/lib/python3/dist-packages/vllm",
        "release_image": "sha256:" + "a" * 64,
        "release_name": "A",
        "release_service_role": "record_service",
        "step": action,
        "out": str(site / "out.json"),
        **extra,
    }
    (site / "out.json").unlink(missing_ok=True)
    proc = run_playbook(site, PLAYBOOK, variables, more_roles=site / "roles", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recap = re.search(r"localhost\s*:.*changed=(\d+)", proc.stdout)
    assert recap is not None, proc.stdout
    changed = int(recap.group(1))
    return json.loads((site / "out.json").read_text()), changed - 1  # minus the copy of out.json


def test_release_is_staged_whole_and_named_by_its_inputs(
    site: Path, tables: dict[str, Path]
) -> None:
    first, changed = run(site)
    release = site / "releases" / first["id"]
    assert changed > 0
    assert re.fullmatch(r"[0-9a-f]{16}", first["id"])
    recorded = json.loads((release / "release.json").read_text())
    assert recorded["id"] == first["id"]
    assert recorded["inputs"]["patch_files"] == ["models/x.py"]
    assert (release / "patches" / "models" / "x.py").read_text() == "x = 1\n"
    assert not (site / "releases" / (first["id"] + ".partial")).exists()
    again, changed = run(site)
    assert again["id"] == first["id"] and changed == 0
    # each node of a pair builds its own table (other build names and times in table.json): the
    # id comes from the table's fingerprint, so both nodes compute the same one, and the pair
    # link's and the rank check's comparison of ids holds
    assert (tables["a"] / "table.json").read_bytes() != (tables["a2"] / "table.json").read_bytes()
    shutil.rmtree(site / "table")
    shutil.copytree(tables["a2"], site / "table")
    assert run(site)[0]["id"] == first["id"]
    # the inputs make the id: a new name, or a table from another checkpoint, is a new release
    assert run(site, release_name="B")[0]["id"] != first["id"]
    shutil.rmtree(site / "table")
    shutil.copytree(tables["b"], site / "table")
    assert run(site)[0]["id"] != first["id"]


def test_activate_keeps_the_previous_release_and_rollback_returns_to_it(site: Path) -> None:
    a, _ = run(site, "activate")
    assert a["current"] == a["id"] and a["previous"] == ""
    b, _ = run(site, "activate", release_name="B")
    assert b["current"] == b["id"] and b["previous"] == a["id"]
    c, _ = run(site, "activate", release_name="C")
    # only the current and the previous release stay on disk
    assert sorted(p.name for p in (site / "releases").iterdir() if not p.is_symlink()) == sorted(
        [b["id"], c["id"]]
    )
    back, _ = run(site, "rollback", release_name="C")
    assert back["current"] == b["id"] and back["previous"] == c["id"]
    assert (site / "releases" / "current" / "release.json").is_file()


def test_a_missing_table_stops_with_what_to_do(site: Path) -> None:
    (site / "table" / "table.json").unlink()
    with pytest.raises(AssertionError, match="No published table at .*ple_table"):
        run(site)


def test_a_release_refuses_a_table_rebuilt_since_it_was_made(
    site: Path, tables: dict[str, Path]
) -> None:
    """ple_table rebuilds in place: neither a rollback nor a deploy may pair the new table with
    an old release's patches."""
    a, _ = run(site, "activate")
    run(site, "deploy")
    assert (site / "served").read_text() == str(site / "releases" / a["id"])
    b, _ = run(site, "activate", release_name="B")
    shutil.rmtree(site / "table")
    shutil.copytree(tables["b"], site / "table")  # rebuilt in place from another checkpoint
    (site / "served").unlink()
    with pytest.raises(AssertionError, match=r"was made with the table .* \(rebuilt since\)"):
        run(site, "rollback", release_name="B")
    links = site / "releases"
    assert os.readlink(links / "current") == b["id"], "the links were left as they were"
    with pytest.raises(AssertionError, match=r"Release [0-9a-f]{16} \(B\) was made with the table"):
        run(site, "deploy", release_name="B")
    assert not (site / "served").exists(), "nothing was started"


def test_a_deploy_hands_the_service_its_release_id_and_manifest_hash(site: Path) -> None:
    """The release's id and the sha256 of its patch manifest reach the serving unit's
    environment (SPARKPLE_RELEASE_ID, SPARKPLE_PATCH_MANIFEST_SHA256), where a pair's ranks
    compare them at load: through vllm_service's variables on a Spark (a stand-in vllm_service
    beside the playbook records what the real release role hands it), and in the lab pair's unit
    (the fleet scenario's lab_release_service template, rendered for real)."""
    vllm_service = site / "roles" / "vllm_service" / "tasks"
    vllm_service.mkdir(parents=True)
    (vllm_service / "main.yml").write_text(
        "- ansible.builtin.copy:\n"
        "    content: \"{{ {'release_id': vllm_service_release_id | default('UNSET'),\n"
        "                   'manifest': vllm_service_patch_manifest_sha256 | default('UNSET'),\n"
        "                   'patch_dir': vllm_service_patch_dir} | to_json }}\"\n"
        f"    dest: {site / 'vllm_service.json'}\n"
        "    mode: '0644'\n"
    )
    lab_unit = site / "roles" / "lab_unit"
    (lab_unit / "meta").mkdir(parents=True)
    (lab_unit / "meta" / "main.yml").write_text("dependencies: [{role: sparkple_common}]\n")
    (lab_unit / "tasks").mkdir()
    (lab_unit / "tasks" / "main.yml").write_text(
        "- ansible.builtin.include_vars:\n"
        f"    file: {LAB_ROLE / 'defaults' / 'main.yml'}\n"
        "- ansible.builtin.template:\n"
        f"    src: {LAB_ROLE / 'templates' / 'lab-release.service.j2'}\n"
        f"    dest: {site / 'lab.service'}\n"
        "    mode: '0644'\n"
    )
    a, _ = run(site, "activate")
    manifest_sha256 = hashlib.sha256((site / "patches" / "manifest.json").read_bytes()).hexdigest()
    run(site, "deploy", release_service_role="vllm_service")
    handed = json.loads((site / "vllm_service.json").read_text())
    assert handed == {
        "release_id": a["id"],
        "manifest": manifest_sha256,
        "patch_dir": str(site / "releases" / a["id"] / "patches"),
    }
    run(site, "deploy", release_service_role="lab_unit")
    environment = re.findall(r"^Environment=(\w+)=(.*)$", (site / "lab.service").read_text(), re.M)
    assert ("SPARKPLE_RELEASE_ID", a["id"]) in environment
    assert ("SPARKPLE_PATCH_MANIFEST_SHA256", manifest_sha256) in environment


def test_the_ple_backend_is_part_of_the_release(site: Path) -> None:
    """An A/B release (sparkple_ple_backend vllm-disk or vllm-pinned) has an id of its own and
    hands its backend and patch profile to vllm_service; a packed release keeps the id it had
    before the knob (nothing recorded); vllm-disk under the vllm-0.33 profile is refused before
    anything is staged."""
    vllm_service = site / "roles" / "vllm_service" / "tasks"
    vllm_service.mkdir(parents=True)
    (vllm_service / "main.yml").write_text(
        "- ansible.builtin.copy:\n"
        "    content: \"{{ {'backend': vllm_service_ple_backend | default('UNSET'),\n"
        "                   'profile': vllm_service_patch_profile | default('UNSET')}\n"
        '                  | to_json }}"\n'
        f"    dest: {site / 'vllm_service.json'}\n"
        "    mode: '0644'\n"
    )
    packed, _ = run(site)
    assert run(site, sparkple_ple_backend="packed")[0]["id"] == packed["id"]
    recorded = json.loads((site / "releases" / packed["id"] / "release.json").read_text())
    assert recorded["inputs"]["service"] == {"extra_args": []}
    ids = {packed["id"]}
    for backend in ("vllm-disk", "vllm-pinned"):
        made, _ = run(site, "activate", sparkple_ple_backend=backend,
                      release_patch_profile="vllm-0.34")  # fmt: skip
        assert made["id"] not in ids
        ids.add(made["id"])
        inputs = json.loads((site / "releases" / made["id"] / "release.json").read_text())
        assert inputs["inputs"]["service"] == {"extra_args": [], "ple_backend": backend}
        run(site, "deploy", sparkple_ple_backend=backend, release_patch_profile="vllm-0.34",
            release_service_role="vllm_service")  # fmt: skip
        handed = json.loads((site / "vllm_service.json").read_text())
        assert handed == {"backend": backend, "profile": "vllm-0.34"}
    staged = sorted(p.name for p in (site / "releases").iterdir())
    refused = r"vllm-disk, but the release's vLLM patch profile is vllm-0\.33 .*needs vLLM 0\.34"
    with pytest.raises(AssertionError, match=f"sparkple_ple_backend is {refused}"):
        run(site, sparkple_ple_backend="vllm-disk")
    assert sorted(p.name for p in (site / "releases").iterdir()) == staged
    # the role's argument spec names the choices
    with pytest.raises(
        AssertionError, match="release_ple_backend must be one of: packed, vllm-disk"
    ):
        run(site, sparkple_ple_backend="vllm-nvme")


def test_the_rollout_refuses_a_release_its_plan_refuses_before_draining_anything(
    site: Path, tables: dict[str, Path]
) -> None:
    """playbooks/rollout.yml's check play plans the new release's server (recipe, budget, PLE
    backend) on every host before the canary's drain: a release that asks for vLLM's own disk
    offload beside the packed table stops the rollout there, with the knob to change."""
    snapshot = hf_cache_snapshot(site / "model", files=2, seed=1)
    variables = {
        "ansible_become": False,
        "rollout_group": "all",
        "sparkple_data_dir": str(site),
        "sparkple_release_dir": str(site / "releases"),
        "sparkple_table_dir": str(site / "table"),
        "sparkple_host_python": sys.executable,
        "model_checkpoint_snapshot_dir": str(snapshot),
        "release_patch_dir": str(site / "patches"),
        "release_patch_profile": "vllm-0.34",
        "release_vllm_path": "/usr/lib/python3/dist-packages/vllm",
        "release_image": "sha256:" + "a" * 64,
        "release_name": "A",
        "release_service_vars": {"extra_args": ['--engram-config={"disk_offload": true}']},
    }
    proc = run_playbook(site, ROOT / "playbooks" / "rollout.yml", variables)
    assert proc.returncode != 0, proc.stdout
    assert "Plan the new release's server, or refuse it before anything is stopped" in proc.stdout
    assert "drop disk_offload from vllm_service_extra_args" in proc.stdout, proc.stdout[-3000:]
    assert "PLAY [Canary]" not in proc.stdout, "no host was drained or stopped"
    assert not (site / "releases").exists() or not any((site / "releases").iterdir())


def test_the_package_version_is_part_of_the_release(site: Path) -> None:
    """A release records the package version the host runs (sparkple_package's link), so a new
    package makes a new release, and its deploy mounts that version, not the link: a rollback
    brings back the package the release ran with."""
    vllm_service = site / "roles" / "vllm_service" / "tasks"
    vllm_service.mkdir(parents=True)
    # like the real one, it stands on sparkple_common (the shared names)
    (vllm_service.parent / "meta").mkdir()
    (vllm_service.parent / "meta" / "main.yml").write_text("dependencies: [sparkple_common]\n")
    (vllm_service / "main.yml").write_text(
        "- ansible.builtin.copy:\n"
        "    content: \"{{ {'package_dir': vllm_service_package_dir} | to_json }}\"\n"
        f"    dest: {site / 'vllm_service.json'}\n"
        "    mode: '0644'\n"
    )
    package, versions = site / "opt" / "sparkple", site / "opt" / "sparkple.versions"
    first, second = "1" * 64, "2" * 64
    for fingerprint in (first, second):
        (versions / fingerprint[:16]).mkdir(parents=True)
        (versions / fingerprint[:16] / ".fingerprint").write_text(fingerprint + "\n")
    package.symlink_to(versions / first[:16])
    where = {"sparkple_package_dir": str(package)}
    a, _ = run(site, "activate", **where)
    recorded = json.loads((site / "releases" / a["id"] / "release.json").read_text())
    assert recorded["inputs"]["package"] == first
    package.unlink()
    package.symlink_to(versions / second[:16])  # sparkple_package switched to a new version
    b, _ = run(site, "activate", **where)
    assert b["id"] != a["id"]
    back, _ = run(site, "rollback", **where)
    assert back["current"] == a["id"]
    run(site, "deploy", release_service_role="vllm_service", **where)
    handed = json.loads((site / "vllm_service.json").read_text())
    assert handed == {"package_dir": str(versions / first[:16])}
