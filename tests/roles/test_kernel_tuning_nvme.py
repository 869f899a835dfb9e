"""kernel_tuning's NVMe part through a real ansible-playbook run of the whole role, on a fake
sysfs tree laid out as the kernel lays out /sys: the table's data directory is made to sit on
the fake tree's nvme0n1p2 (its real st_dev linked in /sys/dev/block), and the role's own
sparkple.nvme command line gets `--sysfs` pointing at the tree (kernel_tuning_sysfs).

What is checked: the controller's power/pm_qos_latency_tolerance_us set to 0 and a second run
changing nothing; the boot unit's own command setting it again after a "reboot" (the knob put
back); giving the kernel's default back when turned off; the refusals, naming the device and the
knob to turn off, with nothing written, where the table's device is not NVMe or its controller
has no knob; only a report inside a container; check mode writing nothing; the GRUB drop-in of
the opt-in kernel command-line option (sourced as update-grub sources it), update-grub run as a
handler, "reboot needed" said and never a reboot.

Small scripts first on PATH stand for the host's tools: `systemd-detect-virt` (bare metal, or a
container), `sysctl -p` (writes a fake /proc/sys, as in test_kernel_tuning_role), `systemctl`
(enable/disable as symlinks in a wants directory, as systemctl makes them) and `update-grub`
(records its call). PATH holds no sbin directory, so the host's own tools are never reached."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_local import ansible_playbook

pytestmark = pytest.mark.slow  # ansible-playbook runs

ROOT = Path(__file__).resolve().parents[2]
PCI = "devices/pci0000:00/0000:00:01.1/0000:01:00.0"
SHIMS = {
    # bare metal: "none", exit 1; in a container its kind, exit 0
    "systemd-detect-virt": '#!/bin/sh\necho "${FAKE_VIRT:-none}"\n[ "$FAKE_VIRT" != none ]\n',
    "sysctl": """#!/bin/sh
echo "sysctl $*" >> "$SHIM_CALLS"
sed -n 's/^\\([a-z_.]*\\) = \\(.*\\)$/\\1 \\2/p' "$2" | while read -r key value; do
    echo "$value" > "$FAKE_PROC_SYS/$(echo "$key" | tr . /)"
done
""",
    "systemctl": """#!/bin/sh
echo "systemctl $*" >> "$SHIM_CALLS"
wants="$FAKE_UNITS/multi-user.target.wants"
case "$1" in
  daemon-reload) ;;
  show) if [ -f "$FAKE_UNITS/$2" ]; then echo LoadState=loaded; echo ActiveState=inactive;
        else echo LoadState=not-found; fi ;;
  is-enabled) if [ -L "$wants/$2" ]; then echo enabled; else echo disabled; exit 1; fi ;;
  enable) mkdir -p "$wants" && ln -sf "../$2" "$wants/$2" ;;
  disable) rm -f "$wants/$2" ;;
  *) exit 1 ;;
esac
""",
    "update-grub": '#!/bin/sh\necho "update-grub $*" >> "$SHIM_CALLS"\n',
}
UNIT = "sparkple-nvme-latency.service"


def link(sysfs: Path, name: str, target: Path | str) -> None:
    where = sysfs / name
    where.parent.mkdir(parents=True, exist_ok=True)
    if where.is_symlink():
        where.unlink()
    where.symlink_to(os.path.relpath(sysfs / target, where.parent))


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A fake /sys with one NVMe drive (nvme0, nvme0n1p1-2) and a SATA disk (sda1); the data
    directory on nvme0n1p2; a fake /proc/sys; the shims."""
    sysfs = tmp_path / "sys"
    ctrl = f"{PCI}/nvme/nvme0"
    (sysfs / ctrl / "power").mkdir(parents=True)
    (sysfs / ctrl / "power/pm_qos_latency_tolerance_us").write_text("100000\n")
    link(sysfs, "class/nvme/nvme0", ctrl)
    for name, path in (
        ("nvme0n1", f"{ctrl}/nvme0n1"),
        ("nvme0n1p1", f"{ctrl}/nvme0n1/nvme0n1p1"),
        ("nvme0n1p2", f"{ctrl}/nvme0n1/nvme0n1p2"),
        ("sda", f"{PCI}/ata1/host0/target0:0:0/0:0:0:0/block/sda"),
        ("sda1", f"{PCI}/ata1/host0/target0:0:0/0:0:0:0/block/sda/sda1"),
    ):
        (sysfs / path).mkdir(parents=True)
        if name in ("nvme0n1p1", "nvme0n1p2", "sda1"):
            (sysfs / path / "partition").write_text(name[-1] + "\n")
        link(sysfs, f"class/block/{name}", path)
    (sysfs / "module/nvme_core/parameters").mkdir(parents=True)
    (sysfs / "module/nvme_core/parameters/default_ps_max_latency_us").write_text("100000\n")
    (tmp_path / "data").mkdir()
    put_data_on(tmp_path, "nvme0n1p2")
    vm = tmp_path / "proc-sys" / "vm"
    vm.mkdir(parents=True)
    for name, value in (("swappiness", "60"), ("max_map_count", "65530")):
        (vm / name).write_text(f"{value}\n")
    (tmp_path / "units").mkdir()
    (tmp_path / "bin").mkdir()
    for name, text in SHIMS.items():
        (tmp_path / "bin" / name).write_text(text)
        (tmp_path / "bin" / name).chmod(0o755)
    return tmp_path


def put_data_on(work: Path, device: str) -> None:
    """The data directory's real st_dev named as `device` in the fake tree."""
    st = (work / "data").stat()
    sysfs = work / "sys"
    link(sysfs, f"dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}",
         (sysfs / "class/block" / device).resolve().relative_to(sysfs))  # fmt: skip


def knob(work: Path) -> str:
    return (work / "sys/class/nvme/nvme0/power/pm_qos_latency_tolerance_us").read_text().strip()


def calls(work: Path) -> list[str]:
    path = work / "calls.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return [ln for ln in lines if not ln.startswith("sysctl ")]


def run_role(
    work: Path, *more: str, virt: str = "none", grub: bool = True, **knobs: object
) -> subprocess.CompletedProcess[str]:
    found = ansible_playbook()
    variables = {
        "ansible_python_interpreter": sys.executable,
        "sparkple_data_dir": str(work / "data"),
        "sparkple_table_dir": str(work / "data" / "table"),
        "sparkple_state_dir": str(work / "state"),
        "kernel_tuning_sysctl_file": str(work / "60-sparkple.conf"),
        "kernel_tuning_sysctl_cmd": (
            f"/usr/bin/env PYTHONPATH={ROOT} {sys.executable} -m sparkple.provision.sysctl "
            f"--proc-sys {work / 'proc-sys'}"
        ),
        "kernel_tuning_nvme_cmd": (
            f"/usr/bin/env PYTHONPATH={ROOT} {sys.executable} -m sparkple.nvme"
        ),
        "kernel_tuning_sysfs": str(work / "sys"),
        "kernel_tuning_nvme_unit": str(work / "units" / UNIT),
        "kernel_tuning_grub_dropin": str(work / "grub.d" / "60-sparkple-nvme.cfg"),
        **knobs,
    }
    (work / "play.yml").write_text(
        "- hosts: spark-a\n  gather_facts: false\n  roles: [kernel_tuning]\n"
    )
    (work / "hosts.yml").write_text(
        "all:\n  hosts:\n    spark-a:\n      ansible_connection: local\n"
    )
    shims = work / ("bin" if grub else "bin-nogrub")
    if not grub and not shims.exists():
        shims.mkdir()
        for name in SHIMS:
            if name != "update-grub":
                (shims / name).symlink_to(work / "bin" / name)
    path = os.pathsep.join([str(shims), str(Path(sys.executable).parent), "/usr/local/bin",
                            "/usr/bin", "/bin"])  # fmt: skip
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"), PATH=path,
               SHIM_CALLS=str(work / "calls.txt"), FAKE_PROC_SYS=str(work / "proc-sys"),
               FAKE_UNITS=str(work / "units"), FAKE_VIRT=virt)  # fmt: skip
    env.pop("ANSIBLE_CONFIG", None)
    return subprocess.run(
        [found, "-i", "hosts.yml", "play.yml", "-e", json.dumps(variables), *more],
        cwd=work, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def ok(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    return run.stdout


def failure(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode != 0, run.stdout[-4000:]
    (line,) = [ln for ln in run.stdout.splitlines() if ln.startswith("fatal: [spark-a]")]
    return line


def test_the_drive_is_kept_awake_live_and_at_every_boot(host: Path) -> None:
    ok(run_role(host))
    assert knob(host) == "0"
    unit = (host / "units" / UNIT).read_text()
    assert f"RequiresMountsFor={host / 'data'}\n" in unit
    assert (host / "units/multi-user.target.wants" / UNIT).is_symlink(), "enabled at boot"
    assert "systemctl daemon-reload" in calls(host)
    assert not (host / "grub.d").exists(), "the kernel command line only on request"
    # a second run changes nothing, writes nothing, runs nothing
    again = ok(run_role(host))
    assert re.search(r"spark-a\s*:.*changed=0 ", again), again[-2000:]
    assert not [c for c in calls(host) if not c.startswith(("systemctl show", "systemctl is-"))]
    # a reboot puts the kernel's default back; the unit's own command sets it again
    (host / "sys/class/nvme/nvme0/power/pm_qos_latency_tolerance_us").write_text("100000\n")
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.M)
    booted = subprocess.run(shlex.split(exec_start), capture_output=True, text=True, timeout=60)
    assert booted.returncode == 0, booted.stderr
    assert json.loads(booted.stdout)["changed"] == ["nvme0"] and knob(host) == "0"


def test_turned_off_it_gets_the_kernels_default_back_and_the_unit_goes(host: Path) -> None:
    ok(run_role(host))
    assert knob(host) == "0"
    ok(run_role(host, kernel_tuning_nvme_latency_tolerance_us=None))
    assert knob(host) == "100000", "nvme_core.default_ps_max_latency_us, live"
    assert not (host / "units" / UNIT).exists()
    assert not (host / "units/multi-user.target.wants" / UNIT).exists()
    again = ok(run_role(host, kernel_tuning_nvme_latency_tolerance_us=None))
    assert re.search(r"spark-a\s*:.*changed=0 ", again), again[-2000:]


def test_a_table_not_on_nvme_is_refused_naming_the_device_and_the_knob(host: Path) -> None:
    put_data_on(host, "sda1")
    line = failure(run_role(host))
    assert "kernel_tuning: spark-a: the table's device sda1 is not NVMe (on sda)" in line, line
    assert "set kernel_tuning_nvme_latency_tolerance_us: null for this host" in line, line
    assert not (host / "units" / UNIT).exists() and knob(host) == "100000"
    # the operator's way out: turned off, the run goes through
    ok(run_role(host, kernel_tuning_nvme_latency_tolerance_us=None))


def test_a_controller_without_the_knob_is_refused_and_nothing_is_made(host: Path) -> None:
    power = host / "sys" / PCI / "nvme/nvme0/power"
    (power / "pm_qos_latency_tolerance_us").unlink()
    power.rmdir()
    line = failure(run_role(host))
    assert (
        "kernel_tuning: spark-a: nvme0 (the table's device nvme0n1p2) has no "
        "power/pm_qos_latency_tolerance_us: the kernel's APST latency knob is missing"
    ) in line, line
    assert not power.exists() and not (host / "units" / UNIT).exists()


def test_inside_a_container_it_only_reports(host: Path) -> None:
    put_data_on(host, "sda1")
    out = ok(run_role(host, virt="docker"))
    assert "not set inside a docker container: table drive: sda1 is not NVMe" in out, out[-3000:]
    assert not (host / "units" / UNIT).exists() and calls(host) == []


def test_check_mode_says_what_would_change_and_writes_nothing(host: Path) -> None:
    out = ok(run_role(host, "--check", kernel_tuning_nvme_kernel_cmdline=True))
    assert re.search(r"spark-a\s*:.*changed=[1-9]", out), out[-2000:]
    assert knob(host) == "100000" and not (host / "units" / UNIT).exists()
    assert not (host / "grub.d" / "60-sparkple-nvme.cfg").exists() and calls(host) == []


def test_the_kernel_command_line_option_is_opt_in_and_never_reboots(host: Path) -> None:
    out = ok(run_role(host, kernel_tuning_nvme_kernel_cmdline=True))
    dropin = host / "grub.d" / "60-sparkple-nvme.cfg"
    # sourced as update-grub sources /etc/default/grub.d/*.cfg after /etc/default/grub
    sourced = subprocess.run(
        ["sh", "-c", f'GRUB_CMDLINE_LINUX="quiet"; . {dropin}; echo "$GRUB_CMDLINE_LINUX"'],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert sourced.stdout == "quiet nvme_core.default_ps_max_latency_us=0\n"
    assert "update-grub " in calls(host), "the handler regenerates grub.cfg"
    said = (
        "the kernel command line carries nvme_core.default_ps_max_latency_us=0 from the next boot"
    )
    assert f"spark-a: reboot needed: {said}" in out, out[-3000:]
    assert knob(host) == "0", "the table's drive is kept awake now, without the reboot"
    # not yet rebooted: said again, nothing regenerated
    again = ok(run_role(host, kernel_tuning_nvme_kernel_cmdline=True))
    assert "spark-a: reboot needed: " in again and "update-grub " not in calls(host)
    # after the reboot (the kernel's default is 0 now): nothing to say
    (host / "sys/module/nvme_core/parameters/default_ps_max_latency_us").write_text("0\n")
    rebooted = ok(run_role(host, kernel_tuning_nvme_kernel_cmdline=True))
    assert "spark-a: reboot needed" not in rebooted
    # turned off: the drop-in goes, grub.cfg is regenerated, a reboot drops the option
    off = ok(run_role(host))
    assert not dropin.exists() and "update-grub " in calls(host)
    assert (
        "nvme_core.default_ps_max_latency_us is off the kernel command line from the next boot"
        in off
    )


def test_the_option_is_refused_where_there_is_no_update_grub(host: Path) -> None:
    line = failure(run_role(host, grub=False, kernel_tuning_nvme_kernel_cmdline=True))
    assert "kernel_tuning_nvme_kernel_cmdline is true but this host has no update-grub" in line
    assert not (host / "grub.d").exists()


def test_preflight_reports_the_table_drive(host: Path) -> None:
    """preflight runs the same module as a script (the package is not on the host yet)."""
    found = ansible_playbook()
    variables = {
        "ansible_python_interpreter": sys.executable,
        "sparkple_data_dir": str(host / "data"),
        "sparkple_table_dir": str(host / "data" / "table"),
        "sparkple_service_name": "sparkple-test-no-such-unit",
        "preflight_lab_mode": True,
        "preflight_sysfs": str(host / "sys"),
    }
    (host / "preflight.yml").write_text(
        "- hosts: localhost\n  gather_facts: true\n  gather_subset: [min, hardware]\n"
        "  roles: [preflight]\n"
    )
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(ROOT / "roles"))
    env.pop("ANSIBLE_CONFIG", None)
    run = subprocess.run(
        [found, "-i", "localhost,", "-c", "local", "preflight.yml", "-e", json.dumps(variables)],
        cwd=host, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = ok(run)
    assert (
        "preflight: table drive nvme0n1p2: nvme0 APST on, power states waking within 100000 µs; "
        "nvme_core.default_ps_max_latency_us=100000"
    ) in out, out[-4000:]
