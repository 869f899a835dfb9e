"""`sparkple pair-check`: the pair's link measured with a two-rank all-reduce.

Rank 0 runs on the head, rank 1 on the worker, both inside the serving image (the NCCL and
torch the engine itself uses), meeting at the head's link address. For each message size from
1 MiB to 256 MiB (powers of two) it times all-reduces after a warm-up and reports, as NCCL's
own tests do, the algorithm bandwidth (size / time), the bus bandwidth (algbw * 2(n-1)/n for
an all-reduce over n ranks) and the time of one operation. A peak bus bandwidth below the floor
of the pair's transport is refused: on the RDMA link that is the mark of NCCL on TCP sockets
(docs/tensor-parallel.md, Link benchmark).

torch is imported only to measure: sparkple.pair is imported by host programs that have only
the standard library, and the figures, the table and the refusal need none of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import EXIT_CHECK_FAILED, EXIT_OK
from ..serving.multinode import HEAD, TP_SIZE, WORKER
from ..serving.recipe import ServingError

MIB = 1 << 20
# The benchmark's range: the all-reduce sizes where a link's bandwidth, not its latency, shows.
DEFAULT_MIN_MIB, DEFAULT_MAX_MIB, LIMIT_MAX_MIB = 1, 256, 1024
DEFAULT_WARMUP, DEFAULT_ITERS = 5, 20
# Peak bus bandwidth (GB/s, 10^9 bytes) below which each transport is refused: on the RDMA link
# (`ib`) the published two-Spark figures over RoCE are 12 GB/s and more, and NCCL on TCP sockets
# stays below 8 (docs/tensor-parallel.md, Link benchmark); a pair that chose `socket` (the lab)
# has no floor.
FLOORS_GBPS = {"ib": 8.0, "socket": 0.0}
BACKENDS = ("auto", "nccl", "gloo")
ELEMENT_BYTES = 4  # float32, as nccl-tests' default


def bus_factor(ranks: int = TP_SIZE) -> float:
    """nccl-tests' all-reduce correction (doc/PERFORMANCE.md): 2(n-1)/n data transfers per
    element, so busbw can be compared with the link's own bandwidth whatever n is."""
    return 2 * (ranks - 1) / ranks


@dataclass(frozen=True)
class Figure:
    """One message size's result: the slower rank's mean time of one all-reduce."""

    size_bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float

    @classmethod
    def of(cls, size_bytes: int, seconds: float, ranks: int = TP_SIZE) -> Figure:
        algbw = size_bytes / seconds / 1e9
        return cls(size_bytes, seconds * 1e6, algbw, algbw * bus_factor(ranks))


@dataclass(frozen=True)
class Settings:
    rank: int
    master_addr: str
    master_port: int
    min_mib: int = DEFAULT_MIN_MIB
    max_mib: int = DEFAULT_MAX_MIB
    warmup: int = DEFAULT_WARMUP
    iters: int = DEFAULT_ITERS
    backend: str = "auto"
    transport: str = "ib"
    floor_gbps: float | None = None  # None: the transport's (FLOORS_GBPS)
    pair: str = ""
    head: str = ""
    worker: str = ""
    timeout_s: float = 120.0

    def check(self) -> None:
        """Refuse what cannot run, naming the flag and the fix."""
        if self.rank not in (HEAD, WORKER):
            raise ServingError(f"--rank {self.rank}: use 0 on the head and 1 on the worker")
        if not self.master_addr.strip():
            raise ServingError("--master-addr is empty: give the head's link address")
        if not 1 <= self.master_port <= 65535:
            raise ServingError(f"--master-port {self.master_port} is not a TCP port (1-65535)")
        for flag, mib in (("--min-mib", self.min_mib), ("--max-mib", self.max_mib)):
            if mib < 1 or mib & (mib - 1):
                raise ServingError(f"{flag} {mib}: use a power of two (1, 2, 4, ... MiB)")
        if self.min_mib > self.max_mib:
            raise ServingError(f"--min-mib {self.min_mib} is above --max-mib {self.max_mib}")
        if self.max_mib > LIMIT_MAX_MIB:
            raise ServingError(
                f"--max-mib {self.max_mib}: at most {LIMIT_MAX_MIB} (each rank holds the message)"
            )
        if self.warmup < 0 or self.iters < 1:
            raise ServingError(
                f"--warmup {self.warmup} --iters {self.iters}: use 0 or more warm-up "
                "iterations and 1 or more timed ones"
            )
        if self.backend not in BACKENDS:
            raise ServingError(f"--backend {self.backend}: use one of {', '.join(BACKENDS)}")
        if self.transport not in FLOORS_GBPS:
            raise ServingError(
                f"--transport {self.transport}: use one of {', '.join(FLOORS_GBPS)} "
                "(the pair's sparkple_pair_transport)"
            )
        if self.floor_gbps is not None and self.floor_gbps < 0:
            raise ServingError(f"--floor-gbps {self.floor_gbps}: use 0 (no floor) or more")
        if self.timeout_s <= 0:
            raise ServingError(f"--timeout-s {self.timeout_s}: use a positive number of seconds")

    def sizes(self) -> list[int]:
        """The message sizes in bytes: the powers of two from --min-mib to --max-mib."""
        out, mib = [], self.min_mib
        while mib <= self.max_mib:
            out.append(mib * MIB)
            mib *= 2
        return out

    def floor(self) -> float:
        return FLOORS_GBPS[self.transport] if self.floor_gbps is None else self.floor_gbps

    def who(self) -> str:
        """The pair in words, for the refusal: its name and hosts where given, else the link."""
        hosts = f"{self.head or 'the head'} (rank 0) and {self.worker or 'the worker'} (rank 1)"
        name = f"pair {self.pair}: " if self.pair else "pair: "
        return f"{name}{hosts} over {self.master_addr}:{self.master_port}"


def table(figures: list[Figure]) -> list[str]:
    """The figures as nccl-tests prints them: size, time of one all-reduce, algbw, busbw."""
    lines = [
        f"{'size (B)':>12} {'size':>8} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"
    ]
    for f in figures:
        lines.append(
            f"{f.size_bytes:>12} {f.size_bytes // MIB:>4} MiB {f.time_us:>12.1f} "
            f"{f.algbw_gbps:>13.3f} {f.busbw_gbps:>13.3f}"
        )
    return lines


def verdict(settings: Settings, figures: list[Figure], backend: str = "nccl") -> tuple[bool, str]:
    """Whether the peak bus bandwidth clears the floor, and the sentence that says so."""
    peak = max(f.busbw_gbps for f in figures)
    floor = settings.floor()
    figure = f"peak bus bandwidth {peak:.2f} GB/s"
    if floor <= 0:
        why = (
            f"transport {settings.transport} has no floor"
            if settings.floor_gbps is None
            else "the floor is set to 0"
        )
        return True, f"{settings.who()}: {figure} ({why})"
    if peak >= floor:
        return True, f"{settings.who()}: {figure}, at or above the floor of {floor:g} GB/s"
    return False, (
        f"{settings.who()}: {figure} ({backend}) is below the floor of {floor:g} GB/s for "
        f"transport {settings.transport}: NCCL is likely on TCP sockets, not RDMA. Check the "
        "NCCL_IB_HCA "
        "device, /dev/infiniband in the container and NCCL's NET/IB line (NCCL_DEBUG=INFO); "
        "a pair meant to run on sockets sets sparkple_pair_transport: socket"
    )


def measure(settings: Settings) -> dict[str, Any]:  # pragma: no cover - run by the tests' ranks
    """Rendezvous with the other rank and time the all-reduces; the slower rank's time of each
    size is every rank's figure (an all-reduce ends for both when the slower one is done)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise ServingError(
            f"{settings.who()}: rank {settings.rank} cannot import torch ({exc}): run the check "
            "in the serving image, or with a Python that has torch (sparkple_pair_check_launcher)"
        ) from None

    cuda = torch.cuda.is_available()
    backend = settings.backend if settings.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ServingError(
            "--backend nccl needs a CUDA device and this torch sees none: run the check in the "
            "serving image with the GPU (docker --gpus), or use --backend gloo"
        )
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from datetime import timedelta

    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{settings.master_addr}:{settings.master_port}",
            rank=settings.rank,
            world_size=TP_SIZE,
            timeout=timedelta(seconds=settings.timeout_s),
        )
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
        other = "the worker (rank 1)" if settings.rank == HEAD else "the head (rank 0)"
        raise ServingError(
            f"{settings.who()}: rank {settings.rank} did not meet {other} within "
            f"{settings.timeout_s:g} s ({type(exc).__name__}: {str(exc).splitlines()[0]}): start "
            "both ranks together, and check the head's link address, the port (free, not "
            "firewalled) and GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME"
        ) from None

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        figures = []
        for size in settings.sizes():
            data = torch.full((size // ELEMENT_BYTES,), float(settings.rank + 1), device=device)
            dist.all_reduce(data)
            # 1 + 2 on every element: a link that garbles or drops data fails here, not later
            if not bool(torch.all(data == float(TP_SIZE * (TP_SIZE + 1) // 2))):
                raise ServingError(
                    f"{settings.who()}: the all-reduce of {size // MIB} MiB returned wrong sums"
                )
            data.zero_()  # the sums then stay 0 however many iterations run
            for _ in range(settings.warmup):
                dist.all_reduce(data)
            sync()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(settings.iters):
                dist.all_reduce(data)
            sync()
            elapsed = torch.tensor([(time.perf_counter() - start) / settings.iters], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            figures.append(Figure.of(size, float(elapsed.item())))
            del data
    finally:
        dist.destroy_process_group()
    versions: dict[str, str] = {"torch": str(torch.__version__)}
    if backend == "nccl":
        # torch leaves nccl.version() unannotated
        nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
        versions["nccl"] = ".".join(map(str, nccl))
    return {"backend": backend, "device": str(device), "versions": versions, "figures": figures}


def report(settings: Settings, measured: dict[str, Any]) -> dict[str, Any]:
    """The JSON result: the settings, the figures, the table, the peak and the verdict."""
    figures: list[Figure] = measured["figures"]
    ok, message = verdict(settings, figures, measured["backend"])
    return {
        "pair": settings.pair,
        "head": settings.head,
        "worker": settings.worker,
        "rank": settings.rank,
        "master": f"{settings.master_addr}:{settings.master_port}",
        "backend": measured["backend"],
        "device": measured["device"],
        "versions": measured["versions"],
        "transport": settings.transport,
        "floor_gbps": settings.floor(),
        "warmup": settings.warmup,
        "iters": settings.iters,
        "bus_factor": bus_factor(),
        "figures": [asdict(f) for f in figures],
        "peak_busbw_gbps": max(f.busbw_gbps for f in figures),
        "table": table(figures),
        "ok": ok,
        "message": message,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ServingError(f"{name}={value!r} in the environment: use a whole number") from None


def settings_of(args: argparse.Namespace) -> Settings:
    """The flags, with torch.distributed's RANK, MASTER_ADDR and MASTER_PORT as their defaults."""
    rank = args.rank if args.rank is not None else _env_int("RANK")
    port = args.master_port if args.master_port is not None else _env_int("MASTER_PORT")
    addr = args.master_addr or os.environ.get("MASTER_ADDR", "")
    if rank is None or port is None or not addr.strip():
        raise ServingError(
            "pair-check needs --rank (0 on the head, 1 on the worker), --master-addr (the "
            "head's link address) and --master-port, or RANK, MASTER_ADDR and MASTER_PORT"
        )
    settings = Settings(
        rank=rank,
        master_addr=addr.strip(),
        master_port=port,
        min_mib=args.min_mib,
        max_mib=args.max_mib,
        warmup=args.warmup,
        iters=args.iters,
        backend=args.backend,
        transport=args.transport,
        floor_gbps=args.floor_gbps,
        pair=args.pair,
        head=args.head,
        worker=args.worker,
        timeout_s=args.timeout_s,
    )
    settings.check()
    return settings


def _run(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    result = report(settings, measure(settings))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(result["table"]))
        print(result["message"])
    if not result["ok"]:
        print(f"sparkple pair-check: {result['message']}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="a pair's link: two-rank all-reduce bus bandwidth and latency")
    p.add_argument("--rank", type=int, help="0 on the head, 1 on the worker (default: $RANK)")
    p.add_argument("--master-addr", default="", help="the head's link address ($MASTER_ADDR)")
    p.add_argument("--master-port", type=int, help="the rendezvous port ($MASTER_PORT)")
    p.add_argument("--min-mib", type=int, default=DEFAULT_MIN_MIB, help="smallest message")
    p.add_argument("--max-mib", type=int, default=DEFAULT_MAX_MIB, help="largest message")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="untimed all-reduces")
    p.add_argument("--iters", type=int, default=DEFAULT_ITERS, help="timed all-reduces a size")
    p.add_argument("--backend", default="auto", help="nccl on CUDA, gloo on CPU (auto)")
    p.add_argument(
        "--transport", default="ib", help="the pair's transport, whose floor applies: ib, socket"
    )
    p.add_argument(
        "--floor-gbps",
        type=float,
        help=f"peak bus bandwidth to refuse below, GB/s (default: {FLOORS_GBPS})",
    )
    p.add_argument("--pair", default="", help="the pair's name (for the report)")
    p.add_argument("--head", default="", help="the head's host name (for the report)")
    p.add_argument("--worker", default="", help="the worker's host name (for the report)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="rendezvous and op timeout")
    p.add_argument("--json", action="store_true", help="print the result as one line of JSON")
    p.add_argument("--json-out", default="", help="also write the JSON result to this file")
    p.set_defaults(func=_run)
