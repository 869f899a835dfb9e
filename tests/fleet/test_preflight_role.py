"""The preflight role on this machine (connection local, not a Spark): the free space it asks
for comes from the real sizes (checkpoint + table + one rebuild, less what is already there) and
MemAvailable is checked. The failure message lists what is missing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ansible_local import run_playbook

pytestmark = pytest.mark.slow  # one ansible-playbook run with fact gathering each

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = """
- hosts: localhost
  gather_facts: true
  gather_subset: [min, hardware]
  roles:
    - role: preflight
"""


def preflight(tmp_path: Path, **extra: object) -> str:
    variables = {
        "sparkple_data_dir": str(tmp_path / "data"),
        "sparkple_service_name": "sparkple-test-no-such-unit",
        **extra,
    }
    proc = run_playbook(tmp_path, PLAYBOOK, variables)
    assert proc.returncode != 0, "this machine is not a Spark: preflight must fail"
    found_msg = re.search(r"preflight: this host is not ready: ([^\"\n]*)", proc.stdout)
    assert found_msg, proc.stdout + proc.stderr
    return found_msg.group(1)


def test_free_space_and_memavailable_come_from_the_real_sizes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "held.bin").write_bytes(b"\0" * (3 << 20))  # what is already there counts
    msg = preflight(
        tmp_path,
        preflight_checkpoint_gib=100000,
        preflight_table_gib=30000,
        preflight_headroom_gib=5,
        preflight_min_memavailable_gib=100000,
    )
    # 100000 + 2 x 30000 + 5, less the 0.0 GiB (3 MiB) already there
    assert (
        f"160005.0 GiB free for {data}: checkpoint 100000 + table 30000 + one rebuild 30000" in msg
    )
    assert "less 0.0 GiB already there" in msg
    assert re.search(r"MemAvailable >= 100000 GiB before serving \(found [0-9.]+\)", msg), msg


def test_what_fits_is_not_reported(tmp_path: Path) -> None:
    msg = preflight(
        tmp_path,
        preflight_checkpoint_gib=0.001,
        preflight_table_gib=0.001,
        preflight_headroom_gib=0,
        preflight_min_memavailable_gib=0.001,
    )
    assert "GiB free for" not in msg and "MemAvailable" not in msg, msg


def test_the_example_inventory_keeps_data_on_the_root_file_system() -> None:
    """DGX OS keeps everything on one NVMe root file system: no data partition by default."""
    example = ROOT / "inventory" / "example"
    group = yaml.safe_load((example / "group_vars" / "all" / "sparkple.yml").read_text())
    assert group["nvme_storage_device"] == ""
    hosts = yaml.safe_load((example / "hosts.yml").read_text())
    for host, hv in hosts["sparks"]["hosts"].items():
        device = (hv or {}).get("nvme_storage_device", "")
        assert not re.fullmatch(r"/dev/nvme0n1p\d+", device), f"{host}: {device} is the OS disk"


def test_a_named_data_device_is_measured_itself(tmp_path: Path) -> None:
    """Before nvme_storage mounts a named device, the data dir's file system is the root one:
    the device's own size counts (here a device that is not there)."""
    msg = preflight(tmp_path, nvme_storage_device="/dev/sparkple-no-such-disk")
    assert (
        f"the data device /dev/sparkple-no-such-disk named for {tmp_path / 'data'} (not found)"
        in msg
    )
    assert "GiB free for" not in msg
