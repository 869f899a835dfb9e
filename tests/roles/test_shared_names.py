"""The roles share their paths and names through sparkple_common alone.

Every role depends on sparkple_common; no other role or playbook restates the data volume's
path, the service's name or the state directory, no file falls back on a literal for a shared
name, and only sparkple_package (which ships the checkout) reaches outside its role's directory.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible_local import run_playbook

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


def matches(pattern: str, tops: tuple[str, ...] | None = None) -> list[str]:
    """Every `path: match` of pattern in the Ansible files (outside sparkple_common)."""
    files = ansible_files(tops) if tops else ansible_files()
    return [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in files
        for m in re.finditer(pattern, path.read_text())
    ]


def test_no_file_restates_a_shared_literal() -> None:
    names = ("sparkple_data_dir", "sparkple_service_name", "sparkple_state_dir")
    literals = "|".join(re.escape(SHARED[name]) for name in names)
    # molecule's verify plays check the live state against the values themselves, on purpose
    offenders = matches(rf"(?:{literals})(?![\w-])", ("roles", "playbooks"))
    assert not offenders, "shared literals outside sparkple_common:\n" + "\n".join(offenders)


def test_no_shared_name_falls_back_on_a_literal() -> None:
    # a host's own setting may win over the shared name: hostvars[host].<name> | default(<name>)
    names = "|".join(map(re.escape, SHARED))
    offenders = matches(rf"(?<!\]\.)\b(?:{names})\s*\|\s*default\(")
    assert not offenders, "shared names default in sparkple_common only:\n" + "\n".join(offenders)


def test_only_sparkple_package_reaches_outside_its_role() -> None:
    # shipping the checkout's package is sparkple_package's whole job: it alone names the
    # checkout (sparkple_package_src); every other file a role uses lies in the role itself
    outside = r"role_path\s*(?:\}\}\s*/\.\.|~\s*'/\.\.|\|\s*dirname)"
    offenders = [m for m in matches(outside) if not m.startswith("roles/sparkple_package/")]
    assert not offenders, "files reached outside the role:\n" + "\n".join(offenders)
    assert matches(outside, ("roles",)) == [
        "roles/sparkple_package/defaults/main.yml: role_path | dirname"
    ]


def run_common(tmp_path: Path, variables: dict[str, object]) -> subprocess.CompletedProcess[str]:
    play = "- hosts: localhost\n  gather_facts: false\n  roles: [sparkple_common]\n"
    return run_playbook(tmp_path, play, variables, timeout=120)


def test_the_shared_names_alone_pass(tmp_path: Path) -> None:
    proc = run_common(tmp_path, {"sparkple_api_host": "0.0.0.0", "sparkple_data_dir": "/data"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
