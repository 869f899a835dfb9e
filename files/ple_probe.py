#!/usr/bin/env python3
"""Health probe: /health and a real 16-token generation, run once per timer tick.

/health can answer 200 while the engine is hung, so the probe also asks for a short completion
and requires usage.completion_tokens > 0. Consecutive failures are counted across runs in
<state-dir>/probe.json. After `wedge_after` consecutive failed generations with /health still
200 the engine is declared wedged: a `wedged` marker is written, the optional wedge command
runs (typically a graceful stop; the supervisor relaunches) and an alert is sent. A failing
/health is not a wedge: the service is down or starting, which is the supervisor's business.

Exit status: 0 healthy, 1 not healthy (the timer's unit shows it), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ple_alert import Alerter
from ple_host import run_command
from ple_state import iso, manual_stop_path, read_json_object, update_json, write_json, write_marker


def log(message: str) -> None:
    print(f"ple-probe: {message}", flush=True)


def read_env_file(path: Path, name: str) -> str:
    """The value of `name` in a KEY=VALUE env file (the service's 0600 secrets file)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SystemExit(f"ple-probe: cannot read API key file {path}: {exc}") from exc
    for line in lines:
        key, sep, value = line.strip().partition("=")
        if sep and key.strip().removeprefix("export ").strip() == name:
            return value.strip().strip("'\"")
    return ""


class Client:
    def __init__(self, base_url: str, api_key: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def request(self, path: str, body: dict[str, Any] | None, timeout_s: float) -> tuple[int, Any]:
        """(HTTP status, parsed JSON or None); status 0 when no response came at all."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as response:
                code, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, None
        except (OSError, ValueError):  # refused, reset, timed out, bad URL
            return 0, None
        try:
            return code, json.loads(raw) if raw.strip() else None
        except ValueError:
            return code, None


def check_generation(client: Client, model: str, timeout_s: float) -> tuple[bool, str]:
    if not model:
        code, models = client.request("/v1/models", None, timeout_s)
        if code == 200 and isinstance(models, dict) and models.get("data"):
            model = str(models["data"][0].get("id", ""))
    body: dict[str, Any] = {
        "prompt": "The capital of France is",
        "max_tokens": 16,
        "temperature": 0,
    }
    if model:
        body["model"] = model
    started = time.monotonic()
    code, reply = client.request("/v1/completions", body, timeout_s)
    took = time.monotonic() - started
    if code != 200:
        return False, f"completion: HTTP {code or 'no response'} after {took:.1f} s"
    usage = reply.get("usage") if isinstance(reply, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or tokens <= 0:
        return False, f"completion: completion_tokens={tokens!r} after {took:.1f} s"
    return True, f"{tokens} tokens in {took:.2f} s"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-dir", type=Path, required=True, help="markers and state (shared)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default="", help="model name; empty: first of /v1/models")
    p.add_argument("--api-key-file", type=Path, help="env file holding the API key")
    p.add_argument("--api-key-var", default="VLLM_API_KEY", help="its variable name")
    p.add_argument("--health-timeout-s", type=float, default=5.0)
    p.add_argument("--generation-timeout-s", type=float, default=60.0)
    p.add_argument("--wedge-after", type=int, default=5, help="failures with /health 200")
    p.add_argument("--container", default="sparkple-vllm", help="container ({container})")
    p.add_argument("--unit", default="sparkple-vllm.service", help="unit ({unit})")
    p.add_argument("--wedged-cmd", default="", help="run when wedged; empty: only report")
    p.add_argument("--wedged-cmd-timeout-s", type=float, default=180.0)
    p.add_argument("--alert-min-interval-s", type=float, default=900.0)
    args = p.parse_args(argv)
    if args.wedge_after < 1:
        p.error("--wedge-after must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state_path = args.state_dir / "probe.json"
    state = read_json_object(state_path)
    failures = int(state.get("consecutive_failures", 0))
    if manual_stop_path(args.state_dir).exists():
        log("manual stop in effect; not probing")
        write_json(state_path, {**state, "last_result": "skipped (manual stop)"})
        return 0

    api_key = read_env_file(args.api_key_file, args.api_key_var) if args.api_key_file else ""
    client = Client(args.url, api_key)
    now = time.time()
    health, _ = client.request("/health", None, args.health_timeout_s)
    alerter = Alerter(args.state_dir, min_interval_s=args.alert_min_interval_s)
    if health != 200:
        ok, detail, result = False, f"/health: HTTP {health or 'no response'}", "down"
        failures = 0  # not a wedge; the supervisor handles a down service
    else:
        ok, detail = check_generation(client, args.model, args.generation_timeout_s)
        result = "healthy" if ok else "generation failing"
        failures = 0 if ok else failures + 1
    state.update(
        last_run=now,
        last_run_iso=iso(now),
        last_result=result,
        last_detail=detail,
        consecutive_failures=failures,
    )
    if ok:
        state["last_ok"] = now
    log(f"{result}: {detail}" + (f" ({failures}/{args.wedge_after})" if failures else ""))

    if failures >= args.wedge_after:
        marker = write_marker(
            args.state_dir,
            "wedged",
            now,
            {
                "reason": f"/health 200 but {failures} generations in a row failed: {detail}",
                "container": args.container,
                "url": args.url,
            },
        )
        log(f"WEDGED: marker {marker}")
        action: dict[str, Any] = {"marker": str(marker)}
        if args.wedged_cmd:
            values = {"container": args.container, "unit": args.unit}
            done = run_command(args.wedged_cmd, values, timeout_s=args.wedged_cmd_timeout_s)
            action["action_exit"] = done.returncode
            update_json(marker, {"action": args.wedged_cmd, "action_exit": done.returncode})
            log(f"wedge action exited {done.returncode}")
        alerter.send("engine-wedged", f"engine wedged: {detail}", action)
        state.update(consecutive_failures=0, last_wedged=now, last_result="wedged")
        state["wedged_total"] = int(state.get("wedged_total", 0)) + 1
    write_json(state_path, state)
    alerter.drain()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
