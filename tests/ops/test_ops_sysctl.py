"""Live kernel tunables applied and given back (kernel_tuning's sparkple.ops.sysctl), against a real
directory tree shaped like /proc/sys (the real one is not writable from a test or a container)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from ops_helpers import program

WATERMARKS = ["vm.min_free_kbytes=4194304", "vm.watermark_scale_factor=300"]


@pytest.fixture
def proc_sys(tmp_path: Path) -> Path:
    root = tmp_path / "proc-sys"
    (root / "vm").mkdir(parents=True)
    (root / "vm" / "min_free_kbytes").write_text("67584\n")
    (root / "vm" / "watermark_scale_factor").write_text("10\n")
    return root


def run(proc_sys: Path, state: Path, *args: str) -> tuple[int, dict, str]:
    done = subprocess.run(
        program("sysctl", *args, "--state", state, "--proc-sys", proc_sys),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {}, done.stderr


def live(proc_sys: Path) -> tuple[str, str]:
    vm = proc_sys / "vm"
    return (vm / "min_free_kbytes").read_text().strip(), (
        vm / "watermark_scale_factor"
    ).read_text().strip()


def test_turning_the_watermarks_off_restores_the_hosts_values_live(proc_sys, tmp_path):
    state = tmp_path / "kernel-tuning.json"
    rc, out, _ = run(proc_sys, state, "apply", *WATERMARKS)
    assert rc == 0 and out["changed"] == ["vm.min_free_kbytes", "vm.watermark_scale_factor"]
    assert live(proc_sys) == ("4194304", "300")
    # a second apply changes nothing and keeps the host's values, not ours
    rc, out, _ = run(proc_sys, state, "apply", *WATERMARKS)
    assert rc == 0 and out["changed"] == []
    assert json.loads(state.read_text())["replaced"] == {
        "vm.min_free_kbytes": "67584",
        "vm.watermark_scale_factor": "10",
    }
    rc, out, _ = run(proc_sys, state, "restore", "--check")
    assert rc == 0 and len(out["changed"]) == 2 and live(proc_sys) == ("4194304", "300")
    rc, out, _ = run(proc_sys, state, "restore")
    assert rc == 0 and len(out["changed"]) == 2
    assert live(proc_sys) == ("67584", "10") and not state.exists()
    rc, out, _ = run(proc_sys, state, "restore")
    assert rc == 0 and out["changed"] == [], "idempotent"


def test_a_value_that_cannot_be_restored_says_reboot_needed(proc_sys, tmp_path):
    state = tmp_path / "kernel-tuning.json"
    assert run(proc_sys, state, "apply", *WATERMARKS)[0] == 0
    knob = proc_sys / "vm" / "min_free_kbytes"
    knob.unlink()
    knob.mkdir()  # writing it now fails, as a read-only /proc/sys would
    rc, out, err = run(proc_sys, state, "restore")
    assert rc == 1 and "reboot needed" in err and "vm.min_free_kbytes" in err
    restored = (proc_sys / "vm" / "watermark_scale_factor").read_text().strip()
    assert restored == "10", "what could be restored was"
    assert json.loads(state.read_text())["replaced"] == {"vm.min_free_kbytes": "67584"}


def test_bad_pairs_are_usage_errors(proc_sys, tmp_path):
    done = subprocess.run(
        program("sysctl", "apply", "vm.min_free_kbytes", "--state", tmp_path / "s"),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode != 0 and "is not KEY=VALUE" in done.stderr
