"""What a host lacks to serve: preflight's verdict on what its probes found (roles/preflight
runs the probes on the host and this on the controller, through its filter plugin).

Each check gives one line naming what is wanted and what was found; an empty list is a host
ready to serve. Standard library only.

The space a Spark needs on its data volume is the checkpoint, the table, room for one rebuild
of the table beside it (the builder publishes the new one before it drops the old) and some
headroom, less what the data directory already holds. Before nvme_storage has mounted a named
data device, the data directory's file system is still the root one: the device's own size is
what counts then.

The kernel's page size: the table is read one 90-byte row at a time, each read faulting in one
page; a 64 KiB-page kernel reads 16 times the bytes of a 4 KiB one for the same rows, and the
field reports NVIDIA drivers of the 595 and 610 branches faulting GPU mappings of 4 GiB or more
on such kernels (580 is clean): docs/ansible.md#host-kernel-and-driver.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3
SMALL_PAGE = 4096
# driver branches reported to fault GPU mappings of 4 GiB or more on a 64 KiB-page kernel
LARGE_PAGE_BAD_DRIVERS = ("595", "610")


@dataclass(frozen=True)
class Probes:
    """What the role's probes read on the host."""

    architecture: str
    gpu: str  # nvidia-smi's GPU name, "" without one
    driver: str  # nvidia-smi's driver version, "" without one
    memtotal_gib: float
    memavailable_gib: float
    free_bytes: int  # free on the data directory's file system (its nearest existing parent)
    held_bytes: int  # what the data directory already holds
    device: str  # the data device named for nvme_storage, "" for none
    device_bytes: int | None  # its size, where it is not mounted at the data directory yet
    page_size: int
    docker_installed: bool
    docker_runtimes: tuple[str, ...]
    nvidia_ctk: bool
    gpu_apps: str  # pids of processes using the GPU, "" for none
    serving: bool  # the serving unit is active (it holds the memory and the GPU)


@dataclass(frozen=True)
class Wants:
    """What a Spark ready to serve has (the role's knobs)."""

    arch: str
    gpu_name: str
    min_memtotal_gib: float
    checkpoint_gib: float
    table_gib: float
    headroom_gib: float
    min_memavailable_gib: float
    require_gpu_idle: bool
    allow_large_pages: bool


def space_needed_gib(wants: Wants) -> float:
    """The checkpoint, the table, one rebuild of the table, the headroom."""
    return round(wants.checkpoint_gib + 2 * wants.table_gib + wants.headroom_gib, 1)


def space_problem(probes: Probes, wants: Wants, data_dir: str) -> str | None:
    need = space_needed_gib(wants)
    parts = (
        f"checkpoint {wants.checkpoint_gib:g} + table {wants.table_gib:g} + one rebuild "
        f"{wants.table_gib:g} + headroom {wants.headroom_gib:g} GiB"
    )
    if probes.device and probes.device_bytes is not None:
        if probes.device_bytes <= 0:
            return f"the data device {probes.device} named for {data_dir} (not found)"
        size = round(probes.device_bytes / GIB, 1)
        if size >= need:
            return None
        return (
            f"{need} GiB on the data device {probes.device} for {data_dir}: {parts} (found {size})"
        )
    free, held = round(probes.free_bytes / GIB, 1), round(probes.held_bytes / GIB, 1)
    if free + held >= need:
        return None
    return (
        f"{round(need - held, 1)} GiB free for {data_dir}: {parts}, less {held} GiB already "
        f"there (found {free} free)"
    )


def page_problems(probes: Probes, wants: Wants) -> list[str]:
    problems = []
    if probes.page_size != SMALL_PAGE and not wants.allow_large_pages:
        problems.append(
            f"a {SMALL_PAGE // 1024} KiB-page kernel (found {probes.page_size // 1024} KiB "
            f"pages: each random table row read faults in {probes.page_size // SMALL_PAGE} "
            "times the bytes; boot a 4 KiB-page kernel, or set preflight_allow_large_pages: "
            "true)"
        )
    branch = probes.driver.split(".")[0]
    if probes.page_size != SMALL_PAGE and branch in LARGE_PAGE_BAD_DRIVERS:
        problems.append(
            f"an NVIDIA driver other than the {'/'.join(LARGE_PAGE_BAD_DRIVERS)} branches on "
            f"a {probes.page_size // 1024} KiB-page kernel (found {probes.driver}: reported to "
            "fault GPU mappings of 4 GiB or more there; 580 is clean)"
        )
    return problems


def problems(probes: Probes, wants: Wants, data_dir: str) -> list[str]:
    """What the host lacks, one line each (empty: ready)."""
    checks: list[tuple[bool, str]] = [
        (
            probes.architecture == wants.arch,
            f"architecture {wants.arch} (found {probes.architecture})",
        ),
        (
            bool(probes.gpu) and wants.gpu_name in probes.gpu,
            f"GPU {wants.gpu_name} (found {probes.gpu or 'no nvidia-smi'})",
        ),
        (
            probes.memtotal_gib >= wants.min_memtotal_gib,
            f"MemTotal >= {wants.min_memtotal_gib:g} GiB (found {probes.memtotal_gib})",
        ),
        (
            probes.serving or probes.memavailable_gib >= wants.min_memavailable_gib,
            f"MemAvailable >= {wants.min_memavailable_gib:g} GiB before serving "
            f"(found {probes.memavailable_gib})",
        ),
        (probes.docker_installed, "docker installed"),
        (
            probes.docker_installed and ("nvidia" in probes.docker_runtimes or probes.nvidia_ctk),
            "docker nvidia runtime, or nvidia-ctk to register it (found runtimes "
            f"{','.join(probes.docker_runtimes)})",
        ),
        (
            not wants.require_gpu_idle or not probes.gpu_apps or probes.serving,
            f"GPU idle (used by pids {probes.gpu_apps})",
        ),
    ]
    found = [text for ok, text in checks if not ok]
    space = space_problem(probes, wants, data_dir)
    if space:
        found.insert(3, space)
    return found + page_problems(probes, wants)
