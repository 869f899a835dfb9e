"""kernel_tuning through a real ansible-playbook run of the whole role: vm.swappiness=0 on by
default, vm.compaction_proactiveness=0 on request, both set live and given back live when turned
off, and a value out of the kernel's range refused naming the host, the variable and the range.

The live writes go to a real directory tree shaped like /proc/sys (the real one is not writable
from a test or a container): the role's own sparkple.provision.sysctl command line gets `--proc-sys`
pointing at it. Two small scripts first on PATH stand for the host's tools: `systemd-detect-virt`
answers as on bare metal ("none", exit 1; this test machine is a container, where the role
rightly applies nothing), and `sysctl -p FILE` writes the file's keys into the same tree, as
the real one writes /proc/sys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_local import ansible_playbook

ROOT = Path(__file__).resolve().parents[2]
DETECT_VIRT = "#!/bin/sh\necho none\nexit 1\n"
SYSCTL = """#!/bin/sh
echo "sysctl $*" >> "$SHIM_CALLS"
[ "$1" = -p ] || exit 2
sed -n 's/^\\([a-z_.]*\\) = \\(.*\\)$/\\1 \\2/p' "$2" | while read -r key value; do
    echo "$value" > "$FAKE_PROC_SYS/$(echo "$key" | tr . /)"
done
"""
# The host's own values: the kernel's defaults.
HOST = {
    "compaction_proactiveness": "20",
    "swappiness": "60",
    "max_map_count": "65530",
    "min_free_kbytes": "67584",
    "watermark_scale_factor": "10",
}


@pytest.fixture
def host(tmp_path: Path) -> Path:
    vm = tmp_path / "proc-sys" / "vm"
    vm.mkdir(parents=True)
    for name, value in HOST.items():
        (vm / name).write_text(f"{value}\n")
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("systemd-detect-virt", DETECT_VIRT), ("sysctl", SYSCTL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    return tmp_path


def run_role(work: Path, **knobs: object) -> subprocess.CompletedProcess[str]:
    found = ansible_playbook()
    proc_sys = work / "proc-sys"
    variables = {
        "ansible_python_interpreter": sys.executable,
        "kernel_tuning_sysctl_file": str(work / "60-sparkple.conf"),
        "sparkple_state_dir": str(work / "state"),
        "kernel_tuning_sysctl_cmd": (
            f"/usr/bin/env PYTHONPATH={ROOT} {sys.executable} -m sparkple.provision.sysctl "
            f"--proc-sys {proc_sys}"
        ),
        # the table's NVMe drive: tests/roles/test_kernel_tuning_nvme.py, on a fake sysfs tree
        "kernel_tuning_nvme_latency_tolerance_us": None,
        "kernel_tuning_nvme_unit": str(work / "sparkple-nvme-latency.service"),
        "kernel_tuning_grub_dropin": str(work / "60-sparkple-nvme.cfg"),
        **knobs,
    }
    (work / "play.yml").write_text(
        "- hosts: spark-a\n  gather_facts: false\n  roles: [kernel_tuning]\n"
    )
    (work / "hosts.yml").write_text(
        "all:\n  hosts:\n    spark-a:\n      ansible_connection: local\n"
    )
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"),
               PATH=f"{work / 'bin'}{os.pathsep}{os.environ['PATH']}",
               SHIM_CALLS=str(work / "calls.txt"), FAKE_PROC_SYS=str(proc_sys))  # fmt: skip
    env.pop("ANSIBLE_CONFIG", None)
    return subprocess.run(
        [found, "-i", "hosts.yml", "play.yml", "-e", json.dumps(variables)],
        cwd=work, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def live(work: Path, name: str) -> str:
    return (work / "proc-sys" / "vm" / name).read_text().strip()


def saved(work: Path) -> dict[str, str] | None:
    state = work / "state" / "kernel-tuning.json"
    return json.loads(state.read_text())["replaced"] if state.exists() else None


def test_swappiness_is_zero_by_default_and_compaction_left_alone(host: Path) -> None:
    run = run_role(host)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    conf = (host / "60-sparkple.conf").read_text()
    assert "vm.swappiness = 0\n" in conf and "compaction_proactiveness" not in conf
    assert live(host, "swappiness") == "0"
    assert live(host, "compaction_proactiveness") == "20", "opt-in only"
    assert saved(host) == {"vm.swappiness": "60"}, "the host's own value, recorded"
    # the file is applied as well, so the values hold after a reboot
    assert (host / "calls.txt").read_text().splitlines() == [f"sysctl -p {host}/60-sparkple.conf"]
    assert live(host, "max_map_count") == "1048576"
    # a second run changes nothing
    again = run_role(host)
    assert again.returncode == 0 and "changed=0" in again.stdout, again.stdout[-3000:]


def test_both_on_then_off_gives_the_hosts_values_back_live(host: Path) -> None:
    run = run_role(host, kernel_tuning_compaction_proactiveness=0)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "vm.compaction_proactiveness = 0\n" in (host / "60-sparkple.conf").read_text()
    assert (live(host, "swappiness"), live(host, "compaction_proactiveness")) == ("0", "0")
    assert saved(host) == {"vm.compaction_proactiveness": "20", "vm.swappiness": "60"}
    # compaction turned off again: only it goes back, swappiness stays sparkple's
    run = run_role(host)
    assert run.returncode == 0, run.stdout[-4000:]
    assert (live(host, "swappiness"), live(host, "compaction_proactiveness")) == ("0", "20")
    assert "compaction_proactiveness" not in (host / "60-sparkple.conf").read_text()
    assert saved(host) == {"vm.swappiness": "60"}
    # and swappiness too (null: the host's own value): nothing of sparkple's stays live
    run = run_role(host, kernel_tuning_swappiness=None)
    assert run.returncode == 0, run.stdout[-4000:]
    assert (live(host, "swappiness"), live(host, "compaction_proactiveness")) == ("60", "20")
    assert "swappiness" not in (host / "60-sparkple.conf").read_text()
    assert saved(host) is None, "nothing left to give back"


def test_with_the_watermarks_turning_one_off_keeps_the_others(host: Path) -> None:
    run = run_role(host, kernel_tuning_vm_watermarks=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert (live(host, "min_free_kbytes"), live(host, "swappiness")) == ("4194304", "0")
    run = run_role(host, kernel_tuning_vm_watermarks=False)
    assert run.returncode == 0, run.stdout[-4000:]
    assert (live(host, "min_free_kbytes"), live(host, "watermark_scale_factor")) == ("67584", "10")
    assert live(host, "swappiness") == "0" and saved(host) == {"vm.swappiness": "60"}


def test_values_out_of_range_are_refused_before_anything_changes(host: Path) -> None:
    run = run_role(host, kernel_tuning_swappiness=250, kernel_tuning_compaction_proactiveness=-1)
    assert run.returncode != 0
    failed = [ln for ln in run.stdout.splitlines() if ln.startswith("failed: [spark-a]")]
    for knob, value, sysctl, high in (
        ("kernel_tuning_swappiness", 250, "vm.swappiness", 200),
        ("kernel_tuning_compaction_proactiveness", -1, "vm.compaction_proactiveness", 100),
    ):
        (line,) = [ln for ln in failed if f"(item={knob})" in ln]
        assert f"kernel_tuning: spark-a: {knob}={value} is not an integer in {sysctl}'s range " \
               f"0-{high}; set it in the inventory" in line, line  # fmt: skip
    assert not (host / "60-sparkple.conf").exists()
    assert live(host, "swappiness") == "60" and saved(host) is None
