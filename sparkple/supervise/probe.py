"""Health probe: /health and a real 16-token generation, run once per timer tick.

What the answers mean for vLLM, and what the probe does (state in <state-dir>/probe.json):
  - the unit is not running: the supervisor's business (it relaunches); nothing counted.
  - /health fails before this server instance ever answered 200: it is still starting; the
    supervisor's readiness deadline covers a start that never gets there.
  - /health fails `health_fail_after` times in a row after it had answered 200: the engine
    died (vLLM's /health checks the engine core; a hung PLE wait ends in the step timeout,
    which kills the engine and lands here). An `unhealthy` marker is written, the stop
    command runs (a graceful stop; the supervisor relaunches) and an alert is sent.
  - /health 200 but generations fail or time out: the server is congested (or something
    slower is wrong). After `congested_after` failures in a row an alert says so; nothing is
    stopped, because a restart would drop every request in flight. Only when generations keep
    failing for `congested_stop_s` seconds (a longer, separate window) is the engine declared
    wedged: a `wedged` marker, the stop command and an alert.
A new server instance (the instance command prints another value) starts every count afresh.

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

from .alert import Alerter
from .commands import run_command, service_options
from .state import iso, manual_stop_path, read_json_object, update_json, write_json, write_marker


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


def http_status(url: str, timeout_s: float) -> int:
    """The HTTP status of a GET (0 when no answer came)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read(1024)
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return 0


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[service_options()])
    p.add_argument("--state-dir", type=Path, required=True, help="markers and state (shared)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", default="", help="model name; empty: first of /v1/models")
    p.add_argument("--api-key-file", type=Path, help="env file holding the API key")
    p.add_argument("--api-key-var", default="VLLM_API_KEY", help="its variable name")
    p.add_argument("--health-timeout-s", type=float, default=5.0)
    p.add_argument("--generation-timeout-s", type=float, default=60.0)
    p.add_argument(
        "--instance-cmd",
        default="systemctl show --property=MainPID --value {unit}",
        help="prints an id of the running server instance (empty, 0 or a failure: not running)",
    )
    p.add_argument(
        "--health-fail-after", type=int, default=3, help="/health failures after readiness"
    )
    p.add_argument(
        "--congested-after", type=int, default=3, help="failed generations with /health 200"
    )
    p.add_argument(
        "--congested-stop-s",
        type=float,
        default=1800.0,
        help="seconds of failing generations with /health 200 before a stop; 0: never stop",
    )
    p.add_argument("--stop-cmd", default="", help="stops the engine; empty: only report")
    p.add_argument("--stop-cmd-timeout-s", type=float, default=180.0)
    args = p.parse_args(argv)
    if args.health_fail_after < 1 or args.congested_after < 1 or args.congested_stop_s < 0:
        p.error("--health-fail-after and --congested-after must be >= 1, --congested-stop-s >= 0")
    return args


class Probe:
    def __init__(self, args: argparse.Namespace, state: dict[str, Any]) -> None:
        self.args = args
        self.state = state
        self.values = {"container": args.container, "unit": args.unit}
        self.alerter = Alerter(args.state_dir, min_interval_s=args.alert_min_interval_s)

    def instance(self) -> str:
        done = run_command(self.args.instance_cmd, self.values, timeout_s=30)
        value = done.stdout.strip()
        return value if done.ok and value not in ("", "0") else ""

    def counts(self, **values: Any) -> None:
        self.state.update(values)

    def act(self, kind: str, event: str, now: float, reason: str) -> None:
        """Write the incident marker, stop the engine (the supervisor relaunches), alert."""
        args = self.args
        marker = write_marker(
            args.state_dir,
            kind,
            now,
            {"reason": reason, "container": args.container, "url": args.url},
        )
        log(f"{kind.upper()}: {reason}; marker {marker}")
        action: dict[str, Any] = {"marker": str(marker)}
        if args.stop_cmd:
            done = run_command(args.stop_cmd, self.values, timeout_s=args.stop_cmd_timeout_s)
            action["action_exit"] = done.returncode
            update_json(marker, {"action": args.stop_cmd, "action_exit": done.returncode})
            log(f"stop command exited {done.returncode}")
        self.alerter.send(
            event, f"{reason}; " + ("stopped it" if args.stop_cmd else "not stopped"), action
        )
        self.state[f"last_{kind}"] = now
        self.state[f"{kind}_total"] = int(self.state.get(f"{kind}_total", 0)) + 1
        self.counts(
            health_failures=0, consecutive_failures=0, congested_since=None, ready=False,
            last_result=kind,
        )  # fmt: skip

    def run(self, client: Client, now: float) -> bool:
        args, st = self.args, self.state
        instance = self.instance()
        if not instance:
            self.counts(health_failures=0, consecutive_failures=0, congested_since=None)
            self.counts(ready=False, instance=None)
            self.report("down", "the unit is not running (the supervisor relaunches)", now)
            return False
        if instance != st.get("instance"):
            self.counts(instance=instance, ready=False, health_failures=0)
            self.counts(consecutive_failures=0, congested_since=None)
        health, _ = client.request("/health", None, args.health_timeout_s)
        if health != 200:
            detail = f"/health: HTTP {health or 'no response'}"
            self.counts(consecutive_failures=0, congested_since=None)
            if not st.get("ready"):
                self.report("starting", f"{detail} (not ready yet: the supervisor's deadline)", now)
                return False
            failures = int(st.get("health_failures", 0)) + 1
            self.counts(health_failures=failures)
            self.report("health failing", f"{detail} ({failures}/{args.health_fail_after})", now)
            if failures >= args.health_fail_after:
                self.act(
                    "unhealthy",
                    "engine-dead",
                    now,
                    f"/health failed {failures} times in a row after the server was ready: "
                    f"{detail}",
                )
            return False
        self.counts(ready=True, health_failures=0)
        ok, detail = check_generation(client, args.model, args.generation_timeout_s)
        if ok:
            if st.get("congested_since") is not None:
                self.alerter.send("congestion-over", f"generations work again: {detail}")
            self.counts(consecutive_failures=0, congested_since=None)
            st["last_ok"] = now
            self.report("healthy", detail, now)
            return True
        failures = int(st.get("consecutive_failures", 0)) + 1
        since = st.get("congested_since")
        since = since if isinstance(since, int | float) else now
        self.counts(consecutive_failures=failures, congested_since=since)
        lasted = now - since
        if failures < args.congested_after:
            self.report("generation failing", f"{detail} ({failures}/{args.congested_after})", now)
            return False
        self.report("congested", f"{detail} ({failures} in a row for {lasted:.0f} s)", now)
        self.alerter.send(
            "congested",
            f"/health 200 but {failures} generations in a row failed ({detail}); congested "
            + (
                f", stopped if it lasts {args.congested_stop_s:g} s"
                if args.congested_stop_s
                else ""
            ),
        )
        if args.congested_stop_s and lasted >= args.congested_stop_s:
            self.act(
                "wedged",
                "engine-wedged",
                now,
                f"/health 200 but generations failed for {lasted:.0f} s ({failures} in a row): "
                f"{detail}",
            )
        return False

    def report(self, result: str, detail: str, now: float) -> None:
        self.state.update(
            last_run=now, last_run_iso=iso(now), last_result=result, last_detail=detail
        )
        log(f"{result}: {detail}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state_path = args.state_dir / "probe.json"
    state = read_json_object(state_path)
    if manual_stop_path(args.state_dir).exists():
        log("manual stop in effect; not probing")
        write_json(state_path, {**state, "last_result": "skipped (manual stop)"})
        return 0
    api_key = read_env_file(args.api_key_file, args.api_key_var) if args.api_key_file else ""
    probe = Probe(args, state)
    ok = probe.run(Client(args.url, api_key), time.time())
    write_json(state_path, state)
    probe.alerter.drain()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
