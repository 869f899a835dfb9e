"""The head's transport gate (vllm_service, tasks_from: transport, which the health gate imports
on a pair) through a real ansible-playbook run on an inventory that names a pair: `sparkple
pair-transport` asks systemd for the unit's start and the journal for its lines since then.

This machine runs no systemd, so `systemctl` and `journalctl` are two small scripts first on
PATH that answer as systemd 252 does and record the arguments they were called with; the journal
they serve is NCCL's init lines as a head logs them on IB and on a socket fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ansible_local import ansible_playbook
from pair_inventory import pair_hostvars

ROOT = Path(__file__).resolve().parents[2]
START = "@1764700000"
SYSTEMCTL = f"""#!/bin/sh
echo "$*" >> "$SHIM_CALLS"
echo {START}
"""
JOURNALCTL = """#!/bin/sh
echo "journalctl $*" >> "$SHIM_CALLS"
cat "$SHIM_JOURNAL"
"""
IB = "h:1:2 [0] NCCL INFO NET/IB : Using [0]rocep1s0f1:1/RoCE [RO]; OOB lo:127.0.0.1<0>\n" \
     "h:1:2 [0] NCCL INFO Using network IB\n"  # fmt: skip
SOCKET = "h:1:2 [0] NCCL INFO NET/IB : No device found.\nh:1:2 [0] NCCL INFO Using network Socket\n"


def run_gate(tmp_path: Path, journal: str, **more: object) -> subprocess.CompletedProcess:
    found = ansible_playbook()
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    for name, text in (("systemctl", SYSTEMCTL), ("journalctl", JOURNALCTL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    (tmp_path / "journal.txt").write_text(journal)
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "sparkple_host_python": f"/usr/bin/env PYTHONPATH={ROOT} {sys.executable}",
    }
    hosts = pair_hostvars(
        addresses=("127.0.0.10", "127.0.0.11"), interface="lo", both={**local, **more}
    )
    (tmp_path / "hosts.json").write_text(json.dumps({"sparks": {"hosts": hosts}}))
    (tmp_path / "play.yml").write_text(
        "- hosts: spark-a\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role:\n        name: vllm_service\n"
        "        tasks_from: transport\n"
    )
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"),
               PATH=f"{shims}{os.pathsep}{os.environ['PATH']}",
               SHIM_CALLS=str(tmp_path / "calls.txt"),
               SHIM_JOURNAL=str(tmp_path / "journal.txt"))  # fmt: skip
    env.pop("ANSIBLE_CONFIG", None)
    return subprocess.run([found, "-i", "hosts.json", "play.yml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip


def test_an_ib_pair_passes_reading_the_units_journal_since_its_start(tmp_path: Path) -> None:
    run = run_gate(tmp_path, IB)
    assert run.returncode == 0, run.stdout[-3000:]
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls == [
        "show --timestamp=unix --property=ExecMainStartTimestamp --value sparkple-vllm",
        f"journalctl --unit sparkple-vllm --since {START} --output cat --no-pager",
    ]


def test_a_socket_fallback_is_refused_on_the_head(tmp_path: Path) -> None:
    run = run_gate(tmp_path, SOCKET)
    assert run.returncode != 0
    (fatal,) = [ln for ln in run.stdout.splitlines() if ln.startswith("fatal: [spark-a]")]
    assert "sparkple pair-transport: spark-a (sparkple-vllm): NCCL uses Socket, not ib" in fatal


def test_warn_reports_the_fallback_and_passes(tmp_path: Path) -> None:
    run = run_gate(tmp_path, SOCKET, vllm_service_pair_transport_check="warn")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "WARNING: spark-a (sparkple-vllm): NCCL uses Socket, not ib" in run.stdout


def test_a_socket_pair_chosen_explicitly_passes_on_sockets(tmp_path: Path) -> None:
    run = run_gate(tmp_path, SOCKET, sparkple_pair_transport="socket")
    assert run.returncode == 0, run.stdout[-3000:]
