"""The fleet benchmark's plan, record and report (playbooks/benchmark.yml runs them).

- `sparkple bench plan` writes the cases vLLM's own serving benchmark runs
  (sparkple.measure.vllm_bench): the prose and code prompt sets at each concurrency, and a
  long-prompt prefill case at one stream, each bounded in prompts and in time.
- `sparkple bench snapshot` reads the counters the record compares, on the host that serves:
  vLLM's spec-decode and generation counters from its /metrics, and the PLE disk reads from
  sparkple's metrics textfile (ple_metrics).
- `sparkple bench record` turns vLLM's results and two snapshots into one host's record: output
  tok/s, TTFT and ITL p50/p99 per case, prefill tok/s, MTP acceptance, PLE disk bytes per
  generated token, MemAvailable and the live kernel settings.
- `sparkple bench warmup` puts a short load on the server before a run, round after round,
  until the GPU's SM clock (sparkple.measure.gpuclock) is steady: two rounds in a row within a
  share of each other; where there is no clock to read (no `nvidia-smi`: the lab), until two
  rounds in a row agree in tok/s. The record keeps the rounds and the clock it left the GPU at.
- `sparkple bench report` prints the records as a table beside the published figures (other
  prompts and settings: labelled as published) and, with matplotlib (the `[bench]` extra), plots
  tok/s against concurrency per host.
- `sparkple bench ab` compares the four records of an A/B run, A B B A on one Spark
  (sparkple/measure/ab.py).

A record also says what it was measured under: the GPU clock after the run and the table
drive's power-state settings (drive_power_state, from sparkple.nvme).

Standard library only, except the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from sparkple import nvme
from sparkple.measure import gpuclock, speedgate
from sparkple.meminfo import read_meminfo

WORKLOADS = ("prose", "code")
PREFILL = "prefill"
# what the record keeps of each vLLM result (its own key names)
CASE_FIELDS = (
    "completed", "failed", "duration", "output_throughput", "total_input_tokens",
    "total_output_tokens", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms",
)  # fmt: skip
KERNEL_SETTINGS = ("vm.swappiness", "vm.compaction_proactiveness", "vm.min_free_kbytes",
                   "vm.watermark_scale_factor")  # fmt: skip
# vLLM's counters (vllm/v1/metrics/loggers.py) and sparkple's (sparkple/metrics/collect.py)
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
GENERATED = "vllm:generation_tokens_total"
DISK_READ = "sparkple_ple_disk_read_bytes_total"

# Output tok/s others published for this model (docs/benchmark.md has each source, prompts and
# settings): {setup: {streams: figure}}. Not comparable run for run: other prompts and settings.
PUBLISHED: dict[str, dict[int, str]] = {
    "one Spark, seed recipe (table in RAM)": {1: "48.7", 8: "162.9"},
    "one Spark, mmap read by the GPU": {1: "50-51 (code)"},
    "one Spark, table on NVMe (another kit)": {1: "32.5"},
    "two Sparks, MiaAI Dual": {1: "54.4 prose, 75.8 code", 8: "207-226 prose"},
    "two Sparks, TP-2 recipe, MTP K=4": {1: "73", 8: "294", 16: "417"},
    "two Sparks, real-prompt median": {1: "53.7"},
}


def plan_cases(
    prompt_dir: str,
    concurrency: list[int],
    prompts_per_stream: int,
    output_len: int,
    prefill_input_len: int,
    workloads: tuple[str, ...] = WORKLOADS,
) -> list[dict[str, Any]]:
    """Each workload at each concurrency (prompts_per_stream prompts per stream), then the
    prefill case: one stream, long random prompts, one output token (its TTFT is the prefill);
    prefill_input_len 0 leaves it out."""
    if not concurrency or min(concurrency) < 1 or prompts_per_stream < 1 or output_len < 1:
        raise ValueError("concurrency, prompts per stream and output length must be >= 1")
    cases = [
        {"workload": w, "dataset": "sharegpt", "path": f"{prompt_dir}/{w}.json",
         "output_len": output_len, "concurrency": c, "num_prompts": c * prompts_per_stream}
        for w in workloads for c in sorted(set(concurrency))
    ]  # fmt: skip
    if prefill_input_len > 0:
        cases.append({"workload": PREFILL, "dataset": "random", "input_len": prefill_input_len,
                      "output_len": 1, "concurrency": 1, "num_prompts": 2})  # fmt: skip
    return cases


def prometheus_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """The sum over labels of each named series in a Prometheus text exposition."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name in names:
            values[name] = values.get(name, 0.0) + float(value)
    return values


def snapshot(metrics_url: str, textfile_dir: Path, api_key: str = "") -> dict[str, float]:
    """The counters a record compares, now. A series the server or the textfile does not have
    (no MTP, no ple_metrics) is left out, and so is what the record derives from it; no
    metrics_url (a run through the gateway) reads no server counters."""
    values: dict[str, float] = {}
    if metrics_url:
        request = urllib.request.Request(metrics_url)
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(request, timeout=10) as response:
            values = prometheus_values(response.read().decode(), (ACCEPTED, DRAFTS, GENERATED))
    for prom in sorted(textfile_dir.glob("*.prom")) if textfile_dir.is_dir() else []:
        values.update(prometheus_values(prom.read_text(), (DISK_READ,)))
    values["time"] = time.time()
    return values


def drive_power_state(path: Path, sysfs: Path = nvme.SYSFS) -> dict[str, Any] | None:
    """The power-state settings of the NVMe drive that holds `path` (the table): sparkple.nvme's
    report (each controller's APST latency tolerance, nvme_core's default). None where the path
    is on no NVMe drive (the lab)."""
    try:
        rep = nvme.report(nvme.locate(path, sysfs), sysfs)
    except OSError:
        return None
    return rep if rep["controllers"] else None


def describe_drive(state: dict[str, Any] | None) -> str:
    return nvme.line(state) if state else "none"


def load_round(
    url: str, model: str, api_key: str, streams: int, max_tokens: int, deadline: float,
    clock: speedgate.Clock, every_s: float = 0.5,
) -> dict[str, Any]:  # fmt: skip
    """One warm-up round: `streams` completions at once (speedgate's client), its output tok/s
    and the median SM clock read while it ran (None with no clock to read)."""
    with speedgate.ClockSampler(clock, every_s) as sampler:
        rate = speedgate.tok_s(url, model, api_key, streams, 1, max_tokens, deadline)
    seen = sampler.figure()
    return {"tok_s": round(rate, 2), "sm_mhz": seen["sm_mhz"] if seen else None}


def steady(a: dict[str, Any], b: dict[str, Any], within: float) -> bool:
    """Whether two warm-up rounds in a row show a steady GPU: their SM clocks within `within`
    of the higher one; where either has no clock, their tok/s within `within` instead."""
    if a["sm_mhz"] is not None and b["sm_mhz"] is not None:
        return not gpuclock.differ(int(a["sm_mhz"]), int(b["sm_mhz"]), within)
    return bool(abs(a["tok_s"] - b["tok_s"]) <= within * max(a["tok_s"], b["tok_s"]))


def warm_up(
    url: str, model: str, api_key: str, streams: int, max_tokens: int, within: float,
    rounds: int, timeout_s: float, clock: Any = gpuclock.sm_clock,
) -> dict[str, Any]:  # fmt: skip
    """Warm-up rounds until two in a row are steady (the GPU clock, or tok/s where there is no
    clock), at most `rounds`: each round's figures, whether it got steady and by what, and the
    SM clock (current, max MHz; None: none) it left the GPU at."""
    if rounds < 2 or not 0 < within < 1 or streams < 1 or max_tokens < 1:
        raise ValueError("the warm-up needs >= 2 rounds, >= 1 stream and token, 0 < within < 1")
    deadline = time.monotonic() + timeout_s
    seen: list[dict[str, Any]] = []
    while len(seen) < rounds:
        seen.append(load_round(url, model, api_key, streams, max_tokens, deadline, clock))
        if len(seen) >= 2 and steady(seen[-2], seen[-1], within):
            break
    last = clock()
    return {
        "rounds": seen,
        "steady": len(seen) >= 2 and steady(seen[-2], seen[-1], within),
        "by": "GPU clock" if seen[-1]["sm_mhz"] is not None else "tok/s",
        "within": within,
        "gpu_clock_mhz": list(last) if last is not None else None,
    }


def describe_warmup(warmup: dict[str, Any] | None) -> str:
    if not warmup:
        return "no warm-up"
    word = "steady" if warmup["steady"] else "NOT steady"
    return f"{word} by {warmup['by']} after {len(warmup['rounds'])} rounds"


def describe_clock(clock: list[int] | None) -> str:
    return f"{clock[0]}/{clock[1]} MHz" if clock else "none"


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    return after[name] - before[name] if name in before and name in after else None


def record(
    host: str,
    release: str,
    results: Path,
    before: dict[str, float],
    after: dict[str, float],
    kernel: dict[str, str],
    meminfo: dict[str, int],
    conditions: dict[str, Any] | None = None,
    ab: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One host's record from vLLM's per-case results (results/*.json) and two snapshots;
    conditions: what it ran under (warm-up, GPU clock, drive power state); ab: its place in an
    A/B run (arm, run, position, release name)."""
    cases = []
    for path in sorted(results.glob("*.json")):
        result = json.loads(path.read_text())
        case = {k: result.get(k) for k in ("workload", "concurrency", *CASE_FIELDS)}
        if case["workload"] == PREFILL and result.get("p50_ttft_ms"):
            case["prefill_tok_s"] = (
                result["total_input_tokens"] / result["completed"] / (result["p50_ttft_ms"] / 1e3)
            )
        cases.append(case)
    if not cases:
        raise ValueError(f"no benchmark results in {results}")
    generated, drafts = delta(before, after, GENERATED), delta(before, after, DRAFTS)
    accepted, disk = delta(before, after, ACCEPTED), delta(before, after, DISK_READ)
    return {
        "host": host,
        "release": release,
        "cases": cases,
        # mean accepted draft tokens per draft (vLLM's own acceptance length is this plus one)
        "mtp_accepted_per_draft": accepted / drafts if accepted is not None and drafts else None,
        "ple_disk_bytes_per_token": disk / generated if disk is not None and generated else None,
        "mem_available_gib": (
            round(meminfo["MemAvailable"] / 2**30, 2) if "MemAvailable" in meminfo else None
        ),
        "kernel": kernel,
        "conditions": conditions or {},
        **({"ab": ab} if ab else {}),
        "time": after.get("time"),
    }


def output_tok_s(rec: dict[str, Any], workload: str) -> dict[int, float]:
    return {
        int(c["concurrency"]): float(c["output_throughput"])
        for c in rec["cases"]
        if c["workload"] == workload and c.get("output_throughput") is not None
    }


def report(records: list[dict[str, Any]]) -> str:
    """A table of output tok/s per host, workload and concurrency, then the published ones."""
    streams = sorted({c for r in records for w in WORKLOADS for c in output_tok_s(r, w)})
    head = ["host", "release", "workload", *(f"{c} stream{'s' * (c > 1)}" for c in streams)]
    rows = [head]
    for rec in records:
        for workload in WORKLOADS:
            figures = output_tok_s(rec, workload)
            if figures:
                cells = [f"{figures[c]:.1f}" if c in figures else "-" for c in streams]
                rows.append([rec["host"], rec["release"], workload, *cells])
    lines = table(rows)
    extras = []
    for rec in records:
        prefill = [c["prefill_tok_s"] for c in rec["cases"] if c.get("prefill_tok_s")]
        ttft = {c["concurrency"]: c["p50_ttft_ms"] for c in rec["cases"]
                if c["workload"] == "prose"}  # fmt: skip
        parts = [f"TTFT p50 {', '.join(f'{v:.0f} ms @{c}' for c, v in sorted(ttft.items()))}"]
        if prefill:
            parts.append(f"prefill {prefill[0]:.0f} tok/s")
        if rec.get("mtp_accepted_per_draft") is not None:
            parts.append(f"MTP {rec['mtp_accepted_per_draft']:.2f} accepted/draft")
        if rec.get("ple_disk_bytes_per_token") is not None:
            parts.append(f"PLE disk {rec['ple_disk_bytes_per_token'] / 1024:.1f} KiB/token")
        if rec.get("mem_available_gib") is not None:
            parts.append(f"MemAvailable {rec['mem_available_gib']} GiB")
        cond = rec.get("conditions") or {}
        if "gpu_clock_after_mhz" in cond:
            parts.append(f"GPU clock {describe_clock(cond['gpu_clock_after_mhz'])}")
        if "drive" in cond:
            parts.append(f"drive {describe_drive(cond['drive'])}")
        if "warmup" in cond:
            parts.append(f"warm-up {describe_warmup(cond['warmup'])}")
        kernel = ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in sorted(rec["kernel"].items()))
        extras.append(f"{rec['host']}: {'; '.join([*parts, kernel] if kernel else parts)}")
    published = [["published (other prompts and settings)", *(f"@{c}" for c in (1, 8, 16))]]
    for setup, quoted in PUBLISHED.items():
        published.append([setup, *(quoted.get(c, "-") for c in (1, 8, 16))])
    return "\n".join([*lines, *extras, "", *table(published)])


def table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def plot(records: list[dict[str, Any]], out: Path) -> str:
    """tok/s against concurrency, one line per host and workload; says what it wrote."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'sparkple[bench]')"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    streams: set[int] = set()
    for rec in records:
        for workload in WORKLOADS:
            figures = output_tok_s(rec, workload)
            if figures:
                xs = sorted(figures)
                streams.update(xs)
                ax.plot(xs, [figures[x] for x in xs], marker="o",
                        label=f"{rec['host']} {workload}")  # fmt: skip
    ax.set_xticks(sorted(streams))
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title("sparkple benchmark (vllm bench serve)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return f"plot: {out}"


def read_json(path: str) -> Any:
    return json.loads(Path(path).read_text())


def write_json(path: str, data: Any) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    partial.replace(target)


def run(args: argparse.Namespace) -> int:
    if args.step == "plan":
        cases = plan_cases(args.prompt_dir, args.concurrency, args.prompts_per_stream,
                           args.output_len, args.prefill_input_len)  # fmt: skip
        plan = {"base_url": args.base_url, "model": args.model, "tokenizer": args.tokenizer,
                "out_dir": args.results, "case_timeout_s": args.case_timeout_s, "seed": 0,
                "cases": cases}  # fmt: skip
        write_json(args.out, plan)
    elif args.step == "snapshot":
        write_json(args.out, snapshot(args.metrics_url, Path(args.textfile_dir), args.api_key))
    elif args.step == "record":
        kernel: dict[str, str] = {}
        for name in KERNEL_SETTINGS if not args.no_host else ():
            path = Path("/proc/sys") / name.replace(".", "/")
            if path.exists():
                kernel[name] = path.read_text().strip()
        after = snapshot(args.metrics_url, Path(args.textfile_dir), args.api_key)
        meminfo = {} if args.no_host else read_meminfo()
        conditions: dict[str, Any] = {}
        if args.warmup:
            conditions["warmup"] = read_json(args.warmup)
        if not args.no_host:
            clock = gpuclock.sm_clock()
            conditions["gpu_clock_after_mhz"] = list(clock) if clock else None
            table_dir = Path(args.table_dir) if args.table_dir else None
            conditions["drive"] = drive_power_state(table_dir) if table_dir else None
        ab = ({"arm": args.ab_arm, "run": args.ab_run, "position": args.ab_position,
               "release_name": args.ab_release_name} if args.ab_arm else None)  # fmt: skip
        rec = record(args.host, args.release, Path(args.results), read_json(args.before), after,
                     kernel, meminfo, conditions, ab)  # fmt: skip
        write_json(args.out, rec)
    elif args.step == "warmup":
        figures = warm_up(args.url.rstrip("/"), args.model, os.environ.get("OPENAI_API_KEY", ""),
                          args.streams, args.max_tokens, args.within, args.rounds,
                          args.timeout_s)  # fmt: skip
        write_json(args.out, figures)
        print(f"warm-up: {describe_warmup(figures)}, GPU clock "
              f"{describe_clock(figures['gpu_clock_mhz'])}: {figures['rounds']}")  # fmt: skip
    elif args.step == "ab":
        from sparkple.measure import ab as ab_report

        return ab_report.run(args)
    else:
        records = [read_json(p) for p in args.records]
        text = report(records)
        print(text)
        if args.table:
            Path(args.table).write_text(text + "\n")
        if args.plot:
            print(plot(records, Path(args.plot)))
    return 0


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="the fleet benchmark's plan, counters, record and report")
    steps = p.add_subparsers(dest="step", required=True)
    plan = steps.add_parser("plan", help="the cases vLLM's benchmark runs, as JSON")
    plan.add_argument("--out", required=True)
    plan.add_argument("--base-url", required=True)
    plan.add_argument("--model", required=True, help="the served model name")
    plan.add_argument("--tokenizer", required=True, help="the model directory the runner reads")
    plan.add_argument("--prompt-dir", required=True, help="where prose.json and code.json are")
    plan.add_argument("--results", required=True, help="where the runner writes its results")
    plan.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    plan.add_argument("--prompts-per-stream", type=int, default=2)
    plan.add_argument("--output-len", type=int, default=128)
    plan.add_argument("--prefill-input-len", type=int, default=8192)
    plan.add_argument("--case-timeout-s", type=float, default=300)
    for step in ("snapshot", "record"):
        s = steps.add_parser(step, help=f"{step} the counters on the serving host")
        s.add_argument("--out", required=True)
        s.add_argument("--metrics-url", default="", help="vLLM's /metrics (none: no counters)")
        s.add_argument("--textfile-dir", default="/var/lib/prometheus/node-exporter")
        s.add_argument("--api-key", default="")
    rec = steps.choices["record"]
    rec.add_argument("--host", required=True)
    rec.add_argument("--release", required=True)
    rec.add_argument("--results", required=True, help="the runner's per-case results")
    rec.add_argument("--before", required=True, help="the snapshot taken before the run")
    rec.add_argument(
        "--no-host", action="store_true", help="through the gateway: no MemAvailable or sysctls"
    )
    rec.add_argument("--warmup", default="", help="the warm-up's JSON (sparkple bench warmup)")
    rec.add_argument("--table-dir", default="", help="the table: its drive's power state")
    rec.add_argument("--ab-arm", default="", choices=["", "A", "B"], help="an A/B run's arm")
    rec.add_argument("--ab-run", type=int, default=0, help="the arm's first or second run")
    rec.add_argument("--ab-position", type=int, default=0, help="the run's place in A B B A")
    rec.add_argument("--ab-release-name", default="", help="the arm's release name")
    warm = steps.add_parser("warmup", help="load the server until the GPU is steady")
    warm.add_argument("--url", required=True, help="the server's API, e.g. http://127.0.0.1:8000")
    warm.add_argument("--model", required=True, help="the served model name")
    warm.add_argument("--out", required=True)
    warm.add_argument("--streams", type=int, default=8, help="completions at once a round")
    warm.add_argument("--max-tokens", type=int, default=64, help="tokens a completion")
    warm.add_argument("--within", type=float, default=0.05,
                      help="two rounds in a row this close (a share): steady")  # fmt: skip
    warm.add_argument("--rounds", type=int, default=10, help="the most rounds")
    warm.add_argument("--timeout-s", type=float, default=300, help="the warm-up's bound")
    rep = steps.add_parser("report", help="the table (and plot) of host records")
    rep.add_argument("records", nargs="+")
    rep.add_argument("--plot", default="", help="a PNG of tok/s against concurrency")
    rep.add_argument("--table", default="", help="also write the table to this file")
    abr = steps.add_parser("ab", help="the A/B table (and plot) of an A B B A run's records")
    abr.add_argument("records", nargs="+")
    abr.add_argument("--min-band", type=float, default=0.03, help="the narrowest noise band")
    abr.add_argument("--plot", default="", help="a PNG of each figure's B/A ratio and noise band")
    abr.add_argument("--table", default="", help="also write the table to this file")
    abr.add_argument("--json", default="", help="also write the comparison as JSON")
    p.set_defaults(func=run)
