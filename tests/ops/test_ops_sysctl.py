"""Live kernel tunables applied and given back (kernel_tuning's sparkple.provision.sysctl),
against a real directory tree shaped like /proc/sys (the real one is not writable from a test or
a container)."""

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


@pytest.fixture
def vm_tunables(proc_sys: Path) -> Path:
    (proc_sys / "vm" / "swappiness").write_text("60\n")
    (proc_sys / "vm" / "compaction_proactiveness").write_text("20\n")
    return proc_sys


def sync(proc_sys: Path, state: Path, *pairs: str, check: bool = False) -> tuple[int, dict, str]:
    # the role's order: the options between the command and the KEY=VALUE words
    args = ["sync", *(["--check"] if check else []), "--state", state, "--proc-sys", proc_sys]
    done = subprocess.run(program("sysctl", *args, *pairs), capture_output=True, text=True,
                          timeout=30)  # fmt: skip
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {}, done.stderr


def vm(proc_sys: Path, name: str) -> str:
    return (proc_sys / "vm" / name).read_text().strip()


def test_sync_sets_what_is_wanted_and_gives_back_only_what_is_not(vm_tunables, tmp_path):
    state = tmp_path / "kernel-tuning.json"
    both = ["vm.swappiness=0", "vm.compaction_proactiveness=0"]
    rc, out, err = sync(vm_tunables, state, *both, *WATERMARKS, check=True)
    assert rc == 0, err
    assert sorted(out["changed"]) == sorted(k.split("=")[0] for k in both + WATERMARKS)
    assert vm(vm_tunables, "swappiness") == "60" and not state.exists(), "--check changes nothing"
    assert sync(vm_tunables, state, *both, *WATERMARKS)[0] == 0
    assert (vm(vm_tunables, "swappiness"), vm(vm_tunables, "compaction_proactiveness")) == (
        "0",
        "0",
    )
    assert json.loads(state.read_text())["replaced"] == {
        "vm.compaction_proactiveness": "20", "vm.min_free_kbytes": "67584",
        "vm.swappiness": "60", "vm.watermark_scale_factor": "10",
    }  # fmt: skip
    # the watermarks and the compactor turned off: those three go back, swappiness stays 0
    rc, out, err = sync(vm_tunables, state, "vm.swappiness=0")
    assert rc == 0, err
    assert sorted(out["changed"]) == [
        "vm.compaction_proactiveness", "vm.min_free_kbytes", "vm.watermark_scale_factor",
    ]  # fmt: skip
    assert (
        live(vm_tunables) == ("67584", "10") and vm(vm_tunables, "compaction_proactiveness") == "20"
    )
    assert vm(vm_tunables, "swappiness") == "0"
    assert json.loads(state.read_text())["replaced"] == {"vm.swappiness": "60"}
    assert sync(vm_tunables, state, "vm.swappiness=0")[1]["changed"] == [], "idempotent"
    # nothing wanted: everything recorded goes back and the record is gone
    rc, out, _ = sync(vm_tunables, state)
    assert rc == 0 and out["changed"] == ["vm.swappiness"] and vm(vm_tunables, "swappiness") == "60"
    assert not state.exists()


def test_a_value_the_host_already_has_is_not_recorded(vm_tunables, tmp_path):
    (vm_tunables / "vm" / "swappiness").write_text("0\n")
    state = tmp_path / "kernel-tuning.json"
    rc, out, _ = sync(vm_tunables, state, "vm.swappiness=0")
    assert rc == 0 and out["changed"] == [] and not state.exists()
    assert sync(vm_tunables, state)[0] == 0 and vm(vm_tunables, "swappiness") == "0", (
        "its own value"
    )


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("vm.swappiness=201", "vm.swappiness=201 is out of range: the kernel takes 0-200"),
        ("vm.swappiness=-1", "vm.swappiness=-1 is out of range: the kernel takes 0-200"),
        ("vm.compaction_proactiveness=101",
         "vm.compaction_proactiveness=101 is out of range: the kernel takes 0-100"),
        ("vm.compaction_proactiveness=off",
         "vm.compaction_proactiveness='off' is not an integer (the kernel takes 0-100)"),
        ("vm.swappiness=", "'vm.swappiness=' is not KEY=VALUE"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_before_anything_is_written(vm_tunables, tmp_path, pair, message):
    state = tmp_path / "kernel-tuning.json"
    rc, out, err = sync(vm_tunables, state, "vm.compaction_proactiveness=0", pair)
    assert rc != 0 and out == {} and message in err, err
    assert vm(vm_tunables, "compaction_proactiveness") == "20" and not state.exists()


def test_status_reports_the_live_values_for_a_benchmark_to_record(vm_tunables, tmp_path):
    state = tmp_path / "kernel-tuning.json"
    assert sync(vm_tunables, state, "vm.swappiness=0")[0] == 0
    done = subprocess.run(
        program("sysctl", "status", "--state", state, "--proc-sys", vm_tunables),
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["live"] == {
        "vm.compaction_proactiveness": "20", "vm.max_map_count": None,
        "vm.min_free_kbytes": "67584", "vm.swappiness": "0", "vm.watermark_scale_factor": "10",
    }  # fmt: skip
    assert out["replaced"] == {"vm.swappiness": "60"} and out["changed"] == ["vm.swappiness"]
    assert vm(vm_tunables, "swappiness") == "0", "status changes nothing"
