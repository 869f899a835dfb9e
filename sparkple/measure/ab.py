"""An A/B run's comparison: two releases on one Spark, measured A B B A
(playbooks/benchmark.yml -e ab=A,B runs them; `sparkple bench ab RECORD...` compares them).

Each of the four runs is one benchmark record (sparkple/measure/benchmark.py) that says its
place in the run (`record["ab"]`: arm A or B, its first or second run, its position in A B B A).
A drift over the run (a clock, a page cache, a neighbour) weighs on both arms alike in that
order, so each figure's ratio is B's mean over A's mean. A is the control: the spread of its
two runs, |A1 - A2| over their mean, is the noise band of the figure, never narrower than
`min_band` (two runs may agree by chance); a ratio further from 1 than its band lies outside the
noise, and the table says whether B is then better or worse (higher tok/s, MTP acceptance and
MemAvailable are better; lower latencies and disk bytes per token are).

Standard library only, except the plot (matplotlib, the `[bench]` extra).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkple.errors import EXIT_CHECK_FAILED, SparkpleError
from sparkple.measure.benchmark import describe_clock, describe_drive, describe_warmup
from sparkple.measure.benchmark import table as columns

ORDER = ("A", "B", "B", "A")
WORKLOADS = ("prose", "code")


@dataclass(frozen=True)
class Figure:
    name: str
    higher_is_better: bool
    read: Callable[[dict[str, Any]], float | None]


def case(rec: dict[str, Any], workload: str, streams: int) -> dict[str, Any]:
    for c in rec["cases"]:
        if c["workload"] == workload and int(c["concurrency"]) == streams:
            return dict(c)
    return {}


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def of_case(workload: str, streams: int, key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda rec: number(case(rec, workload, streams).get(key))


def prefill_tok_s(rec: dict[str, Any]) -> float | None:
    return number(case(rec, "prefill", 1).get("prefill_tok_s"))


def disk_kib_per_token(rec: dict[str, Any]) -> float | None:
    value = number(rec.get("ple_disk_bytes_per_token"))
    return value / 1024 if value is not None else None


def figures(records: list[dict[str, Any]]) -> list[Figure]:
    """What the table compares: output tok/s of each prompt set at each number of streams;
    TTFT p50 and ITL p50/p99 of the prose set at the fewest and the most streams; prefill
    tok/s; MTP accepted tokens per draft; PLE disk KiB per generated token; MemAvailable."""
    streams = sorted({int(c["concurrency"]) for r in records for c in r["cases"]
                      if c["workload"] in WORKLOADS})  # fmt: skip
    out = [Figure(f"{w} tok/s @{n}", True, of_case(w, n, "output_throughput"))
           for w in WORKLOADS for n in streams]  # fmt: skip
    for n in sorted({streams[0], streams[-1]}) if streams else []:
        out += [
            Figure(f"TTFT p50 ms @{n}", False, of_case("prose", n, "p50_ttft_ms")),
            Figure(f"ITL p50 ms @{n}", False, of_case("prose", n, "p50_itl_ms")),
            Figure(f"ITL p99 ms @{n}", False, of_case("prose", n, "p99_itl_ms")),
        ]
    return [
        *out,
        Figure("prefill tok/s", True, prefill_tok_s),
        Figure("MTP accepted/draft", True, lambda r: number(r.get("mtp_accepted_per_draft"))),
        Figure("PLE disk KiB/token", False, disk_kib_per_token),
        Figure("MemAvailable GiB", True, lambda r: number(r.get("mem_available_gib"))),
    ]


def runs_by_host(
    records: list[dict[str, Any]],
) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Each host's four runs in their order, A B B A with one release per arm; and why each
    other host's runs are not compared (an arm that failed leaves its run out)."""
    hosts: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if "ab" not in rec:
            raise SparkpleError(f"{rec.get('host')}: a record of no A/B run")
        hosts.setdefault(rec["host"], []).append(rec)
    complete, refused = {}, []
    for host, runs in hosts.items():
        runs.sort(key=lambda r: int(r["ab"]["position"]))
        order = " ".join(r["ab"]["arm"] for r in runs)
        if order != " ".join(ORDER):
            refused.append(f"A/B {host}: runs {order}, not A B B A: not compared")
        elif any(len({r["release"] for r in runs if r["ab"]["arm"] == arm}) != 1 for arm in "AB"):
            refused.append(f"A/B {host}: an arm's two runs are of two releases: not compared")
        else:
            complete[host] = runs
    return complete, refused


def compare(runs: list[dict[str, Any]], min_band: float) -> dict[str, Any]:
    """One host's comparison: per figure its four values (A1 B1 B2 A2), the means, B/A, the
    noise band and the verdict."""
    if not 0 <= min_band < 1:
        raise SparkpleError("the narrowest noise band is a share in [0, 1)")
    rows = []
    for fig in figures(runs):
        values = [fig.read(r) for r in runs]
        row: dict[str, Any] = {"figure": fig.name, "higher_is_better": fig.higher_is_better,
                               "runs": values, "ratio": None, "band": None, "outside": None,
                               "verdict": "-"}  # fmt: skip
        if all(v is None for v in values):
            continue
        if None not in values:
            a = [values[0], values[3]]
            b = [values[1], values[2]]
            a_mean, b_mean = sum(a) / 2, sum(b) / 2  # type: ignore[arg-type]
            if a_mean > 0:
                ratio = b_mean / a_mean
                band = max(abs(a[0] - a[1]) / a_mean, min_band)  # type: ignore[operator]
                outside = abs(ratio - 1) > band
                better = (ratio > 1) == fig.higher_is_better
                row.update(ratio=ratio, band=band, outside=outside,
                           verdict=(f"outside: B {'better' if better else 'worse'}"
                                    if outside else "inside"))  # fmt: skip
        rows.append(row)
    arm = {a: next(r for r in runs if r["ab"]["arm"] == a) for a in "AB"}
    return {
        "host": runs[0]["host"],
        "releases": {
            a: {"id": arm[a]["release"], "name": arm[a]["ab"].get("release_name", "")} for a in "AB"
        },
        "min_band": min_band,
        "rows": rows,
        "conditions": [
            {"run": f"{r['ab']['arm']}{r['ab']['run']}", **(r.get("conditions") or {})}
            for r in runs
        ],
    }


def cell(value: float | None) -> str:
    if value is None:
        return "-"
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.{digits}f}"


def headline(comp: dict[str, Any]) -> str:
    """The run's last line: the first tok/s figure's ratio and how many lie outside the noise."""
    rows = [r for r in comp["rows"] if r["ratio"] is not None]
    outside = [r for r in rows if r["outside"]]
    first = next((r for r in rows if "tok/s @" in r["figure"]), rows[0] if rows else None)
    if first is None:
        return f"A/B {comp['host']}: no figure in all four runs"
    where = "outside" if first["outside"] else "inside"
    return (
        f"A/B {comp['host']}: B/A {first['figure']} {first['ratio']:.2f}, {where} the noise "
        f"(±{first['band']:.1%}); {len(outside)} of {len(rows)} figures outside"
    )


def table(comp: dict[str, Any]) -> list[str]:
    rel = comp["releases"]
    head = (
        f"A/B on {comp['host']}, run A B B A: A = {rel['A']['id']} ({rel['A']['name'] or '-'}), "
        f"B = {rel['B']['id']} ({rel['B']['name'] or '-'})"
    )
    rows = [["figure", "A1", "B1", "B2", "A2", "B/A", "noise", "verdict"]]
    for r in comp["rows"]:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        band = f"±{r['band']:.1%}" if r["band"] is not None else "-"
        rows.append([r["figure"], *(cell(v) for v in r["runs"]), ratio, band, r["verdict"]])
    conditions = [
        f"{c['run']}: warm-up {describe_warmup(c.get('warmup'))}, GPU clock "
        f"{describe_clock((c.get('warmup') or {}).get('gpu_clock_mhz'))} before, "
        f"{describe_clock(c.get('gpu_clock_after_mhz'))} after, "
        f"drive {describe_drive(c.get('drive'))}"
        for c in comp["conditions"]
    ]
    noise = (
        f"noise band: the spread of A's two runs, |A1 - A2| / mean(A), at least "
        f"{comp['min_band']:.1%}; B/A = mean(B1, B2) / mean(A1, A2)"
    )
    return [head, *columns(rows), noise, *conditions, headline(comp)]


def plot(comps: list[dict[str, Any]], out: Path) -> str:
    """Each figure's B/A ratio (a dot, red outside the noise) on its noise band (grey), one
    panel per host; says what it wrote."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'sparkple[bench]')"
    tall = max(len(c["rows"]) for c in comps)
    fig, axes = plt.subplots(len(comps), 1, figsize=(7, 0.32 * tall + 1.4), squeeze=False)
    for ax, comp in zip(axes[:, 0], comps, strict=True):
        rows = [r for r in comp["rows"] if r["ratio"] is not None]
        ys = list(range(len(rows)))
        for y, r in zip(ys, rows, strict=True):
            ax.plot([1 - r["band"], 1 + r["band"]], [y, y], color="0.8", linewidth=6)
            ax.plot([r["ratio"]], [y], "o", color="tab:red" if r["outside"] else "black")
        ax.axvline(1.0, color="0.4", linewidth=0.8)
        ax.set_yticks(ys)
        ax.set_yticklabels([r["figure"] for r in rows], fontsize="small")
        ax.invert_yaxis()
        rel = comp["releases"]
        names = {a: rel[a]["name"] or rel[a]["id"] for a in "AB"}
        ax.set_title(f"{comp['host']}: B {names['B']} / A {names['A']} (A B B A)")
        ax.set_xlabel("B/A (grey: the noise band of A's two runs)")
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return f"plot: {out}"


def run(args: argparse.Namespace) -> int:
    records = [json.loads(Path(p).read_text()) for p in args.records]
    complete, refused = runs_by_host(records)
    comps = [compare(runs, args.min_band) for runs in complete.values()]
    text = "\n\n".join(["\n".join(table(c)) for c in comps] + refused)
    print(text)
    if not comps:
        return EXIT_CHECK_FAILED
    if args.table:
        Path(args.table).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(comps, indent=1, sort_keys=True) + "\n")
    if args.plot:
        print(plot(comps, Path(args.plot)))
    return 0
