"""sparkple.preflight: preflight's verdict on what its probes found (the role runs the probes,
this decides), one line per thing a host lacks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sparkple.preflight import GIB, Probes, Wants, problems, space_needed_gib

WANTS = Wants(arch="aarch64", gpu_name="GB10", min_memtotal_gib=110, checkpoint_gib=98.57,
              table_gib=26.82, headroom_gib=5, min_memavailable_gib=97, require_gpu_idle=True,
              allow_large_pages=False)  # fmt: skip
SPARK = Probes(architecture="aarch64", gpu="NVIDIA GB10", driver="580.95.05", memtotal_gib=119.7,
               memavailable_gib=112.0, free_bytes=3000 * GIB, held_bytes=0, device="",
               device_bytes=None, page_size=4096, docker_installed=True,
               docker_runtimes=("nvidia", "runc"), nvidia_ctk=True, gpu_apps="",
               serving=False)  # fmt: skip


def test_a_ready_spark_lacks_nothing() -> None:
    assert problems(SPARK, WANTS, "/srv/sparkple") == []


def test_the_space_is_checkpoint_table_a_rebuild_and_headroom_less_what_is_there() -> None:
    assert space_needed_gib(WANTS) == 157.2
    short = replace(SPARK, free_bytes=int(150 * GIB), held_bytes=int(5 * GIB))
    assert problems(short, WANTS, "/srv/sparkple") == [
        "152.2 GiB free for /srv/sparkple: checkpoint 98.57 + table 26.82 + one rebuild 26.82 "
        "+ headroom 5 GiB, less 5.0 GiB already there (found 150.0 free)"
    ]
    assert problems(replace(short, held_bytes=int(8 * GIB)), WANTS, "/srv/sparkple") == []


def test_a_named_data_device_not_mounted_yet_is_measured_itself() -> None:
    """The root file system's free space says nothing of the disk nvme_storage will mount."""
    small = replace(SPARK, free_bytes=10 * GIB, device="/dev/nvme1n1", device_bytes=100 * GIB)
    assert problems(small, WANTS, "/srv/sparkple") == [
        "157.2 GiB on the data device /dev/nvme1n1 for /srv/sparkple: checkpoint 98.57 + table "
        "26.82 + one rebuild 26.82 + headroom 5 GiB (found 100.0)"
    ]
    big = replace(small, device_bytes=3726 * GIB)
    assert problems(big, WANTS, "/srv/sparkple") == []  # the root's 10 GiB do not matter
    gone = replace(small, device_bytes=0)
    assert problems(gone, WANTS, "/d") == ["the data device /dev/nvme1n1 named for /d (not found)"]


def test_a_64_kib_page_kernel_is_refused_unless_allowed() -> None:
    large = replace(SPARK, page_size=65536)
    (found,) = problems(large, WANTS, "/d")
    assert found.startswith("a 4 KiB-page kernel (found 64 KiB pages")
    assert "16 times the bytes" in found and "preflight_allow_large_pages: true" in found
    assert problems(large, replace(WANTS, allow_large_pages=True), "/d") == []


@pytest.mark.parametrize("driver", ["595.44.01", "610.10"])
def test_the_drivers_reported_to_fault_on_64_kib_pages_are_refused_there(driver: str) -> None:
    allowed = replace(WANTS, allow_large_pages=True)
    (found,) = problems(replace(SPARK, page_size=65536, driver=driver), allowed, "/d")
    assert f"found {driver}" in found and "580 is clean" in found
    # the same driver on 4 KiB pages, and 580 on 64 KiB pages, are fine
    assert problems(replace(SPARK, driver=driver), WANTS, "/d") == []
    assert problems(replace(SPARK, page_size=65536, driver="580.95.05"), allowed, "/d") == []


def test_a_lab_host_lacks_what_a_spark_has() -> None:
    lab = replace(SPARK, architecture="x86_64", gpu="", driver="", memtotal_gib=23.4,
                  docker_runtimes=("runc",), nvidia_ctk=False)  # fmt: skip
    assert problems(lab, WANTS, "/d") == [
        "architecture aarch64 (found x86_64)",
        "GPU GB10 (found no nvidia-smi)",
        "MemTotal >= 110 GiB (found 23.4)",
        "docker nvidia runtime, or nvidia-ctk to register it (found runtimes runc)",
    ]
