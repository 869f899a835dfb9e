"""bench/disk_offload_compare.py at a tiny size, so that it cannot rot: a real synthetic
checkpoint and packed table, vLLM 0.34.0's disk offload from the wheel beside sparkple's host
step, cold (evicted, checked with mincore inside the benchmark) and warm.

Checked: the printed table's shape, that both arms staged byte-identical rows in every step,
and what is exact whatever the machine's speed: a cold read reaches the disk; vLLM's backend
issues one preadv per distinct row and plane (a decode token's 16 rows lie in 16 different head
ranges, so they are distinct: 32 reads), sparkple none (it reads through its mapping).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "disk_offload_compare.py"
KINDS = ("decode@1", "decode@8", "mtp 4x4", "chunk first", "chunk later")
ARMS = ("0.34", "sparkple", "sparkple-noadvice")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[list[str], dict]:
    work = tmp_path_factory.mktemp("disk-offload-compare")  # the real disk, not tmpfs
    out = work / "result.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--table-gib", "0.03",
        "--work", str(work / "inputs"),
        "--reps", "2",
        "--decode-steps", "3",
        "--mtp-steps", "2",
        "--chunks", "2",
        "--chunk-tokens", "64",
        "--decode-ms", "1",
        "--chunk-ms", "5",
        "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout.strip().splitlines(), json.loads(out.read_text())


@pytest.mark.slow
def test_the_table_has_a_row_per_kind_temperature_and_arm(run) -> None:
    lines, _ = run
    header = next(i for i, line in enumerate(lines) if line.startswith("kind "))
    for column in ("crit us", "io sys/step", "all sys/step", "disk B/tok", "cache B/tok"):
        assert column in lines[header]
    seen = set()
    for line in lines[header + 1 :]:
        kind = next((k for k in KINDS if line.startswith(k + " ")), None)
        if kind is None:
            continue
        temp, arm, *numbers = line[len(kind) :].split()
        seen.add((kind, temp, arm))
        # crit, io and all syscalls, disk, cache; and the three ratios beside the baseline's
        assert len(numbers) == (5 if arm == "0.34" else 8), line
    want = {(k, t, a) for k in KINDS for t in ("cold", "warm") for a in ARMS}
    want -= {(k, t, "sparkple-noadvice") for k in ("chunk first", "chunk later")
             for t in ("cold", "warm")}  # fmt: skip
    assert seen == want
    assert lines[-1].startswith("disk-offload-compare: sparkple / vLLM 0.34 disk_offload")
    assert "decode critical path" in lines[-1] and "disk bytes per token" in lines[-1]


@pytest.mark.slow
def test_both_arms_staged_identical_rows_in_every_step(run) -> None:
    lines, result = run
    identical = result["identical"]
    # 2 reps x cold and warm x (3 + 3 decode steps, 2 MTP steps, 2 chunks)
    assert identical["steps"] == 2 * 2 * (3 + 3 + 2 + 2)
    assert identical["equal"] == identical["steps"]
    assert f"{identical['steps']} of {identical['steps']} steps" in "\n".join(lines)


@pytest.mark.slow
def test_cold_reads_reach_the_disk_and_the_page_cache(run) -> None:
    _, result = run
    figures = result["summary"]["figures"]
    for arm in ("0.34", "sparkple"):
        for kind in KINDS:
            cold = figures[arm]["cold"][kind]
            assert cold["disk_b_per_token"] > 0 and cold["cache_b_per_token"] > 0, (arm, kind)
    # sparkple's steps without decode advice ran in sparkple's streams: their bytes are its
    assert figures["sparkple-noadvice"]["cold"]["decode@1"]["disk_b_per_token"] is None


@pytest.mark.slow
def test_syscalls_are_counted_for_real(run) -> None:
    lines, result = run
    if shutil.which("strace") is None:
        assert "strace is not installed" in result["syscall_source"]
        return
    assert "strace -c -f" in result["syscall_source"]
    counted = result["syscalls"]
    decode = counted["0.34|decode@1"]["by_name"]
    reads = decode.get("preadv2", 0) + decode.get("preadv", 0)
    assert reads == 3 * 16 * 2  # 3 steps, 16 distinct rows a token, codes and scales
    ours = counted["sparkple|decode@1"]["by_name"]
    assert ours.get("preadv2", 0) + ours.get("preadv", 0) + ours.get("pread64", 0) == 0
    assert counted["0.34|decode@1"]["io"] >= 32
