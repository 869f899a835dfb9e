"""The PNG plots of bench/ple_io.py's result, written next to its JSON (matplotlib: the
`bench` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from measure import log


def write_plots(result: dict[str, Any], json_path: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    stem = json_path.with_suffix("")
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    dec = result["decode_bytes_per_token"]
    names = ["page floor", "random", "normal"]
    values = [result["page_floor_bytes_per_token"], dec["random"], dec["normal"]]
    ax.bar(names, [v / 1024 for v in values], color=["grey", "tab:green", "tab:red"])
    ax.set_yscale("log")
    ax.set_ylabel("KiB read from disk per decoded token")
    ax.set_title("Decode I/O per advice mode (cold table)")
    paths.append(_save(fig, f"{stem}-decode-bytes.png"))

    fig = _cdf_plot(plt, result["decode_latency"]["samples_ms"], "ms per token")
    fig.axes[0].set_title("Decode latency per token: cold (serial faults, sparkple) and warm")
    paths.append(_save(fig, f"{stem}-decode-latency.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    pps = result["prefill_pages_per_s"]
    ax.barh(list(pps), [v / 1e3 for v in pps.values()])
    ax.axvline(result["device_qd32_iops"] / 1e3, color="k", ls="--", label="device qd32")
    ax.axvline(result["device_qd1_iops"] / 1e3, color="grey", ls=":", label="device qd1")
    ax.set_xlabel("thousand pages/s, cold 32,768-row gather")
    ax.legend()
    paths.append(_save(fig, f"{stem}-prefill.png"))

    xlabel = "publish-to-observe latency (us), across processes"
    fig = _cdf_plot(plt, result["handshake"]["samples_us"], xlabel)
    paths.append(_save(fig, f"{stem}-handshake.png"))
    return paths


def _cdf_plot(plt: Any, samples: dict[str, list[float]], xlabel: str) -> Any:
    """One cumulative distribution per named sample set, on a log x axis."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in samples.items():
        ordered = np.sort(values)
        ax.plot(ordered, np.linspace(0, 1, len(ordered)), label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.legend()
    return fig


def _save(fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
