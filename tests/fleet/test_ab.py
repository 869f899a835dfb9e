"""The benchmark's A/B run (sparkple/measure/ab.py; playbooks/tasks/benchmark_ab.yml runs it on
a Spark, the fleet scenario on the lab fleet): the warm-up until steady, the table drive's
power state, and the A B B A comparison of real records, made as the playbook makes them (the
warm-up, the counters, vLLM's own serving benchmark from the vLLM test venv, the record) against
real lab servers: one stand-in as both arms (every tok/s ratio inside the noise), and a stand-in
twice as slow a token as B (outside).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_sysfs import PCI, controller, disk, on
from lab_inputs import lab_server

from harness import wheel_cache
from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint
from sparkple.measure import ab, benchmark

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen3.8-flash-next"
# the lab engine's time per token of the stand-in, and of the slowed stand-in (twice as slow)
FAST_S, SLOW_S = 0.02, 0.04
# the narrowest noise band for the lab's short runs on a shared machine: the slowed arm's tok/s
# are half the stand-in's (its engine paces each token), far outside it
LAB_MIN_BAND = 0.1


def arm_record(run: int, position: int, arm: str, release: str, name: str) -> dict[str, Any]:
    """A record of an A/B run as `sparkple bench record` writes it, for the comparison's own
    arithmetic."""
    return {"host": "s", "release": release, "cases": [], "conditions": {},
            "ab": {"arm": arm, "run": run, "position": position, "release_name": name}}  # fmt: skip


def with_figures(rec: dict[str, Any], tok_s: float, itl_ms: float) -> dict[str, Any]:
    rec["cases"] = [{"workload": "prose", "concurrency": 1, "output_throughput": tok_s,
                     "p50_ttft_ms": 10.0, "p50_itl_ms": itl_ms, "p99_itl_ms": itl_ms}]  # fmt: skip
    return rec


def abba(
    a: tuple[float, float], b: tuple[float, float], itl: tuple[float, ...] = (10,) * 4
) -> list[dict[str, Any]]:
    """Four records A1 B1 B2 A2 with the given prose tok/s at 1 stream."""
    runs = [(1, 0, "A", a[0]), (1, 1, "B", b[0]), (2, 2, "B", b[1]), (2, 3, "A", a[1])]
    return [
        with_figures(arm_record(run, pos, arm, arm * 16, arm.lower()), tok, itl[pos])
        for run, pos, arm, tok in runs
    ]


def test_the_noise_band_is_the_control_arms_spread_and_never_narrower_than_the_floor() -> None:
    # A's two runs 100 and 102: a spread of 2/101 = 1.98 %, floored at 3 %
    comp = ab.compare(abba((100, 102), (103, 104)), min_band=0.03)
    (tok,) = [r for r in comp["rows"] if r["figure"] == "prose tok/s @1"]
    assert tok["runs"] == [100, 103, 104, 102]
    assert tok["ratio"] == pytest.approx(103.5 / 101) and tok["band"] == 0.03
    assert tok["outside"] is False and tok["verdict"] == "inside"
    # a lower floor leaves A's spread as the band: 2.5 % is then outside, and higher is better
    comp = ab.compare(abba((100, 102), (103, 104)), min_band=0.01)
    (tok,) = [r for r in comp["rows"] if r["figure"] == "prose tok/s @1"]
    assert tok["band"] == pytest.approx(2 / 101) and tok["verdict"] == "outside: B better"
    # latencies: lower is better, so a longer ITL in B is worse
    comp = ab.compare(abba((100, 100), (100, 100), itl=(10, 20, 20, 10)), min_band=0.03)
    (itl,) = [r for r in comp["rows"] if r["figure"] == "ITL p50 ms @1"]
    assert itl["ratio"] == 2.0 and itl["verdict"] == "outside: B worse"
    # a figure no run has is left out; one that some runs lack has no ratio
    assert "MTP accepted/draft" not in [r["figure"] for r in comp["rows"]]
    runs = abba((100, 100), (100, 100))
    runs[1]["mem_available_gib"] = 3.0
    (mem,) = [r for r in ab.compare(runs, 0.03)["rows"] if r["figure"] == "MemAvailable GiB"]
    assert mem["ratio"] is None and mem["verdict"] == "-"


def test_runs_that_are_not_a_b_b_a_of_one_release_per_arm_are_not_compared() -> None:
    complete, refused = ab.runs_by_host(abba((1, 1), (1, 1))[:3])
    assert complete == {} and refused == ["A/B s: runs A B B, not A B B A: not compared"]
    runs = abba((1, 1), (1, 1))
    runs[2]["release"] = "c" * 16
    complete, refused = ab.runs_by_host(runs)
    assert complete == {} and "two releases" in refused[0]
    # in any order on the way in, A B B A by position on the way out
    complete, refused = ab.runs_by_host(list(reversed(abba((1, 1), (1, 1)))))
    assert [r["ab"]["position"] for r in complete["s"]] == [0, 1, 2, 3] and refused == []


def test_the_drive_power_state_is_read_from_sysfs_for_the_drive_that_holds_the_path(
    tmp_path: Path,
) -> None:
    """sparkple.nvme's report of the table's drive (tests/pkg/test_nvme.py covers the tree's
    walk): none on no NVMe drive, else each controller's latency tolerance in the record."""
    table = tmp_path / "table"
    table.mkdir()
    sysfs = tmp_path / "sys"
    assert benchmark.drive_power_state(table, sysfs) is None  # no such device in sysfs
    disk(sysfs, f"{PCI}/ata1/host0/target0:0:0/0:0:0:0/block", "sda", "8", parts=1)
    on(sysfs, table, "sda1")
    assert benchmark.drive_power_state(table, sysfs) is None  # not NVMe
    disk(sysfs, controller(sysfs, "nvme1", knob="0"), "nvme1n1", "259", parts=2)
    on(sysfs, table, "nvme1n1p2")
    state = benchmark.drive_power_state(table, sysfs)
    assert state is not None and state["device"] == "nvme1n1p2"
    off = {"name": "nvme1", "latency_tolerance_us": "0", "apst": "APST off"}
    assert state["controllers"] == [off]
    assert benchmark.describe_drive(state).startswith("table drive nvme1n1p2: nvme1 APST off")
    assert benchmark.describe_drive(None) == "none"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two lab servers on this machine serving one synthetic checkpoint: the stand-in and the
    slowed stand-in (twice its time per token); their ports, the model and the table."""
    root = tmp_path_factory.mktemp("ab-lab")
    snap = synth_checkpoint(root / "snap", vocab_base=2048, files=1, seed=7)
    build_table(snap, root / "table", quiet=True)
    args = [f"--served-model-name={MODEL}", "--max-num-seqs=4"]
    (root / "fast").mkdir()
    (root / "slow").mkdir()
    with (
        lab_server(root / "fast", snap, root / "table", args,
                   {"SPARKPLE_LAB_TOKEN_DELAY_S": str(FAST_S)}) as fast,
        lab_server(root / "slow", snap, root / "table", args,
                   {"SPARKPLE_LAB_TOKEN_DELAY_S": str(SLOW_S)}) as slow,
    ):  # fmt: skip
        yield {"fast": fast, "slow": slow, "snap": snap, "table": root / "table"}


def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def test_the_warm_up_waits_for_a_steady_gpu_clock_or_without_one_for_steady_tok_s(
    servers: dict[str, Any],
) -> None:
    """Against the real stand-in: a clock that climbs from 600 MHz to 2,950 over 1.2 s keeps
    the warm-up going until two rounds in a row read the same clock; with no clock (the lab),
    two rounds in a row agree in tok/s."""
    import time

    start = time.monotonic()

    def climbing() -> tuple[int, int]:
        return min(600 + int(2000 * (time.monotonic() - start)), 2950), 3003

    warm = benchmark.warm_up(url(servers["fast"]), MODEL, "", streams=2, max_tokens=8,
                             within=0.05, rounds=40, timeout_s=120, clock=climbing)  # fmt: skip
    clocks = [r["sm_mhz"] for r in warm["rounds"]]
    assert warm["steady"] and warm["by"] == "GPU clock", warm
    assert len(clocks) >= 3 and clocks[0] < 1500 and clocks[-1] == 2950, clocks
    assert not benchmark.steady(warm["rounds"][0], warm["rounds"][1], 0.05)
    assert warm["gpu_clock_mhz"] == [2950, 3003]
    assert all(r["tok_s"] > 0 for r in warm["rounds"])

    warm = benchmark.warm_up(url(servers["fast"]), MODEL, "", streams=2, max_tokens=8,
                             within=0.25, rounds=10, timeout_s=120, clock=lambda: None)  # fmt: skip
    assert warm["steady"] and warm["by"] == "tok/s" and warm["gpu_clock_mhz"] is None, warm
    last, before = warm["rounds"][-1]["tok_s"], warm["rounds"][-2]["tok_s"]
    assert abs(last - before) <= 0.25 * max(last, before)
    # the stand-in paces its tokens: two streams make at most 2 / FAST_S tok/s
    assert 0 < last <= 2 / FAST_S


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "sparkple.cli", "bench", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip


def one_run(
    out: Path, servers: dict[str, Any], which: str, vllm_python: Path, ab_place: list[str]
) -> Path:
    """One run of an arm as tasks/benchmark_host.yml makes it with the controller's runner:
    the warm-up, the counters before, vLLM's benchmark, the record; its record's path."""
    out.mkdir(parents=True)
    api = url(servers[which])
    steps = [
        ["warmup", "--url", api, "--model", MODEL, "--out", str(out / "warmup.json"),
         "--streams", "2", "--max-tokens", "8", "--within", "0.25", "--rounds", "10"],
        ["snapshot", "--out", str(out / "before.json"), "--metrics-url", api + "/metrics",
         "--textfile-dir", str(out / "no-textfiles")],
        ["plan", "--out", str(out / "plan.json"), "--base-url", api, "--model", MODEL,
         "--tokenizer", str(servers["snap"]), "--prompt-dir", str(ROOT / "files" / "benchmark"),
         "--results", str(out / "results"), "--output-len", "16", "--prompts-per-stream", "2",
         "--prefill-input-len", "256", "--case-timeout-s", "120", "--concurrency", "1", "2"],
    ]  # fmt: skip
    for step in steps:
        done = cli(*step)
        assert done.returncode == 0, done.stdout + done.stderr
    runner = subprocess.run(
        [str(vllm_python), "-m", "sparkple.measure.vllm_bench",
         str(out / "plan.json")],
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, capture_output=True, text=True, cwd=ROOT,
        timeout=600, check=False,
    )  # fmt: skip
    assert runner.returncode == 0, runner.stdout + runner.stderr
    done = cli("record", "--out", str(out / "record.json"), "--before", str(out / "before.json"),
               "--results", str(out / "results"), "--host", "lab-spark",
               "--release", f"{which:x<16}", "--metrics-url", api + "/metrics",
               "--textfile-dir", str(out / "no-textfiles"), "--table-dir", str(servers["table"]),
               "--warmup", str(out / "warmup.json"), *ab_place)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out / "record.json"


def place(arm: str, run: int, position: int, name: str) -> list[str]:
    return ["--ab-arm", arm, "--ab-run", str(run), "--ab-position", str(position),
            "--ab-release-name", name]  # fmt: skip


def relabel(record: Path, to: Path, arm: str, run: int, position: int, name: str) -> Path:
    """The same run in the other A/B run (its place in that one)."""
    rec = json.loads(record.read_text())
    rec["ab"] = {"arm": arm, "run": run, "position": position, "release_name": name}
    to.write_text(json.dumps(rec))
    return to


def test_the_a_b_table_of_real_runs_puts_one_stand_in_inside_the_noise_and_a_slowed_one_outside(
    servers: dict[str, Any], tmp_path: Path
) -> None:
    """Six real runs in this order: the stand-in, the slowed stand-in twice, the stand-in three
    times. A B B A of the first four is the slowed A/B; the stand-in's four runs are A B B A of
    the stand-in against itself. The table, the JSON and the plot are written."""
    vllm_python = Path(os.environ.get("SPARKPLE_VLLM_PYTHON") or wheel_cache.vllm_venv())
    order = [
        ("fast", place("A", 1, 0, "stand-in")), ("slow", place("B", 1, 1, "slowed")),
        ("slow", place("B", 2, 2, "slowed")), ("fast", place("A", 2, 3, "stand-in")),
        ("fast", place("B", 2, 2, "stand-in")), ("fast", place("A", 2, 3, "stand-in")),
    ]  # fmt: skip
    runs = [one_run(tmp_path / f"run{i}", servers, which, vllm_python, ab_place)
            for i, (which, ab_place) in enumerate(order)]  # fmt: skip
    slowed = runs[:4]
    same = [runs[0], relabel(runs[3], tmp_path / "b1.json", "B", 1, 1, "stand-in"), *runs[4:]]

    first = json.loads(runs[0].read_text())
    assert first["ab"] == {"arm": "A", "run": 1, "position": 0, "release_name": "stand-in"}
    cond = first["conditions"]
    assert cond["warmup"]["steady"] and cond["warmup"]["by"] == "tok/s"
    assert cond["gpu_clock_after_mhz"] is None  # no nvidia-smi here
    assert cond["drive"] == benchmark.drive_power_state(servers["table"])

    results: dict[str, dict[str, Any]] = {}
    for name, records in (("slowed", slowed), ("same", same)):
        out = tmp_path / name
        done = cli("ab", "--min-band", str(LAB_MIN_BAND), "--table", f"{out}.txt",
                   "--json", f"{out}.json", "--plot", f"{out}.png", *map(str, records))  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        (comp,) = json.loads(Path(f"{out}.json").read_text())
        results[name] = {"comp": comp, "stdout": done.stdout,
                         "rows": {r["figure"]: r for r in comp["rows"]}}  # fmt: skip
        assert Path(f"{out}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert Path(f"{out}.txt").read_text() in done.stdout

    tok_s = [f"{w} tok/s @{n}" for w in ("prose", "code") for n in (1, 2)]
    same_rows = results["same"]["rows"]
    for figure in tok_s:
        row = same_rows[figure]
        assert row["band"] >= LAB_MIN_BAND and not row["outside"], row
        assert 0.9 <= row["ratio"] <= 1.1, row
    slow_rows = results["slowed"]["rows"]
    for figure in tok_s:
        row = slow_rows[figure]
        # the slowed engine paces each token at twice the time: half the tok/s, whatever the load
        assert row["outside"] and row["verdict"] == "outside: B worse", row
        assert 0.35 <= row["ratio"] <= 0.7, row
    assert slow_rows["ITL p50 ms @1"]["verdict"] == "outside: B worse"
    assert slow_rows["ITL p50 ms @1"]["ratio"] > 1.4

    text = results["slowed"]["stdout"].splitlines()
    assert text[0] == (
        f"A/B on lab-spark, run A B B A: A = {'fast':x<16} (stand-in), B = {'slow':x<16} (slowed)"
    )
    assert text[1].split() == ["figure", "A1", "B1", "B2", "A2", "B/A", "noise", "verdict"]
    assert any(line.startswith("prose tok/s @1 ") and "outside: B worse" in line for line in text)
    assert any(line.startswith("A1: warm-up steady by tok/s after ") for line in text)
    assert "GPU clock none before, none after" in results["slowed"]["stdout"]
    assert text[-2].startswith("A/B lab-spark: B/A prose tok/s @1 0.")
    assert "outside the noise" in text[-2] and text[-1].startswith("plot: ")
    assert "inside the noise" in results["same"]["stdout"].splitlines()[-2]
