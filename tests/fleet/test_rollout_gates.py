"""The canary's gates after its health gate, against real lab servers: the speed gate's warm-up
and GPU clock (sparkple/measure/speedgate.py, playbooks/tasks/rollout_speed.yml) and the quality
gate (sparkple/measure/qualitygate.py, playbooks/tasks/rollout_quality.yml).

Two lab servers serve one synthetic model, each with a table built from its own checkpoint (two
seeds: the same geometry, other rows): the lab engine's tokens come from the rows it looks up,
so the second stands for a release whose table was built from another checkpoint. A stand-in
`nvidia-smi` (a script on PATH) gives the speed gate a clock where the machine has none.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from ansible_local import run_playbook
from lab_inputs import ROOT, lab_server

from sparkple.builder.build import build_table
from sparkple.builder.synth import synth_checkpoint
from sparkple.measure import qualitygate, speedgate, toolcall

pytestmark = pytest.mark.slow  # lab servers, and a few ansible-playbook runs

MODEL = "qwen3.8-flash-next"
DELAY_S = 0.01  # the lab engine's time per token: its tok/s paced, so warm-up rounds agree


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """{"rows": the server on its checkpoint's table, "other": on another checkpoint's}."""
    root = tmp_path_factory.mktemp("gates-lab")
    snap = synth_checkpoint(root / "snap", vocab_base=2048, files=1, seed=0)
    build_table(snap, root / "table", quiet=True)
    other = synth_checkpoint(root / "other", vocab_base=2048, files=1, seed=1)
    build_table(other, root / "table-other", quiet=True)
    args = [f"--served-model-name={MODEL}", "--max-num-seqs=8"]
    env = {"SPARKPLE_LAB_TOKEN_DELAY_S": str(DELAY_S)}
    (root / "a").mkdir()
    (root / "b").mkdir()
    # the model's config (its geometry) from the first checkpoint for both, as a release does
    with (
        lab_server(root / "a", snap, root / "table", args, env) as rows,
        lab_server(root / "b", snap, root / "table-other", args, env) as wrong,
    ):
        yield {"rows": f"http://127.0.0.1:{rows}", "other": f"http://127.0.0.1:{wrong}"}


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def forced(tool_choice: Any = "required", max_tokens: int = 64) -> dict[str, Any]:
    other = {
        "type": "function",
        "function": {
            "name": "reboot",
            "parameters": {
                "type": "object",
                "properties": {"now": {"type": "boolean"}},
                "required": ["now"],
            },
        },
    }
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": qualitygate.TOOL_MESSAGE}],
        "tools": [qualitygate.TOOL, other],
        "tool_choice": tool_choice,
        "max_tokens": max_tokens,
    }


# -- the lab's tool call ----------------------------------------------------------------------


def test_the_lab_answers_a_required_tool_call_in_vllms_shape_from_its_rows(
    servers: dict[str, str],
) -> None:
    code, body = post(servers["rows"], forced())
    assert code == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    tools = forced()["tools"]
    reply = {"calls": [call["function"]], "finish_reason": choice["finish_reason"]}
    assert toolcall.tool_call_errors(reply, tools) == []
    # the same request, the same call (greedy); the other table's rows make another
    again = post(servers["rows"], forced())[1]["choices"][0]["message"]["tool_calls"][0]
    assert again["function"] == call["function"]
    other = post(servers["other"], forced())[1]["choices"][0]["message"]["tool_calls"][0]
    assert other["function"] != call["function"]
    assert toolcall.tool_call_errors({"calls": [other["function"]]}, tools) == []


def test_a_named_tool_is_called_and_a_call_cut_by_max_tokens_does_not_parse(
    servers: dict[str, str],
) -> None:
    named = {"type": "function", "function": {"name": "reboot"}}
    code, body = post(servers["rows"], forced(named))
    assert code == 200
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "reboot" and isinstance(json.loads(call["arguments"])["now"], bool)
    code, body = post(servers["rows"], forced(max_tokens=3))
    assert code == 200 and body["choices"][0]["finish_reason"] == "length"
    calls = [body["choices"][0]["message"]["tool_calls"][0]["function"]]
    errors = toolcall.tool_call_errors({"calls": calls}, forced()["tools"])
    assert errors and "not JSON" in errors[0]
    # as vLLM: tool_choice needs tools
    code, body = post(servers["rows"], {**forced(), "tools": None})
    assert code == 400 and "`tools` must be set" in body["error"]["message"]


# -- the quality gate's checks --------------------------------------------------------------------


def answer(tokens: list[str], top: list[dict[str, float]] | None = None) -> dict[str, Any]:
    return {"text": "".join(tokens), "tokens": tokens, "top": top}


def test_greedy_answers_that_part_at_a_near_tie_agree_and_others_do_not() -> None:
    old = answer(["a", "b", "c"], [{"a": -0.1}, {"b": -0.69, "x": -0.70}, {"c": -0.1}])
    near = answer(["a", "x", "y"], [{"a": -0.1}, {"x": -0.69, "b": -0.70}, {"y": -0.1}])
    agree, what = qualitygate.compare(near, old, 0.1)
    assert agree and what.startswith("part at token 1, a near tie")
    assert not qualitygate.compare(near, old, 0.001)[0]  # a tighter tolerance: a difference
    far = answer(["a", "z", "c"], [{"a": -0.1}, {"z": -0.01, "b": -4.6}, {"c": -0.1}])
    agree, what = qualitygate.compare(far, old, 0.1)
    assert not agree and what.startswith("differ from token 1")
    # no logprobs reported (the lab): the text decides
    assert not qualitygate.compare(
        answer(["a", "z"]) | {"tokens": None}, answer(["a", "b"]) | {"tokens": None}, 0.1
    )[0]


def test_tool_arguments_are_checked_against_the_schema() -> None:
    tools = [qualitygate.TOOL]
    ok = {"host": "spark-07", "percent": 80, "mode": "full"}
    call = {"calls": [{"name": "set_fan_profile", "arguments": json.dumps(ok)}]}
    assert toolcall.tool_call_errors(call, tools) == []
    for bad, why in [
        ({**ok, "percent": 101}, "outside [20, 100]"),
        ({**ok, "percent": 80.5}, "not an integer"),
        ({**ok, "mode": "loud"}, "not one of"),
        ({"host": "x", "percent": 50}, "lacks mode"),
        ({**ok, "extra": 1}, "does not allow"),
        ({**ok, "host": ""}, "outside the schema's lengths"),
    ]:
        call = {"calls": [{"name": "set_fan_profile", "arguments": json.dumps(bad)}]}
        errors = toolcall.tool_call_errors(call, tools)
        assert len(errors) == 1 and why in errors[0], (bad, errors)
    assert (
        "not one of"
        in toolcall.tool_call_errors({"calls": [{"name": "rm", "arguments": "{}"}]}, tools)[0]
    )
    assert "no tool call" in toolcall.tool_call_errors({"calls": []}, tools)[0]


@pytest.fixture
def spec_metrics() -> Iterator[tuple[list[str], str]]:
    """A /metrics in vLLM's shape whose MTP counters are the list's next text at each read."""
    texts: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            body = (texts.pop(0) if texts else "").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield texts, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def counters(drafts: float, per_pos: list[float]) -> str:
    labels = 'engine="0",model_name="m"'
    lines = [
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
    ]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {v}'
        for i, v in enumerate(per_pos)
    ]
    return "\n".join(lines) + "\n"


def test_mtp_acceptance_per_position_from_the_counters_growth(spec_metrics) -> None:
    texts, url = spec_metrics
    texts += [counters(100, [80, 50]), counters(200, [170, 90])]
    before = qualitygate.spec_counters(url, 5)
    got = qualitygate.acceptance(before, qualitygate.spec_counters(url, 5))
    assert got == {"per_pos": [0.9, 0.4], "drafts": 100.0}
    assert (
        "reports no" in qualitygate.acceptance(qualitygate.spec_counters(url, 5), None)["skipped"]
    )
    texts += [counters(5, [1]), counters(5, [1])]
    same = qualitygate.acceptance(
        qualitygate.spec_counters(url, 5), qualitygate.spec_counters(url, 5)
    )
    assert same == {"skipped": "no MTP drafts during the gate's requests"}


def test_mtp_acceptance_below_the_margin_fails_the_gate() -> None:
    tool = {
        "calls": [
            {
                "name": "set_fan_profile",
                "arguments": '{"host": "a", "percent": 20, "mode": "quiet"}',
            }
        ]
    }
    base = {"settings": qualitygate.settings(1, 4), "greedy": [answer(["a"])], "tool_call": tool}
    old = {**base, "mtp": {"per_pos": [0.8, 0.5]}}
    passed, line = qualitygate.verdict(
        "h", {**base, "mtp": {"per_pos": [0.78, 0.45]}}, old, 1.0, 0.1, 0.1
    )
    assert (
        passed
        and "MTP acceptance per position new/current 0.78/0.80, 0.45/0.50 (within 0.1)" in line
    )
    passed, line = qualitygate.verdict(
        "h", {**base, "mtp": {"per_pos": [0.8, 0.3]}}, old, 1.0, 0.1, 0.1
    )
    assert not passed and "(below at positions [1], more than 0.1)" in line.splitlines()[0]


# -- the gates as the rollout runs them ---------------------------------------------------------

QUALITY = f"""
- hosts: localhost
  gather_facts: false
  vars_files: [{ROOT}/playbooks/vars/rollout.yml]
  tasks:
    - ansible.builtin.include_tasks: {ROOT}/playbooks/tasks/rollout_quality.yml
      vars:
        rollout_quality_step: "{{{{ item.step }}}}"
        sparkple_api_url: "{{{{ item.url }}}}"
      loop: "{{{{ gate_steps }}}}"
"""


def gate_vars(tmp_path: Path, **more: object) -> dict[str, object]:
    return {
        "sparkple_host_python": sys.executable,
        "sparkple_served_model_name": MODEL,
        "sparkple_api_key": "",
        "sparkple_release_dir": str(tmp_path / "releases"),
        "rollout_from_id": "current0000000000",
        "release_id": "new0000000000000",
        "release_name": "N",
        "sparkple_rollout_quality_gate_prompts": 2,
        "sparkple_rollout_quality_gate_tokens": 8,
        **more,
    }


def test_the_quality_gate_passes_the_same_rows_and_fails_another_checkpoints(
    servers: dict[str, str], tmp_path: Path
) -> None:
    for release in ("current0000000000", "new0000000000000"):
        (tmp_path / "releases" / release).mkdir(parents=True)
    steps = [{"step": "record", "url": servers["rows"]}, {"step": "check", "url": servers["rows"]}]
    same = run_playbook(tmp_path, QUALITY, gate_vars(tmp_path, gate_steps=steps))
    assert same.returncode == 0, same.stdout[-3000:]
    assert (
        "quality gate: localhost greedy agreement 2/2 prompts on the first 8 tokens (>= 2), "
        "tool call set_fan_profile parses, MTP acceptance skipped (the server reports no "
        "vllm:spec_decode_num_accepted_tokens_per_pos_total on /metrics)"
    ) in same.stdout
    kept = json.loads((tmp_path / "releases" / "current0000000000" / "quality.json").read_text())
    assert [len(a["text"]) for a in kept["greedy"]] == [8, 8]

    wrong = run_playbook(
        tmp_path,
        QUALITY,
        gate_vars(tmp_path, gate_steps=[{"step": "check", "url": servers["other"]}]),
    )
    assert wrong.returncode == 2, wrong.stdout[-3000:]
    assert "Fail the canary that failed the quality gate" in wrong.stdout
    assert (
        "quality gate: localhost greedy agreement 0/2 prompts on the first 8 tokens (< 2), "
        "tool call set_fan_profile parses"
    ) in wrong.stdout
    new = json.loads((tmp_path / "releases" / "new0000000000000" / "quality.json").read_text())
    assert all(n["text"] != o["text"] for n, o in zip(new["greedy"], kept["greedy"], strict=True))


def test_without_answers_of_the_current_release_only_the_tool_call_is_checked(
    servers: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "releases" / "new0000000000000").mkdir(parents=True)
    steps = [
        {"step": "record", "url": "http://127.0.0.1:9"},
        {"step": "check", "url": servers["other"]},
    ]
    proc = run_playbook(tmp_path, QUALITY, gate_vars(tmp_path, gate_steps=steps))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "the current release current0000000000 could not be asked" in proc.stdout
    assert (
        "quality gate: localhost greedy agreement not compared (no answers of the current "
        "release), tool call set_fan_profile parses"
    ) in proc.stdout


SPEED = f"""
- hosts: localhost
  gather_facts: false
  vars_files: [{ROOT}/playbooks/vars/rollout.yml]
  tasks:
    - ansible.builtin.set_fact:
        rollout_speed_refused: ""
        rollout_speed_verdict: ""
    - ansible.builtin.include_tasks: {ROOT}/playbooks/tasks/rollout_speed.yml
      vars:
        rollout_speed_step: gate
    - ansible.builtin.debug:
        msg: "refused=[{{{{ rollout_speed_refused }}}}] verdict=[{{{{ rollout_speed_verdict }}}}]"
"""


def fake_nvidia_smi(bin_dir: Path, mhz: int) -> None:
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho '{mhz}, 3003'\n")
    script.chmod(0o755)


def speed_vars(tmp_path: Path, url: str) -> dict[str, object]:
    return gate_vars(
        tmp_path,
        sparkple_api_url=url,
        sparkple_rollout_speed_gate_requests=1,
        sparkple_rollout_speed_gate_max_tokens=8,
        sparkple_rollout_speed_gate_streams=[1, 4],
    )


def old_figures(tmp_path: Path, clock: int | None, tok_s: float) -> None:
    old = tmp_path / "releases" / "current0000000000"
    old.mkdir(parents=True)
    figures = {
        "tok_s": {"1": tok_s, "4": 4 * tok_s},
        "settings": speedgate.settings([1, 4], 1, 8),
        "gpu_clock": clock and {"sm_mhz": clock, "max_mhz": 3003, "samples": 5},
    }
    (old / "speed.json").write_text(json.dumps(figures))
    (tmp_path / "releases" / "new0000000000000").mkdir()


def test_figures_under_clocks_too_far_apart_are_measured_again_then_not_compared(
    servers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old release's figures were taken at 2,900 MHz, the new release runs at 600 (an idle
    GB10's clock): measured twice, never compared, neither passed nor failed, and said."""
    fake_nvidia_smi(tmp_path / "bin", 600)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    # figures so far above the lab's that a comparison would fail the canary
    old_figures(tmp_path, 2900, 1e6)
    proc = run_playbook(tmp_path, SPEED, speed_vars(tmp_path, servers["rows"]))
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = proc.stdout
    refused = (
        "speed gate: localhost not compared: GPU clock 600 MHz (new) vs 2900 MHz (old) "
        "differ by more than 10%"
    )
    assert (
        out.count(refused) >= 2 and "speed gate: localhost measuring the new release again" in out
    )
    assert (
        f"refused=[{refused}, measured again: not rolled back; the rollout stops after the "
        "quality gate with localhost on new0000000000000 (N) for the operator] verdict=[]"
    ) in out
    assert "speed gate: localhost GPU clock: new 600/3003 MHz" in out
    assert "; old 2900/3003 MHz (median of 5)" in out
    # neither failed (the playbook passed) nor passed: no figures kept for the next rollout
    measured = json.loads(
        (tmp_path / "releases" / "new0000000000000" / "speed.json.measured").read_text()
    )
    assert measured["gpu_clock"]["sm_mhz"] == 600 and len(measured["warmup"]["rounds"]) >= 2
    assert not (tmp_path / "releases" / "new0000000000000" / "speed.json").exists()


def test_figures_under_close_clocks_are_compared_and_the_conditions_said(
    servers: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path / "bin", 2850)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    old_figures(tmp_path, 2900, 1e6)
    proc = run_playbook(tmp_path, SPEED, speed_vars(tmp_path, servers["rows"]))
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "Fail the canary below the speed gate's ratio" in proc.stdout
    assert "not compared" not in proc.stdout
    assert "speed gate: localhost GPU clock: new 2850/3003 MHz" in proc.stdout
    # the warm-up is said either way: a loaded machine may keep two rounds from agreeing
    assert re.search(
        r"speed gate: localhost warm-up: new (settled after|did NOT settle in) ", proc.stdout
    )


def test_the_warm_up_runs_until_two_rounds_agree(servers: dict[str, str]) -> None:
    """Rounds of a paced server agree; the clock read while the cases run is recorded."""
    reads: list[int] = []

    def clock() -> tuple[int, int]:
        reads.append(1)
        return (1000 + 100 * len(reads), 3003)

    got = speedgate.measure(servers["rows"], MODEL, "", [1, 4], 1, 8, 60, 0.3, 6, clock)
    assert got["warmup"]["settled"] and 2 <= len(got["warmup"]["rounds"]) <= 6
    rounds = got["warmup"]["rounds"]
    assert speedgate.agree(rounds[-1], rounds[-2], 0.3)
    assert got["gpu_clock"]["samples"] == len(reads) >= 1 and got["gpu_clock"]["max_mhz"] == 3003


def test_the_warm_up_stops_at_two_rounds_in_agreement_or_at_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU clocking up: each round faster until two agree within the share."""
    seen = iter([10.0, 20.0, 30.0, 31.0, 99.0])
    monkeypatch.setattr(speedgate, "tok_s", lambda *_: next(seen))
    got = speedgate.warm_up("http://unused", MODEL, "", 8, 8, 0.05, 6, 1e12)
    assert got == {"rounds": [10.0, 20.0, 30.0, 31.0], "settled": True, "within": 0.05}
    assert speedgate.describe_warmup({"warmup": got}).startswith("settled after 4 rounds")
    never = iter([10.0, 20.0, 40.0, 80.0])
    monkeypatch.setattr(speedgate, "tok_s", lambda *_: next(never))
    got = speedgate.warm_up("http://unused", MODEL, "", 8, 8, 0.05, 3, 1e12)
    assert got["rounds"] == [10.0, 20.0, 40.0] and not got["settled"]
    said = speedgate.describe_warmup({"warmup": got})
    assert said == "did NOT settle in 3 rounds (10.0, 20.0, 40.0 tok/s, not within 5%)"


def test_check_exits_3_on_clocks_apart_and_compares_unknown_clocks(tmp_path: Path) -> None:
    def write(name: str, clock: int | None) -> str:
        figures = {
            "tok_s": {"1": 10.0},
            "settings": speedgate.settings([1], 1, 8),
            "gpu_clock": clock and {"sm_mhz": clock, "max_mhz": 3003, "samples": 3},
        }
        (tmp_path / name).write_text(json.dumps(figures))
        return str(tmp_path / name)

    def check(new: str, old: str) -> subprocess.CompletedProcess[str]:
        argv = [
            sys.executable,
            "-m",
            "sparkple.cli",
            "speed-gate",
            "check",
            "--new",
            new,
            "--old",
            old,
            "--host",
            "h",
            "--clock-share",
            "0.1",
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)

    apart = check(write("low.json", 2000), write("high.json", 2900))
    assert apart.returncode == speedgate.EXIT_NOT_COMPARED
    assert apart.stdout.splitlines()[0] == (
        "speed gate: h not compared: GPU clock 2000 MHz (new) vs 2900 MHz (old) differ by more "
        "than 10%"
    )
    close = check(write("near.json", 2700), write("high.json", 2900))
    assert close.returncode == 0 and "(ratio 1.00 >= 0.9)" in close.stdout
    unknown = check(write("none.json", None), write("high.json", 2900))
    assert unknown.returncode == 0
    assert "GPU clock: new none reported (no nvidia-smi); old 2900/3003 MHz" in unknown.stdout
