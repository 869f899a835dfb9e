"""The roles share their paths and names through sparkple_common alone.

Every role depends on sparkple_common; no other role or playbook restates the data volume's
path, the service's name or the state directory, no file falls back on a literal for a shared
name, and no file reaches outside its role's directory through role_path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "roles" / "sparkple_common"
ROLES = sorted(p for p in (ROOT / "roles").iterdir() if p.is_dir() and p != COMMON)
SHARED = yaml.safe_load((COMMON / "defaults" / "main.yml").read_text())


def ansible_files(
    tops: tuple[str, ...] = ("roles", "playbooks", "molecule", "inventory"),
) -> list[Path]:
    found = []
    for top in tops:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in {".yml", ".j2"} and COMMON not in path.parents:
                found.append(path)
    return sorted(found)


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_every_role_depends_on_the_shared_names(role: Path) -> None:
    meta = yaml.safe_load((role / "meta" / "main.yml").read_text())
    deps = [d["role"] if isinstance(d, dict) else d for d in meta.get("dependencies") or []]
    assert "sparkple_common" in deps, f"{role.name}/meta/main.yml lacks sparkple_common"


def test_no_file_restates_a_shared_literal() -> None:
    literals = [
        SHARED[name]
        for name in ("sparkple_data_dir", "sparkple_service_name", "sparkple_state_dir")
    ]
    offenders = [
        f"{path.relative_to(ROOT)}: {literal}"
        # molecule's verify plays check the live state against the values themselves, on purpose
        for path in ansible_files(("roles", "playbooks"))
        for literal in literals
        if re.search(re.escape(literal) + r"(?![\w-])", path.read_text())
    ]
    assert not offenders, "shared literals outside sparkple_common:\n" + "\n".join(offenders)


def test_no_shared_name_falls_back_on_a_literal() -> None:
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, SHARED)) + r")\s*\|\s*default\(")
    offenders = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in ansible_files()
        for m in pattern.finditer(path.read_text())
        if "hostvars[" not in path.read_text()[max(0, m.start() - 40) : m.start()]
    ]
    assert not offenders, "shared names default in sparkple_common only:\n" + "\n".join(offenders)


def test_no_role_reaches_outside_its_directory() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in ansible_files()
        if re.search(r"role_path\s*\}\}\s*/\.\.|role_path\s*~\s*'/\.\.", path.read_text())
    ]
    assert not offenders, "files reached through role_path/..:\n" + "\n".join(offenders)


RENAMED = yaml.safe_load((COMMON / "vars" / "main.yml").read_text())["sparkple_common_renamed"]


def test_no_file_reads_a_retired_name() -> None:
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, RENAMED)) + r")\b")
    offenders = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in ansible_files()
        for m in pattern.finditer(path.read_text())
    ]
    assert not offenders, "retired names still read (sparkple_common refuses them):\n" + "\n".join(
        offenders
    )


def run_common(tmp_path: Path, variables: dict[str, object]) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "ansible-playbook"
    found = str(exe) if exe.exists() else shutil.which("ansible-playbook")
    if not found:
        pytest.skip("ansible-playbook is not installed (run .ci/setup-venv)")
    (tmp_path / "play.yml").write_text(
        "- hosts: localhost\n  gather_facts: false\n  roles: [sparkple_common]\n"
    )
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"))
    env.pop("ANSIBLE_CONFIG", None)
    variables = {"ansible_python_interpreter": sys.executable, **variables}
    return subprocess.run(
        [found, "-i", "localhost,", "-c", "local", "play.yml", "-e", json.dumps(variables)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_retired_name_in_the_inventory_is_refused_with_its_replacement(tmp_path: Path) -> None:
    proc = run_common(tmp_path, {"vllm_service_host": "0.0.0.0", "ple_table_dir": "/data/t"})
    assert proc.returncode != 0, proc.stdout
    assert "ple_table_dir, vllm_service_host no longer have any effect" in proc.stdout
    assert "ple_table_dir -> sparkple_table_dir, vllm_service_host -> sparkple_api_host" in (
        " ".join(proc.stdout.split())
    )


def test_the_shared_names_alone_pass(tmp_path: Path) -> None:
    proc = run_common(tmp_path, {"sparkple_api_host": "0.0.0.0", "sparkple_data_dir": "/data"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
