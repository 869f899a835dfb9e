"""vLLM's own OpenAI server (`vllm serve`) on a CPU-only machine, started the way the serving
unit starts it: the argv of `sparkple serving-plan` for the snapshot, the rendered patch files
laid over vLLM (harness/engine.lay_tree), the unit's environment and the packed table.

What differs from the unit is listed here, each with its reason: the recipe values a tiny
model needs (TINY_MODEL_RECIPE), the flags a CPU needs (CPU_SERVE_FLAGS), the environment that
puts vLLM on the CPU (harness/engine.ENGINE_ENV) and the few server packages the vLLM test venv
lacks (SERVE_PACKAGES, installed once into the machine's cache).

    plan = serving_plan(snapshot, tiny_model_recipe(snapshot, port), "vllm-0.34")
    env = server_environment(tree, unit_environment(table, stats, cache), serve_packages())
    server = start_server(cpu_serve_argv(plan["argv"]), env, log, url)  # vLLM's CLI
    wait_until_ready(server)   # /health answers 200, or the end of the server's log is raised
    stop_server(server)        # SIGTERM to its process group, wait, SIGKILL: nothing left

Requests must be greedy on this path: a sampled one with top-k/top-p reaches the same Triton
kernel the warmup would (see --enforce-eager below).

harness/engine_serve_client.py asks it through the `openai` client (run in the vLLM venv).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from harness import engine, wheel_cache  # noqa: E402
from harness.procs import process_stats  # noqa: E402

CLIENT_SCRIPT = Path(__file__).resolve().with_name("engine_serve_client.py")
SERVED_MODEL_NAME = "qwen3.8-flash-next"
# The plan's budget is a Spark's (a GB10's MemTotal): this machine's memory may be below the
# recipe's reserve, and the plan would refuse it. vLLM's CPU platform sizes its KV cache from
# VLLM_CPU_KVCACHE_SPACE and takes no fraction of memory, so the budget changes nothing here.
SPARK_MEMTOTAL_BYTES = int(119.7 * 2**30)
# The recipe values (sparkple.serving.recipe.Recipe fields, the role's variables) that differ
# from the role's defaults for the whole tiny model, and why; every other value is the role's.
TINY_MODEL_RECIPE: dict[str, tuple[Any, str]] = {
    "max_model_len": (
        512,
        "the tiny model's context (max_position_embeddings 4096) and 1 GiB of KV",
    ),
    "mtp_depth": (0, "the tiny model has no MTP layers (the plan refuses a depth without them)"),
}
# Flags added to the plan's argv for the CPU, and why. Everything the plan writes stays:
# --compilation-config's cudagraph_mode (vLLM's CPU platform sets NONE), --gpu-memory-utilization
# (ignored: VLLM_CPU_KVCACHE_SPACE), --mamba-ssm-cache-dtype (the CPU platform resets it to
# float32 for the GDN backend), --distributed-executor-backend=mp (a worker process, as on a
# Spark) all start on the CPU as written.
CPU_SERVE_FLAGS: dict[str, str] = {
    "--enforce-eager": (
        "no torch.compile (inductor) and no JIT kernel warmup on the CPU: the warmup samples with "
        "top-k/top-p through vLLM's Triton kernel (v1/sample/ops/topk_topp_triton.py), which "
        "Triton's interpreter cannot run (`row_id.to` on a Python int)"
    ),
    "--language-model-only": (
        "the tiny model has no image processor (preprocessor_config.json): the language half, "
        "as the engine tests load it"
    ),
}
# The environment the serving unit gives the container (roles/vllm_service/templates/
# vllm.service.j2), with the role's default values; the paths are the caller's.
UNIT_ENV_DEFAULTS = {
    "SPARKPLE_PLE_STEP_TIMEOUT": "300",  # vllm_service_step_timeout_s
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "MAX_JOBS": "2",  # vllm_service_max_jobs
    "FLASHINFER_NVCC_THREADS": "1",  # vllm_service_flashinfer_nvcc_threads
    "SPARKPLE_RELEASE_ID": "",  # vllm_service_release_id (outside a release)
    "SPARKPLE_PATCH_MANIFEST_SHA256": "",  # from vllm_patches' fact (none here)
}
UNIT_ENV_PATHS = (
    "SPARKPLE_PLE_TABLE_DIR",
    "SPARKPLE_STATS_DIR",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "FLASHINFER_WORKSPACE_BASE",
    "PYTHONPATH",
)
# The server's packages vLLM 0.34.0 requires that the vLLM test venv (built for the engine and
# its config, harness/venv-requirements.txt) lacks: what `vllm serve` imports, found by running
# it. Installed without dependencies (each one's are in the venv already) into a directory of
# their own behind the vLLM tree on PYTHONPATH, so nothing in the venv is shadowed.
SERVE_PACKAGES = (
    "blake3==1.0.11",
    "jmespath==1.1.0",
    "model-hosting-container-standards==0.1.16",
    "orjson==3.13.0",
    "prometheus-fastapi-instrumentator==8.1.0",
    "python-json-logger==4.2.0",
    "setproctitle==1.3.8",
    "uvicorn==0.55.0",
    "watchfiles==1.3.0",
)
# What a SIGTERM'd server may take to stop (vLLM drains, then ends its engine core and worker).
STOP_GRACE_S = 30.0


def serve_packages(version: str = wheel_cache.VLLM_VERSION) -> Path:
    """The directory of SERVE_PACKAGES for the vLLM `version` venv's Python, built once in the
    machine's cache (the compiled ones are built for that Python)."""
    python = wheel_cache.vllm_venv(version)
    inputs = (str(python), *SERVE_PACKAGES)

    def install(dest: Path) -> None:
        wheel_cache.pip(python, "install", "--no-deps", "--target", str(dest), *SERVE_PACKAGES)

    entry = wheel_cache.CACHE / f"vllm-serve-packages-{version}-{wheel_cache.key(*inputs)}"
    return wheel_cache.build_once(entry, install, "\n".join(inputs) + "\n")


def free_port() -> int:
    """A TCP port nothing listens on now (the server binds it a few seconds later; a port taken
    in between makes the server exit with its error, which wait_until_ready reports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_model_recipe(snapshot: Path, port: int) -> dict[str, Any]:
    """The recipe `sparkple serving-plan --recipe` takes for the whole tiny model: the model,
    the served name, the port, and TINY_MODEL_RECIPE; the role's defaults for the rest."""
    recipe: dict[str, Any] = {
        "model": str(snapshot),
        "served_model_name": SERVED_MODEL_NAME,
        "port": port,
    }
    recipe.update({name: value for name, (value, _) in TINY_MODEL_RECIPE.items()})
    return recipe


def serving_plan(
    snapshot: Path,
    recipe: dict[str, Any],
    patch_profile: str,
    mem_total_bytes: int = SPARK_MEMTOTAL_BYTES,
) -> dict[str, Any]:
    """`sparkple serving-plan SNAPSHOT --json --recipe ... --patch-profile ...`, as the role runs
    it (roles/vllm_service/tasks/plan.yml): the plan, or the plan's refusal raised."""
    cmd = [
        sys.executable, "-m", "sparkple.cli", "serving-plan", str(snapshot), "--json",
        "--recipe", json.dumps(recipe), "--patch-profile", patch_profile,
        "--mem-total-bytes", str(mem_total_bytes),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": wheel_cache.pythonpath(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode:
        raise RuntimeError(f"serving-plan refused (exit {proc.returncode}): {proc.stderr.strip()}")
    plan: dict[str, Any] = json.loads(proc.stdout)
    return plan


def cpu_serve_argv(plan_argv: list[str]) -> list[str]:
    """`vllm serve`'s arguments on this CPU: the plan's, then CPU_SERVE_FLAGS."""
    return [*plan_argv, *CPU_SERVE_FLAGS]


def unit_environment(table: Path | None, stats: Path, cache: Path) -> dict[str, str]:
    """The serving unit's variables for a server here: the packed table (None: vLLM's own
    backend, no SPARKPLE_PLE_TABLE_DIR), the counters' directory and the JIT caches under
    `cache` (the unit's vllm-cache volume)."""
    env = dict(UNIT_ENV_DEFAULTS)
    if table is not None:
        env["SPARKPLE_PLE_TABLE_DIR"] = str(table)
    env.update(
        SPARKPLE_STATS_DIR=str(stats),
        TRITON_CACHE_DIR=str(cache / "triton"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
        FLASHINFER_WORKSPACE_BASE=str(cache / "flashinfer"),
    )
    return env


def server_environment(tree: Path, unit_env: dict[str, str], packages: Path) -> dict[str, str]:
    """The server's environment: ENGINE_ENV (vLLM on the CPU) over the unit's variables, the
    tree and the checkout first on PYTHONPATH (the unit's /opt/sparkple), then the server's
    packages. VLLM_ENABLE_V1_MULTIPROCESSING keeps vLLM's default: the server's AsyncLLM runs
    its engine core in a process of its own whatever it says (0 only warns about the seed)."""
    env = engine.engine_env(tree)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(unit_env)
    # INFO: the packed table's backend names its table in the log when it opens it
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    env["PYTHONPATH"] = wheel_cache.pythonpath(tree, REPO, packages)
    return env


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str
    started: float


def start_server(
    argv: list[str],
    env: dict[str, str],
    log: Path,
    url: str,
    version: str = wheel_cache.VLLM_VERSION,
) -> Server:
    """`vllm serve ARGV` (vLLM's CLI module in the `version` venv), its own process group (the
    API server, its engine core, the worker and their helpers), output into `log`."""
    engine.kernel_module(engine.cpu_flags())
    python = wheel_cache.vllm_venv(version)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(python), "-m", "vllm.entrypoints.cli.main", "serve", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=log.parent,
            start_new_session=True,
        )
    return Server(proc, log, url, time.monotonic())


def log_tail(server: Server, size: int = 6000) -> str:
    text = server.log.read_text(errors="replace")
    return text[-size:]


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    """GET url: (status, body); (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def wait_until_ready(server: Server, timeout: float = 600) -> float:
    """Seconds from the start until /health answers 200; a server that exits or never answers
    raises with the end of its log."""
    deadline = server.started + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited ({server.proc.returncode}) before it was ready "
                f"(log {server.log}):\n{log_tail(server)}"
            )
        status, _ = get(f"{server.url}/health", timeout=5)
        if status == 200:
            return time.monotonic() - server.started
        time.sleep(1)
    raise RuntimeError(
        f"vllm serve not ready after {timeout} s (log {server.log}):\n{log_tail(server)}"
    )


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies left out: a process that exited and
    waits for its parent to reap it, which pytest's subreaper does for an orphan only later)."""
    return [
        pid
        for pid, stat in process_stats().items()
        if stat.pgrp == pgid and stat.state not in ("Z", "X")
    ]


def stop_server(server: Server, grace: float = STOP_GRACE_S) -> dict[str, Any]:
    """SIGTERM to the server's process group, up to `grace` seconds for all of it to end, then
    SIGKILL. Returns the API server's exit status, the seconds it took, the processes that had
    to be killed and any still there."""
    pgid = server.proc.pid
    started = time.monotonic()
    killed: list[str] = []
    if group_members(pgid):
        os.killpg(pgid, signal.SIGTERM)
    while group_members(pgid) and time.monotonic() - started < grace:
        server.proc.poll()  # reap the API server; its children are reaped by their parents
        time.sleep(0.2)
    left = group_members(pgid)
    if left:
        killed = [f"{pid} {engine_process_name(pid)}" for pid in left]
        os.killpg(pgid, signal.SIGKILL)
        while group_members(pgid) and time.monotonic() - started < grace + 10:
            server.proc.poll()
            time.sleep(0.2)
    returncode = server.proc.wait(timeout=10)
    return {
        "returncode": returncode,
        "stop_s": time.monotonic() - started,
        "killed": killed,
        "left": group_members(pgid),
    }


def engine_process_name(pid: int) -> str:
    """A process's command line (vLLM names its own: VLLM::EngineCore, VLLM::Worker)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


def run_client(
    url: str, spec: dict[str, Any], work: Path, version: str = wheel_cache.VLLM_VERSION
) -> dict[str, Any]:
    """harness/engine_serve_client.py on `spec` against the server at `url`, in the vLLM venv
    (it has the `openai` client, a vLLM dependency): its result."""
    python = wheel_cache.vllm_venv(version)
    spec_path, result_path = work / "client-spec.json", work / "client-result.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in engine.CLEARED_ENV}
    proc = subprocess.run(
        [str(python), str(CLIENT_SCRIPT), url, str(spec_path), str(result_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
    )
    if proc.returncode or not result_path.is_file():
        raise RuntimeError(f"the client failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of metric `name`'s samples in Prometheus text whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        found = SAMPLE.match(line.strip())
        if not found or found.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', found.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(found.group(3))
    return total


def ple_counters(stats: Path) -> dict[str, int]:
    """The packed table's counters in a SPARKPLE_STATS_DIR (sparkple/runtime/stats.py's files,
    one per process that opened the table), summed."""
    counters: dict[str, int] = {}
    for path in sorted(stats.glob("ple-stats-*.json")):
        data = json.loads(path.read_text())
        for name, value in data["counters"].items():
            counters[name] = counters.get(name, 0) + int(value)
    return counters
