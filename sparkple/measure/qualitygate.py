"""The rollout's quality gate: the canary's answers against the release it replaces
(playbooks/tasks/rollout_quality.yml runs it, after the speed gate).

- `sparkple quality-gate record` asks the current release, before the switch (the host drained),
  for its answers: each fixed prompt's greedy completion (temperature 0) of `tokens` tokens with
  the top-2 logprobs of each where the server reports them, one chat request with `tool_choice:
  required` on a fixed tool, and the MTP acceptance per draft position over those requests
  (vLLM's vllm:spec_decode_num_accepted_tokens_per_pos over vllm:spec_decode_num_drafts, the
  counters' growth on its /metrics) where the server reports it. They go into a file.
- `sparkple quality-gate check` asks the new release the same, with the settings of that file,
  and fails (exit 1) unless
  * greedy agreement: at least --min-agree of the prompts agree: their tokens are equal (the
    text where the server reports no logprobs), or they part where it was a near tie: the token
    one release chose is within --logprob-tolerance of the other's top-1 logprob at that
    position, as the other reported it;
  * the tool call parses: the reply carries at least one tool call, each names one of the tools
    and its arguments are a JSON object valid against that tool's parameters schema;
  * MTP acceptance per draft position is within --mtp-margin of the current release's, where
    both report it; where either does not (no speculative decoding, or the lab) it is skipped,
    and the line says so.
  Its first line is `quality gate: <host> <what>` naming each check's result; the lines after
  it say each prompt's and the tool call's.

Without answers of the release before (it could not be asked: down), agreement and MTP have
nothing to compare with and are skipped, saying so; the tool call is still checked.
Standard library only: it runs with the host's Python.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sparkple.atomicfile import write_text
from sparkple.errors import EXIT_CHECK_FAILED, EXIT_OK, SparkpleError
from sparkple.measure.toolcall import tool_call_errors

# Fixed prompts: short, each asking for a definite continuation. Only their first --prompts are
# asked; the same ones of both releases are compared (the record's settings name them).
PROMPTS = (
    "The three primary colours of light are",
    "In Python, the function that returns the length of a list is called",
    "A DGX Spark has 128 GB of unified memory shared by its CPU and its GPU, so a model",
    "Step 1: drain the server. Step 2: stop it. Step 3:",
)
# The tool a chat request must call (tool_choice: required), and the request's message.
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "set_fan_profile",
        "description": "Set the fan profile of one machine of the fleet.",
        "parameters": {
            "type": "object",
            "properties": {
                "host": {"type": "string", "minLength": 1, "maxLength": 64},
                "percent": {"type": "integer", "minimum": 20, "maximum": 100},
                "mode": {"type": "string", "enum": ["quiet", "balanced", "full"]},
            },
            "required": ["host", "percent", "mode"],
            "additionalProperties": False,
        },
    },
}
TOOL_MESSAGE = "spark-07 runs hot under load: set its fans so that it keeps its clock."
# Top logprobs asked for each token: the chosen one and its runner-up, for the near-tie rule.
TOP_LOGPROBS = 2
# vLLM's MTP counters on /metrics (vllm/v1/spec_decode/metrics.py, SpecDecodingProm; counters
# carry prometheus_client's _total suffix), per draft position ("position" label) and per draft.
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"


def post(url: str, path: str, body: dict[str, Any], api_key: str, timeout_s: float) -> Any:
    request = urllib.request.Request(
        f"{url}{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:300]
        raise SparkpleError(f"{path} at {url} answered {exc.code}: {detail}") from exc
    except (OSError, ValueError) as exc:
        raise SparkpleError(f"{path} at {url} failed: {exc}") from exc


def greedy(
    url: str, model: str, api_key: str, prompt: str, tokens: int, timeout_s: float
) -> dict[str, Any]:
    """One greedy completion: its text, and its tokens with each one's top logprobs where the
    server reports logprobs (None where it does not: the lab)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "logprobs": TOP_LOGPROBS,
    }
    try:
        choice = post(url, "/v1/completions", body, api_key, timeout_s)["choices"][0]
        text = str(choice["text"])
    except (KeyError, IndexError, TypeError) as exc:
        raise SparkpleError(f"a completion from {url} has no text: {exc}") from exc
    logprobs = choice.get("logprobs") or {}
    have = isinstance(logprobs.get("tokens"), list) and isinstance(
        logprobs.get("top_logprobs"), list
    )
    return {
        "text": text,
        "tokens": logprobs["tokens"] if have else None,
        "top": logprobs["top_logprobs"] if have else None,
    }


def tool_call(url: str, model: str, api_key: str, timeout_s: float) -> dict[str, Any]:
    """The reply to a chat request that must call TOOL: its tool calls (name and arguments as
    sent) and finish reason; {"error"} where the server refused or answered none."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": TOOL_MESSAGE}],
        "tools": [TOOL],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 128,
    }
    try:
        choice = post(url, "/v1/chat/completions", body, api_key, timeout_s)["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        return {
            "calls": [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in calls
            ],
            "finish_reason": choice.get("finish_reason"),
        }
    except SparkpleError as exc:
        return {"error": str(exc)}
    except (KeyError, IndexError, TypeError) as exc:
        return {"error": f"the reply is not a chat completion: {type(exc).__name__}: {exc}"}


def spec_counters(url: str, timeout_s: float) -> dict[str, float] | None:
    """The MTP counters on the server's /metrics, summed over engines: {"drafts", "0", "1", ...}
    (accepted tokens per draft position); None where it reports no per-position counter."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except OSError:
        return None
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in (ACCEPTED_PER_POS, DRAFTS):
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        key = "drafts"
        if name == ACCEPTED_PER_POS:
            labels = line.split("{", 1)[1].rsplit("}", 1)[0] if "{" in line else ""
            pos = [
                p.split("=", 1)[1].strip('"')
                for p in labels.split(",")
                if p.strip().startswith("position=")
            ]
            if not pos:
                continue
            key = pos[0]
        found[key] = found.get(key, 0.0) + value
    return found if any(k != "drafts" for k in found) else None


def acceptance(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """MTP acceptance per draft position over the gate's requests: {"per_pos": [rate, ...]}, or
    {"skipped": why}."""
    if before is None or after is None:
        return {"skipped": f"the server reports no {ACCEPTED_PER_POS} on /metrics"}
    drafts = after.get("drafts", 0.0) - before.get("drafts", 0.0)
    if drafts <= 0:
        return {"skipped": "no MTP drafts during the gate's requests"}
    positions = sorted((k for k in after if k != "drafts"), key=int)
    return {
        "per_pos": [round((after[p] - before.get(p, 0.0)) / drafts, 4) for p in positions],
        "drafts": drafts,
    }


def answers(
    url: str, model: str, api_key: str, prompts: int, tokens: int, timeout_s: float
) -> dict[str, Any]:
    """The server's answers to the gate: one request at a time (greedy output of a batch may
    differ from a lone request's on a GPU), the MTP counters read around them."""
    if not 1 <= prompts <= len(PROMPTS) or tokens < 1 or timeout_s <= 0:
        raise SparkpleError(f"prompts must be in 1..{len(PROMPTS)}, tokens >= 1, the timeout > 0")
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SparkpleError(f"the gate's requests did not finish within {timeout_s:g} s")
        return remaining

    before = spec_counters(url, left())
    greedy_answers = [greedy(url, model, api_key, p, tokens, left()) for p in PROMPTS[:prompts]]
    tool = tool_call(url, model, api_key, left())
    mtp = acceptance(before, spec_counters(url, left()))
    return {
        "settings": settings(prompts, tokens),
        "greedy": greedy_answers,
        "tool_call": tool,
        "mtp": mtp,
        "time": time.time(),
    }


def settings(prompts: int, tokens: int) -> dict[str, Any]:
    """What answers are asked with: only answers of the same settings compare."""
    return {
        "prompts": list(PROMPTS[:prompts]),
        "tokens": tokens,
        "tool": TOOL,
        "tool_message": TOOL_MESSAGE,
    }


# -- the checks ---------------------------------------------------------------------------------


def near_tie(top: list[Any] | None, pos: int, chosen: str, tolerance: float) -> bool:
    """Whether, in one release's top logprobs at pos, the token the other chose is within
    tolerance of the top-1's logprob."""
    if not top or pos >= len(top) or not isinstance(top[pos], dict) or chosen not in top[pos]:
        return False
    return bool(max(top[pos].values()) - top[pos][chosen] <= tolerance)


def compare(new: dict[str, Any], old: dict[str, Any], tolerance: float) -> tuple[bool, str]:
    """(agree, what): one prompt's greedy answers of both releases."""
    if new["tokens"] is not None and old["tokens"] is not None:
        a, b, unit = new["tokens"], old["tokens"], "token"
    else:  # no logprobs reported: the text (the same tokens give the same text)
        a, b, unit = new["text"], old["text"], "character"
    if a == b:
        return True, "equal"
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    if (
        unit == "token"
        and at < min(len(a), len(b))
        and (
            near_tie(old["top"], at, a[at], tolerance) or near_tie(new["top"], at, b[at], tolerance)
        )
    ):
        return True, f"part at token {at}, a near tie (within {tolerance:g} of the top-1 logprob)"
    return False, f"differ from {unit} {at}: new {new['text']!r}, current {old['text']!r}"


def verdict(
    host: str,
    new: dict[str, Any],
    old: dict[str, Any] | None,
    min_agree: float,
    tolerance: float,
    margin: float,
    missing: str = "no answers of the current release",
) -> tuple[bool, str]:
    """(passed, what says so): the first line names each check's result, `quality gate: <host>
    ...`; the lines after it each prompt's and the tool call's. `missing` says why there are no
    answers of the current release to compare with, where old is None."""
    parts: list[str] = []
    details: list[str] = []
    passed = True
    tokens = new["settings"]["tokens"]
    if old is None:
        parts.append(f"greedy agreement not compared ({missing})")
    else:
        results = [
            compare(n, o, tolerance) for n, o in zip(new["greedy"], old["greedy"], strict=True)
        ]
        agreed = sum(ok for ok, _ in results)
        need = math.ceil(min_agree * len(results))
        ok = agreed >= need
        passed &= ok
        parts.append(
            f"greedy agreement {agreed}/{len(results)} prompts on the first {tokens} "
            f"tokens ({'>=' if ok else '<'} {need})"
        )
        details += [f"prompt {i + 1}: {what}" for i, (_, what) in enumerate(results)]
    tool_errors = tool_call_errors(new["tool_call"], [new["settings"]["tool"]])
    calls = new["tool_call"].get("calls") or []
    names = ", ".join(c["name"] for c in calls) or "none"
    passed &= not tool_errors
    parts.append(f"tool call {names} {'does not parse' if tool_errors else 'parses'}")
    details.append(
        "tool call: "
        + (
            "; ".join(tool_errors)
            if tool_errors
            else ", ".join(f"{c['name']}({c['arguments']})" for c in calls)
        )
    )
    old_mtp = old["mtp"] if old is not None else {"skipped": missing}
    skipped = new["mtp"].get("skipped") or old_mtp.get("skipped")
    if skipped:
        parts.append(f"MTP acceptance skipped ({skipped})")
    else:
        pairs = list(zip(new["mtp"]["per_pos"], old_mtp["per_pos"], strict=False))
        worst = [i for i, (n, o) in enumerate(pairs) if n < o - margin]
        passed &= not worst
        each = ", ".join(f"{n:.2f}/{o:.2f}" for n, o in pairs)
        where = "within" if not worst else f"below at positions {worst}, more than"
        parts.append(f"MTP acceptance per position new/current {each} ({where} {margin:g})")
    return passed, "\n".join([f"quality gate: {host} " + ", ".join(parts), *details])


def run(args: argparse.Namespace) -> int:
    url, key = args.url.rstrip("/"), os.environ.get("OPENAI_API_KEY", "")
    if args.step == "record":
        got = answers(url, args.model, key, args.prompts, args.tokens, args.timeout_s)
        got["release"] = args.release
        write_text(Path(args.out), json.dumps(got, indent=1, sort_keys=True) + "\n")
        texts = [a["text"] for a in got["greedy"]]
        print(
            f"recorded: {args.out} ({len(texts)} prompts, tool call {got['tool_call']}, "
            f"MTP {got['mtp']})"
        )
        return EXIT_OK
    old = read_answers(args.old)
    if old is not None and old["settings"] != settings(
        len(old["settings"]["prompts"]), old["settings"]["tokens"]
    ):
        # answers kept by another version of this gate (other prompts or tool): not comparable
        old, missing = None, f"the answers at {args.old} were asked with other prompts or tools"
    else:
        missing = "no answers of the current release"
    # the current release's own settings, so that both are asked the same
    prompts, tokens = (
        (len(old["settings"]["prompts"]), old["settings"]["tokens"])
        if old is not None
        else (args.prompts, args.tokens)
    )
    new = answers(url, args.model, key, prompts, tokens, args.timeout_s)
    if args.out:
        write_text(Path(args.out), json.dumps(new, indent=1, sort_keys=True) + "\n")
    passed, line = verdict(
        args.host, new, old, args.min_agree, args.logprob_tolerance, args.mtp_margin, missing
    )
    print(line)
    return EXIT_OK if passed else EXIT_CHECK_FAILED


def read_answers(path: str) -> dict[str, Any] | None:
    """The answers at path; None where there are none (a missing or unreadable file)."""
    if not path:
        return None
    try:
        got = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    keys = ("settings", "greedy", "tool_call", "mtp")
    return got if isinstance(got, dict) and all(k in got for k in keys) else None


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="the rollout's quality gate: record answers, check a release")
    steps = p.add_subparsers(dest="step", required=True)
    for step, what in (
        ("record", "the current release's answers (key: OPENAI_API_KEY)"),
        ("check", "the new release's answers against the recorded ones"),
    ):
        s = steps.add_parser(step, help=what)
        s.add_argument("--url", required=True, help="the server's API, e.g. http://127.0.0.1:8000")
        s.add_argument("--model", required=True, help="the served model name")
        s.add_argument(
            "--prompts",
            type=int,
            default=len(PROMPTS),
            help=f"how many fixed prompts (1..{len(PROMPTS)}; check: the record's)",
        )
        s.add_argument(
            "--tokens",
            type=int,
            default=32,
            help="greedy tokens compared per prompt (check: the record's)",
        )
        s.add_argument("--timeout-s", type=float, default=120, help="the requests' whole bound")
    r = steps.choices["record"]
    r.add_argument("--release", default="", help="the release id the answers belong to")
    r.add_argument("--out", required=True)
    c = steps.choices["check"]
    c.add_argument("--old", default="", help="the current release's answers (none: not compared)")
    c.add_argument("--host", required=True)
    c.add_argument("--out", default="", help="where the new release's answers are written")
    c.add_argument(
        "--min-agree",
        type=float,
        default=1.0,
        help="the share of prompts whose greedy answers must agree",
    )
    c.add_argument(
        "--logprob-tolerance",
        type=float,
        default=0.1,
        help="a parting within this of the top-1 logprob: a near tie",
    )
    c.add_argument(
        "--mtp-margin",
        type=float,
        default=0.1,
        help="MTP acceptance per position may be this much below the current's",
    )
    p.set_defaults(func=run)
