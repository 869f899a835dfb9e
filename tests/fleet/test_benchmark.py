"""The fleet benchmark: its plan, counters, record and report (sparkple/measure/benchmark.py), and
playbooks/benchmark.yml for real on this machine: vLLM's own serving benchmark (from the vLLM
test venv) against a lab server, as the fleet scenario runs it on the lab fleet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ansible_local import ansible_playbook
from lab_inputs import free_port, lab_server

from harness import wheel_cache
from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint
from sparkple.measure import benchmark

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen3.8-flash-next"


def test_the_plan_runs_each_prompt_set_at_each_concurrency_then_the_prefill_case() -> None:
    cases = benchmark.plan_cases("/p", [8, 1, 8], prompts_per_stream=2, output_len=64,
                                 prefill_input_len=4096)  # fmt: skip
    assert [(c["workload"], c["concurrency"], c["num_prompts"]) for c in cases] == [
        ("prose", 1, 2), ("prose", 8, 16), ("code", 1, 2), ("code", 8, 16), ("prefill", 1, 2),
    ]  # fmt: skip
    assert cases[0]["path"] == "/p/prose.json" and cases[0]["dataset"] == "sharegpt"
    assert cases[-1] == {"workload": "prefill", "dataset": "random", "input_len": 4096,
                         "output_len": 1, "concurrency": 1, "num_prompts": 2}  # fmt: skip
    assert all(c["workload"] != "prefill" for c in benchmark.plan_cases("/p", [1], 1, 8, 0))
    with pytest.raises(ValueError, match="must be >= 1"):
        benchmark.plan_cases("/p", [0], 1, 8, 0)


def test_the_counters_sum_over_labels_and_ignore_other_series() -> None:
    text = (
        "# HELP vllm:generation_tokens_total x\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 100.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 20.0\n'
        'vllm:generation_tokens_total_created{engine="0"} 5.0\n'
        "vllm:spec_decode_num_drafts_total 10\n"
    )
    values = benchmark.prometheus_values(text, (benchmark.GENERATED, benchmark.DRAFTS))
    assert values == {benchmark.GENERATED: 120.0, benchmark.DRAFTS: 10.0}


def test_a_record_derives_acceptance_disk_bytes_and_prefill_from_the_counters(
    tmp_path: Path,
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    prose = {"workload": "prose", "concurrency": 1, "completed": 2, "failed": 0,
             "output_throughput": 40.0, "p50_ttft_ms": 80.0, "total_input_tokens": 30}  # fmt: skip
    prefill = {"workload": "prefill", "concurrency": 1, "completed": 2, "failed": 0,
               "output_throughput": 1.0, "p50_ttft_ms": 500.0, "total_input_tokens": 2048,
               "ttfts": [0.5, 0.5]}  # fmt: skip
    (results / "prose-c1.json").write_text(json.dumps(prose))
    (results / "prefill-c1.json").write_text(json.dumps(prefill))
    before = {benchmark.GENERATED: 100.0, benchmark.DRAFTS: 10.0, benchmark.ACCEPTED: 5.0,
              benchmark.DISK_READ: 1_000.0}  # fmt: skip
    after = {benchmark.GENERATED: 300.0, benchmark.DRAFTS: 60.0, benchmark.ACCEPTED: 105.0,
             benchmark.DISK_READ: 21_000.0, "time": 1.0}  # fmt: skip
    rec = benchmark.record("spark-1", "a" * 16, results, before, after,
                           {"vm.swappiness": "0"}, {"MemAvailable": 3 * 2**30})  # fmt: skip
    assert rec["mtp_accepted_per_draft"] == 2.0  # 100 accepted over 50 drafts
    assert rec["ple_disk_bytes_per_token"] == 100.0  # 20,000 bytes over 200 tokens
    assert rec["mem_available_gib"] == 3.0 and rec["kernel"] == {"vm.swappiness": "0"}
    (pf,) = [c for c in rec["cases"] if c["workload"] == "prefill"]
    assert pf["prefill_tok_s"] == 2048.0  # 1,024 tokens a prompt in 0.5 s
    assert "ttfts" not in pf  # per-request lists stay out of the record
    # no counters (a run through the gateway, or a server without MTP): nothing derived
    bare = benchmark.record("gw", "gateway", results, {}, {}, {}, {})
    assert bare["mtp_accepted_per_draft"] is None and bare["mem_available_gib"] is None
    with pytest.raises(ValueError, match="no benchmark results"):
        benchmark.record("x", "y", tmp_path, {}, {}, {}, {})


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """A Python with vLLM 0.33.0 (the vLLM test venv, built once per machine)."""
    return Path(os.environ.get("SPARKPLE_VLLM_PYTHON") or wheel_cache.vllm_venv())


@pytest.fixture(scope="module")
def lab_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """A lab server on this machine serving a synthetic checkpoint (with the byte-level
    tokenizer synth-checkpoint writes): (its model directory, its port)."""
    root = tmp_path_factory.mktemp("bench-lab")
    snap = synth_checkpoint(root / "snap", vocab_base=2048, files=1, seed=3)
    build_table(snap, root / "table", quiet=True)
    # the controller's runner reaches the "Spark" at its address, as in the lab
    args = [f"--served-model-name={MODEL}", "--max-num-seqs=4", "--host", "0.0.0.0"]
    with lab_server(
        root, snap, root / "table", args, {"SPARKPLE_LAB_TOKEN_DELAY_S": "0.01"}
    ) as port:
        yield snap, port


def test_the_playbook_runs_vllms_benchmark_and_keeps_the_record_and_the_table(
    lab_api: tuple[Path, int], vllm_python: Path, tmp_path: Path
) -> None:
    """benchmark.yml with the controller's runner against a lab server standing in for a
    Spark (this machine, connection local): vLLM's benchmark runs every case, the record is
    kept under the Spark's data dir and fetched, and the table and the plot are written."""
    snap, port = lab_api
    data = tmp_path / "data"
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(json.dumps({"sparks": {"hosts": {"spark-1": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
    }}}}))  # fmt: skip
    variables = {
        "sparkple_data_dir": str(data),
        "sparkple_api_port": port,
        "sparkple_served_model_name": MODEL,
        "sparkple_host_python": f"/usr/bin/env PYTHONPATH={ROOT} {sys.executable}",
        "sparkple_benchmark_runner": "controller",
        "sparkple_benchmark_vllm_python": str(vllm_python),
        "sparkple_benchmark_runner_env": {"VLLM_TARGET_DEVICE": "cpu"},
        "sparkple_benchmark_concurrency": [1, 2],
        "sparkple_benchmark_prompts_per_stream": 1,
        "sparkple_benchmark_output_len": 4,
        "sparkple_benchmark_prefill_input_len": 256,
        "sparkple_benchmark_model_dir": str(snap),
        "sparkple_benchmark_results_dir": str(tmp_path / "results"),
        "sparkple_benchmark_metrics_unit": "",  # no systemd, no ple_metrics here
        # a short warm-up: no GPU clock here, so until two rounds agree in tok/s
        "sparkple_benchmark_warmup_streams": 2,
        "sparkple_benchmark_warmup_max_tokens": 8,
        "sparkple_benchmark_warmup_within": 0.25,
    }
    env = {k: v for k, v in os.environ.items() if k != "ANSIBLE_CONFIG"}
    env["ANSIBLE_ROLES_PATH"] = str(ROOT / "roles")
    proc = subprocess.run(
        [ansible_playbook(), "-i", str(inventory), str(ROOT / "playbooks" / "benchmark.yml"),
         "-e", json.dumps(variables)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    (run,) = (tmp_path / "results").iterdir()
    rec = json.loads((run / "spark-1.json").read_text())
    kept = list(data.glob("bench/*/spark-1/record.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == rec
    assert rec["host"] == "spark-1" and rec["release"] == "none"
    cases = {(c["workload"], c["concurrency"]): c for c in rec["cases"]}
    assert sorted(cases) == [("code", 1), ("code", 2), ("prefill", 1), ("prose", 1), ("prose", 2)]
    for (workload, streams), case in cases.items():
        assert case["failed"] == 0
        if workload != "prefill":
            assert case["completed"] == streams and case["total_output_tokens"] == 4 * streams
            assert case["output_throughput"] > 0 and case["p50_itl_ms"] > 0
    assert cases[("prefill", 1)]["prefill_tok_s"] > 0
    assert rec["kernel"]["vm.swappiness"] == Path("/proc/sys/vm/swappiness").read_text().strip()
    assert rec["mem_available_gib"] > 0
    # what it ran under: warmed up until steady (by tok/s: no GPU clock to read here), the clock
    # after it (none) and the table drive's power state (this machine's: none without NVMe)
    cond = rec["conditions"]
    assert cond["warmup"]["steady"] and cond["warmup"]["by"] == "tok/s", cond
    assert len(cond["warmup"]["rounds"]) >= 2 and cond["gpu_clock_after_mhz"] is None
    assert cond["drive"] == benchmark.drive_power_state(data / "table")
    assert "warm-up: steady by tok/s after " in proc.stdout
    table = (run / "table.txt").read_text()
    assert "spark-1  none     prose" in table and "published (other prompts and settings)" in table
    assert (run / "tok-s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bench: prose-c2: 2/2 requests" in proc.stdout


def test_the_runner_names_why_a_case_failed(vllm_python: Path, tmp_path: Path) -> None:
    """vLLM's benchmark against an address where nothing listens: the runner exits 1 and says,
    for the case, why its requests failed (what the playbook's failure message then shows)."""
    tokenizer = tmp_path / "tokenizer"
    snap = synth_checkpoint(tmp_path / "ckpt")
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer / name).write_bytes((snap / name).read_bytes())
    base_url = f"http://127.0.0.1:{free_port()}"
    plan = {
        "base_url": base_url, "model": MODEL, "tokenizer": str(tokenizer),
        "out_dir": str(tmp_path / "results"), "case_timeout_s": 60, "seed": 0,
        "cases": benchmark.plan_cases(str(ROOT / "files" / "benchmark"), [1], 1, 4, 0)[:1],
    }  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = subprocess.run(
        [str(vllm_python), "-m", "sparkple.measure.vllm_bench",
         str(tmp_path / "plan.json")],
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, capture_output=True, text=True, cwd=ROOT,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("bench: prose-c1: ")]
    assert lines[0].startswith("bench: prose-c1: 0/1 requests"), proc.stdout
    # the refused connection, named by its exception (a traceback's last line)
    assert lines[1:] == [
        "bench: prose-c1: a request failed: aiohttp.client_exceptions.ClientConnectorError: "
        f"Cannot connect to host {base_url[7:]} ssl:default "
        f"[Connect call failed ('127.0.0.1', {base_url.rsplit(':', 1)[1]})]"
    ], proc.stdout
