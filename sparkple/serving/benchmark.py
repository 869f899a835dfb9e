"""The fleet benchmark's plan, record and report (playbooks/benchmark.yml runs them).

- `sparkple bench plan` writes the cases vLLM's own serving benchmark runs
  (files/benchmark/run_vllm_bench.py): the prose and code prompt sets at each concurrency, and a
  long-prompt prefill case at one stream, each bounded in prompts and in time.
- `sparkple bench snapshot` reads the counters the record compares, on the host that serves:
  vLLM's spec-decode and generation counters from its /metrics, and the PLE disk reads from
  sparkple's metrics textfile (ple_metrics).
- `sparkple bench record` turns vLLM's results and two snapshots into one host's record: output
  tok/s, TTFT and ITL p50/p99 per case, prefill tok/s, MTP acceptance, PLE disk bytes per
  generated token, MemAvailable and the live kernel settings.
- `sparkple bench report` prints the records as a table beside the published figures (other
  prompts and settings: labelled as published) and, with matplotlib (the `[bench]` extra), plots
  tok/s against concurrency per host.

Standard library only, except the plot.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

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
# vLLM's counters (vllm/v1/metrics/loggers.py) and sparkple's (sparkple/ops/metrics.py)
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
) -> dict[str, Any]:
    """One host's record from vLLM's per-case results (results/*.json) and two snapshots."""
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
        rec = record(args.host, args.release, Path(args.results), read_json(args.before), after,
                     kernel, meminfo)  # fmt: skip
        write_json(args.out, rec)
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
    rep = steps.add_parser("report", help="the table (and plot) of host records")
    rep.add_argument("records", nargs="+")
    rep.add_argument("--plot", default="", help="a PNG of tok/s against concurrency")
    rep.add_argument("--table", default="", help="also write the table to this file")
    p.set_defaults(func=run)
