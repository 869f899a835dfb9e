"""sparkple.nvme on fake sysfs trees laid out as the kernel lays out /sys: from a directory to
its block device (by st_dev, or by the mount table), to the disk below a partition or a
device-mapper device, to the NVMe controller (or a multipath subsystem's controllers), and the
controller's power/pm_qos_latency_tolerance_us read, written where it differs, and refused
cleanly where the device is not NVMe or the controller has no such knob."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_sysfs import PCI, controller, disk, link, on

from sparkple import nvme


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """One NVMe drive (nvme0n1, two partitions) and one SATA disk (sda, one partition)."""
    root = tmp_path / "sys"
    ctrl = controller(root)
    disk(root, ctrl, "nvme0n1", "259", parts=2)
    disk(root, f"{PCI}/ata1/host0/target0:0:0/0:0:0:0/block", "sda", "8", parts=1)
    (root / "module/nvme_core/parameters").mkdir(parents=True)
    (root / "module/nvme_core/parameters/default_ps_max_latency_us").write_text("100000\n")
    return root


def knob(sysfs: Path, name: str = "nvme0") -> Path:
    return sysfs / "class" / "nvme" / name / "power" / "pm_qos_latency_tolerance_us"


def test_a_partition_leads_to_its_namespace_and_controller(sysfs: Path, tmp_path: Path) -> None:
    table = tmp_path / "data" / "table"
    (tmp_path / "data").mkdir()
    on(sysfs, tmp_path / "data", "nvme0n1p2")
    drive = nvme.locate(table, sysfs, tmp_path / "no-mountinfo")
    assert drive.path == str(tmp_path / "data"), "the table's directory is not there yet"
    assert (drive.device, drive.controllers, drive.others) == ("nvme0n1p2", ("nvme0",), ())
    rep = nvme.report(drive, sysfs)
    assert rep["controllers"] == [
        {"name": "nvme0", "latency_tolerance_us": "100000",
         "apst": "APST on, power states waking within 100000 µs"}
    ]  # fmt: skip
    assert rep["kernel_default_us"] == "100000" and rep["problem"] is None


def test_a_whole_namespace_and_a_named_device_lead_to_the_controller(sysfs: Path) -> None:
    assert nvme.locate_device("nvme0n1", sysfs).controllers == ("nvme0",)
    assert nvme.locate_device("/dev/nvme0n1p1", sysfs).controllers == ("nvme0",)


def test_set_writes_only_where_it_differs_and_reads_back(sysfs: Path, tmp_path: Path) -> None:
    on(sysfs, tmp_path, "nvme0n1p1")
    drive = nvme.locate(tmp_path, sysfs)
    probe = nvme.apply(drive, "0", sysfs, check=True)
    assert probe["changed"] == ["nvme0"] and knob(sysfs).read_text() == "100000\n"
    done = nvme.apply(drive, "0", sysfs)
    assert done["changed"] == ["nvme0"] and knob(sysfs).read_text() == "0\n"
    assert done["controllers"][0]["apst"] == "APST off"
    assert nvme.apply(drive, "0", sysfs)["changed"] == [], "a second run changes nothing"
    # given back: the kernel's own default for new controllers
    back = nvme.apply(drive, "kernel-default", sysfs)
    assert back["changed"] == ["nvme0"] and knob(sysfs).read_text() == "100000\n"


def test_the_kernel_default_is_clamped_as_the_kernel_clamps_it(sysfs: Path, tmp_path: Path) -> None:
    (sysfs / nvme.KERNEL_DEFAULT).write_text("18446744073709551615\n")
    on(sysfs, tmp_path, "nvme0n1")
    assert nvme.apply(nvme.locate(tmp_path, sysfs), "kernel-default", sysfs)["value"] == str(
        2**31 - 1
    )


def test_a_non_nvme_device_is_refused_and_nothing_is_written(sysfs: Path, tmp_path: Path) -> None:
    on(sysfs, tmp_path, "sda1")
    drive = nvme.locate(tmp_path, sysfs)
    assert (drive.device, drive.controllers, drive.others) == ("sda1", (), ("sda",))
    with pytest.raises(nvme.Refused) as refused:
        nvme.apply(drive, "0", sysfs)
    assert str(refused.value).startswith("the table's device sda1 is not NVMe (on sda)")
    assert "kernel_tuning_nvme_latency_tolerance_us: null" in str(refused.value)
    assert knob(sysfs).read_text() == "100000\n"
    assert nvme.line(nvme.report(drive, sysfs)) == "table drive: sda1 is not NVMe"


def test_a_controller_without_the_knob_is_refused_and_no_file_is_made(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    ctrl = controller(sysfs, "nvme1", knob=None)
    disk(sysfs, ctrl, "nvme1n1", "259")
    on(sysfs, tmp_path, "nvme1n1")
    drive = nvme.locate(tmp_path, sysfs)
    rep = nvme.report(drive, sysfs)
    assert rep["controllers"] == [
        {"name": "nvme1", "latency_tolerance_us": None, "apst": "no APST knob"}
    ]
    assert rep["problem"].startswith(
        "nvme1 (the table's device nvme1n1) has no power/pm_qos_latency_tolerance_us: the "
        "kernel's APST latency knob is missing"
    )
    with pytest.raises(nvme.Refused, match="has no power/pm_qos_latency_tolerance_us"):
        nvme.apply(drive, "0", sysfs)
    assert not (sysfs / "class/nvme/nvme1/power").exists(), "a refusal writes nothing"


def test_device_mapper_leads_through_its_slaves(sysfs: Path, tmp_path: Path) -> None:
    (sysfs / "devices/virtual/block/dm-0/slaves").mkdir(parents=True)
    (sysfs / "devices/virtual/block/dm-0/dm").mkdir()
    (sysfs / "devices/virtual/block/dm-0/dm/name").write_text("data\n")
    link(sysfs, "class/block/dm-0", "devices/virtual/block/dm-0")
    link(
        sysfs, "devices/virtual/block/dm-0/slaves/nvme0n1p2", f"{PCI}/nvme/nvme0/nvme0n1/nvme0n1p2"
    )
    on(sysfs, tmp_path, "dm-0")
    drive = nvme.locate(tmp_path, sysfs)
    assert (drive.device, drive.controllers, drive.others) == ("dm-0", ("nvme0",), ())
    # a mirror with a SATA leg is only partly NVMe: refused, naming the leg
    link(
        sysfs,
        "devices/virtual/block/dm-0/slaves/sda1",
        f"{PCI}/ata1/host0/target0:0:0/0:0:0:0/block/sda/sda1",
    )
    with pytest.raises(nvme.Refused, match=r"dm-0 is only partly NVMe \(sda is not\)"):
        nvme.apply(nvme.locate(tmp_path, sysfs), "0", sysfs)


def test_a_multipath_namespace_leads_to_each_controller_of_its_subsystem(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    subsys = "devices/virtual/nvme-subsystem/nvme-subsys0"
    for name, pci in (("nvme0", PCI), ("nvme1", "devices/pci0000:00/0000:00:02.1/0000:02:00.0")):
        path = controller(sysfs, name, knob="any", pci=pci)
        link(sysfs, f"{subsys}/{name}", path)
    disk(sysfs, subsys, "nvme0n1", "259")
    on(sysfs, tmp_path, "nvme0n1")
    drive = nvme.locate(tmp_path, sysfs)
    assert drive.controllers == ("nvme0", "nvme1")
    assert (
        nvme.report(drive, sysfs)["controllers"][1]["apst"] == "APST on, every power state allowed"
    )
    assert nvme.apply(drive, "0", sysfs)["changed"] == ["nvme0", "nvme1"]
    assert knob(sysfs, "nvme1").read_text() == "0\n"


def test_a_file_system_without_a_block_number_is_found_by_its_mount(
    sysfs: Path, tmp_path: Path
) -> None:
    """btrfs gives its files an anonymous st_dev: the mount table names the partition."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw\n"
        f"36 22 0:41 / {data} rw,relatime shared:9 - btrfs /dev/nvme0n1p2 rw,ssd\n"
    )
    drive = nvme.locate(data / "sub" / "table", sysfs, mountinfo)
    assert (drive.device, drive.source, drive.controllers) == (
        "nvme0n1p2", "/dev/nvme0n1p2", ("nvme0",)
    )  # fmt: skip


def test_a_mount_point_with_a_space_is_read_as_the_mount_table_escapes_it(
    sysfs: Path, tmp_path: Path
) -> None:
    data = tmp_path / "PLE data"
    data.mkdir()
    mountinfo = tmp_path / "mountinfo"
    escaped = str(data).replace(" ", "\\040")
    mountinfo.write_text(f"36 22 0:41 / {escaped} rw - btrfs /dev/nvme0n1p1 rw\n")
    assert nvme.locate(data, sysfs, mountinfo).device == "nvme0n1p1"


def test_a_directory_on_no_block_device_is_refused(sysfs: Path, tmp_path: Path) -> None:
    """An overlay (a container's root), tmpfs or NFS: no drive of its own."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"500 400 0:77 / {tmp_path} rw - overlay overlay rw,lowerdir=/x\n")
    drive = nvme.locate(tmp_path, sysfs, mountinfo)
    assert drive.device is None and drive.source == "overlay"
    with pytest.raises(nvme.Refused, match=r"is not on a block device \(overlay\)"):
        nvme.apply(drive, "0", sysfs)
    assert nvme.line(nvme.report(drive, sysfs)).startswith("table drive: none")


def test_the_command_line(sysfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    on(sysfs, tmp_path, "nvme0n1p2")
    base = ["--sysfs", str(sysfs), "--path", str(tmp_path)]
    assert nvme.main(["set", *base, "--value", "0", "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["changed"] == ["nvme0"]
    assert knob(sysfs).read_text() == "100000\n", "--check writes nothing"
    assert nvme.main(["set", *base, "--value", "0"]) == 0
    capsys.readouterr()
    assert nvme.main(["status", *base, "--line"]) == 0
    assert capsys.readouterr().out == (
        "table drive nvme0n1p2: nvme0 APST off (latency tolerance 0 µs); "
        "nvme_core.default_ps_max_latency_us=100000\n"
    )
    assert nvme.main(["set", *base, "--value", "-5"]) == 1
    assert "is not a latency in µs" in capsys.readouterr().err
    on(sysfs, tmp_path, "sda1")
    assert nvme.main(["set", *base, "--value", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sparkple.nvme: the table's device sda1 is not NVMe"), err


def test_status_reports_the_table_drive_in_its_json_and_its_line(
    sysfs: Path, tmp_path: Path
) -> None:
    """`supervisor status` (sparkple-ops status, playbooks/status.yml) and the heartbeat line."""
    from sparkple.supervise.status import one_line, report

    (tmp_path / "state").mkdir()
    (tmp_path / "kmsg").write_text("")
    table = tmp_path / "table"
    table.mkdir()
    on(sysfs, table, "nvme0n1p2")
    knob(sysfs).write_text("0\n")
    rep = report(tmp_path / "state", tmp_path / "kmsg", table_dir=table, sysfs=sysfs)
    drive = rep["table_drive"]
    assert (drive["device"], drive["problem"]) == ("nvme0n1p2", None)
    assert drive["controllers"] == [
        {"name": "nvme0", "latency_tolerance_us": "0", "apst": "APST off"}
    ]
    assert one_line(rep).endswith(
        ", table drive nvme0n1p2: nvme0 APST off (latency tolerance 0 µs); "
        "nvme_core.default_ps_max_latency_us=100000"
    ), one_line(rep)
    # without --table-dir, from the device the supervisor watches (its state file names it)
    (tmp_path / "state" / "supervisor.json").write_text('{"table_device": "nvme0n1p2"}')
    by_device = report(tmp_path / "state", tmp_path / "kmsg", sysfs=sysfs)["table_drive"]
    assert by_device["controllers"] == drive["controllers"]
    # a host whose table is on a SATA disk: reported, not an error
    sata = report(tmp_path / "state", tmp_path / "kmsg", "sda1", sysfs=sysfs)["table_drive"]
    assert sata["controllers"] == [] and "sda1 is not NVMe" in sata["problem"]
