"""bench/disk_offload_compare.py's figures: medians and ratios per step kind, temperature and
arm, the printed table, and the headline with its goals."""

from __future__ import annotations

from typing import Any

from measure import median

KINDS = ("decode@1", "decode@8", "mtp 4x4", "chunk first", "chunk later")
ARMS = ("0.34", "sparkple", "sparkple-noadvice")
GOALS = {"decode": 0.5, "chunk": 0.10, "disk": 0.6}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per (arm, temperature, kind) over every repetition's steps, and the ratios."""
    figures: dict[str, Any] = {}
    for arm, temps in result["runs"].items():
        for temp, kinds in temps.items():
            for kind, runs in kinds.items():
                crit = [c for run in runs for c in run["critical_s"]]
                tokens = sum(run["tokens"] for run in runs)
                # sparkple's steps without decode advice ran in sparkple's own streams: their
                # bytes are sparkple's
                counted = all("disk_bytes" in run for run in runs)
                figures.setdefault(arm, {}).setdefault(temp, {})[kind] = {
                    "critical_us": median(crit) * 1e6,
                    "disk_b_per_token": sum(run["disk_bytes"] for run in runs) / tokens
                    if counted
                    else None,
                    "cache_b_per_token": sum(run["cache_bytes"] for run in runs) / tokens
                    if counted
                    else None,
                    "steps": len(crit),
                }
    syscalls: dict[str, dict[str, dict[str, float]]] = {}
    for key, counted in result.get("syscalls", {}).items():
        arm, kind = key.split("|")
        syscalls.setdefault(arm, {})[kind] = counted
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    base, ours = figures.get("0.34", {}), figures.get("sparkple", {})
    for temp in ("cold", "warm"):
        for kind in KINDS:
            b, s = base.get(temp, {}).get(kind), ours.get(temp, {}).get(kind)
            if b is None or s is None:
                continue
            ratios.setdefault(temp, {})[kind] = {
                "critical": ratio(s["critical_us"], b["critical_us"]),
                "disk": ratio(s["disk_b_per_token"], b["disk_b_per_token"]),
                "cache": ratio(s["cache_b_per_token"], b["cache_b_per_token"]),
            }
    cold = ratios.get("cold", {})
    decode_worst = max(cold[k]["critical"] for k in ("decode@1", "decode@8", "mtp 4x4"))
    chunk = cold["chunk later"]["critical"]
    disk_worst = max(r["disk"] for r in cold.values())
    advice: dict[str, float] = {}
    noadv = figures.get("sparkple-noadvice", {}).get("cold", {})
    for kind in ("decode@1", "decode@8", "mtp 4x4"):
        if kind in noadv:
            advice[kind] = ratio(ours["cold"][kind]["critical_us"], noadv[kind]["critical_us"])
    return {
        "figures": figures,
        "syscalls": syscalls,
        "ratios": ratios,
        "decode_worst": decode_worst,
        "chunk_later": chunk,
        "chunk_first": cold["chunk first"]["critical"],
        "disk_worst": disk_worst,
        "advice_cold": advice,
        "identical": result["identical"],
        "goals_met": {
            "decode": decode_worst <= GOALS["decode"],
            "chunk": chunk <= GOALS["chunk"],
            "disk": disk_worst <= GOALS["disk"],
        },
    }


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else float("inf"))


def syscall_cells(summary: dict[str, Any], arm: str, kind: str) -> tuple[str, str]:
    counted = summary["syscalls"].get(arm, {}).get(kind.split(" ")[0] if "chunk" in kind else kind)
    if not counted:
        return "-", "-"
    return f"{counted['io']:.1f}", f"{counted['all']:.1f}"


def report(result: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    lines = [
        f"table {result['table_gib']:g} GiB ({result['table_bytes'] / 2**30:.2f} GiB packed, "
        f"checkpoint {result['checkpoint_bytes'] / 2**30:.2f} GiB in "
        f"{result['checkpoint_files']} files); {result['reps']} repetitions, medians; "
        f"syscalls: {result['syscall_source']}",
        f"{'kind':<12} {'temp':<5} {'arm':<18} {'crit us':>10} {'io sys/step':>11} "
        f"{'all sys/step':>12} {'disk B/tok':>11} {'cache B/tok':>11} {'crit x':>7} "
        f"{'disk x':>7} {'cache x':>7}",
    ]
    figures = summary["figures"]
    for kind in KINDS:
        for temp in ("cold", "warm"):
            for arm in ARMS:
                fig = figures.get(arm, {}).get(temp, {}).get(kind)
                if fig is None:
                    continue
                io, every = syscall_cells(summary, arm, kind) if temp == "cold" else ("-", "-")
                base = figures["0.34"][temp][kind]
                disk, cache = fig["disk_b_per_token"], fig["cache_b_per_token"]
                cells = ["", "", ""]
                if arm != "0.34":
                    cells = [f"{ratio(fig['critical_us'], base['critical_us']):.3f}", "-", "-"]
                    if disk is not None:
                        cells[1] = f"{ratio(disk, base['disk_b_per_token']):.2f}"
                        cells[2] = f"{ratio(cache, base['cache_b_per_token']):.2f}"
                lines.append(
                    f"{kind:<12} {temp:<5} {arm:<18} {fig['critical_us']:>10.0f} {io:>11} "
                    f"{every:>12} {'-' if disk is None else f'{disk:.0f}':>11} "
                    f"{'-' if cache is None else f'{cache:.0f}':>11} {cells[0]:>7} {cells[1]:>7} "
                    f"{cells[2]:>7}"
                )
    identical = summary["identical"]
    lines.append(
        f"identical staged rows, sparkple vs 0.34: {identical['equal']} of {identical['steps']} "
        "steps"
    )
    advice = summary["advice_cold"]
    if advice:
        lines.append(
            "decode advice (WILLNEED before the decode gather), cold critical path with / "
            "without: " + ", ".join(f"{k} {v:.3f}x" for k, v in advice.items())
        )
    return lines


def headline(summary: dict[str, Any]) -> str:
    goals = summary["goals_met"]

    def mark(name: str) -> str:
        return "met" if goals[name] else "MISSED"

    return (
        f"disk-offload-compare: sparkple / vLLM 0.34 disk_offload, cold: decode critical path "
        f"{summary['decode_worst']:.3f}x at worst (goal <= {GOALS['decode']}: {mark('decode')}), "
        f"prompt chunk {summary['chunk_later']:.3f}x later chunks, {summary['chunk_first']:.3f}x "
        f"first (goal <= {GOALS['chunk']}: {mark('chunk')}), disk bytes per token "
        f"{summary['disk_worst']:.2f}x at worst (goal <= {GOALS['disk']}: {mark('disk')}); rows "
        f"identical in {summary['identical']['equal']}/{summary['identical']['steps']} steps"
    )
