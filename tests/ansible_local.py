"""Run a playbook on this machine (connection local) with the checkout's roles: how the role
tests drive a real role without a Spark or a container."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ansible_playbook() -> str:
    """The ansible-playbook beside this Python (the checkout's venv), else the one on PATH."""
    beside = Path(sys.executable).parent / "ansible-playbook"
    found = str(beside) if beside.exists() else shutil.which("ansible-playbook")
    if not found:
        pytest.skip("ansible-playbook is not installed (run .ci/setup-venv)")
    return found


def run_playbook(
    workdir: Path,
    playbook: str | Path,
    variables: dict[str, object],
    *,
    more_roles: Path | None = None,
    inventory: Mapping[str, object] | None = None,
    timeout: int = 180,
) -> subprocess.CompletedProcess[str]:
    """Run `playbook` (its text, written to workdir/play.yml, or a playbook file) with
    `variables` as -e: on localhost (connection local), or on `inventory` (written to
    workdir/hosts.yml; its hosts say how they are reached)."""
    found = ansible_playbook()
    if isinstance(playbook, str):
        (workdir / "play.yml").write_text(playbook)
        playbook = Path("play.yml")
    roles_path = str(ROOT / "roles") + (f":{more_roles}" if more_roles else "")
    env = dict(os.environ, ANSIBLE_ROLES_PATH=roles_path)
    env.pop("ANSIBLE_CONFIG", None)  # cwd is workdir: no ansible.cfg of the checkout applies
    variables = {"ansible_python_interpreter": sys.executable, **variables}
    hosts = ["-i", "localhost,", "-c", "local"]
    if inventory is not None:
        (workdir / "hosts.yml").write_text(json.dumps(inventory))
        hosts = ["-i", "hosts.yml"]
    return subprocess.run(
        [found, *hosts, str(playbook), "-e", json.dumps(variables)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
