"""The rollout's speed gate: a short fixed load on one server, and the verdict on a new release
against the figures of the release it replaces (playbooks/tasks/rollout_speed.yml runs it).

- `sparkple speed-gate measure` puts the load on a server and writes its figures: for each
  number of streams, that many clients at once, each sending `requests` completions of
  `max_tokens` tokens (EOS ignored, so every request makes them all) one after another; output
  tokens/s is the completion tokens of the case over its wall time, as vLLM's benchmark
  computes its output throughput. It warms the server up first: one short request, then
  rounds of the largest stream count (one completion a stream), untimed, until two rounds in a
  row agree within --warmup-within (a GPU that idled, as a drained canary's did, clocks up only
  under load), at most --warmup-rounds. It samples the GPU's SM clock (sparkple.measure.gpuclock,
  `nvidia-smi`) while it measures and records it beside the figures, with the warm-up's rounds.
- `sparkple speed-gate check` compares a new release's figures with the old one's, stream count
  by stream count, and fails (exit 1) when the lowest ratio is under the floor, naming both
  figures; passing, it keeps the new figures where the next rollout reads them (--keep). It
  says the conditions of both (warm-up, GPU clock) on lines of their own, and refuses to
  compare figures whose clocks differ by more than --clock-share of the higher one (exit 3,
  EXIT_NOT_COMPARED, a line saying so): a ratio between two clocks measures the clocks, not
  the releases. Neither figure is then held against the other: the caller decides (the
  rollout measures the new release again, then stops without rolling it back).

The same client, prompt and settings measure both releases: the figures compare a release with
the one before it on the same host, not with the benchmark's (playbooks/benchmark.yml) or anyone
else's. Figures taken with other settings are not compared: `measure --reuse` measures again
where the kept ones differ, `check` refuses them.
Standard library only: it runs with the host's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkple.atomicfile import write_text
from sparkple.errors import EXIT_CHECK_FAILED, EXIT_OK, SparkpleError
from sparkple.measure import gpuclock

# `check`'s exit status where the figures were measured under clocks too far apart to compare
EXIT_NOT_COMPARED = 3
# Seconds between two reads of the GPU's clock while a case runs.
CLOCK_EVERY_S = 1.0

PROMPT = (
    "Explain, step by step and in plain words, how a desk-side machine serves a large language "
    "model to several people at once, and what limits how fast each of them sees an answer."
)


def complete(url: str, model: str, api_key: str, max_tokens: int, timeout_s: float) -> int:
    """One completion of max_tokens tokens (EOS ignored); its completion tokens."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(json.load(response)["usage"]["completion_tokens"])
    except (OSError, ValueError, KeyError) as exc:
        raise SparkpleError(f"a completion from {url} failed: {exc}") from exc


def tok_s(url: str, model: str, api_key: str, streams: int, requests: int, max_tokens: int,
          deadline: float) -> float:  # fmt: skip
    """Output tokens/s of `streams` clients at once, each sending `requests` completions."""
    made: list[int] = []
    errors: list[str] = []

    def client() -> None:
        try:
            for _ in range(requests):
                made.append(complete(url, model, api_key, max_tokens, deadline - time.monotonic()))
        except SparkpleError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0))
    elapsed = time.monotonic() - start
    if errors:
        raise SparkpleError(f"{streams} stream(s): {errors[0]}")
    if any(thread.is_alive() for thread in threads):
        raise SparkpleError(f"{streams} stream(s) did not finish within the measurement's time")
    return sum(made) / elapsed


# what reads the GPU's (current, max) SM clock in MHz: sparkple.measure.gpuclock.sm_clock, or None
Clock = Callable[[], tuple[int, int] | None]


class ClockSampler:
    """The GPU's SM clock read every `every_s` (CLOCK_EVERY_S) while a measurement runs (in a
    thread): `read` is sparkple.measure.gpuclock.sm_clock or a stand-in; nothing is sampled where
    it answers None (no nvidia-smi: the lab)."""

    def __init__(self, read: Clock, every_s: float = CLOCK_EVERY_S) -> None:
        self.read = read
        self.every_s = every_s
        self.samples: list[tuple[int, int]] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        first = self.read()
        if first is not None:
            self.samples.append(first)
            self.thread = threading.Thread(target=self.loop, daemon=True)
            self.thread.start()
        return self

    def loop(self) -> None:
        while not self.stop.wait(self.every_s):
            sample = self.read()
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    def figure(self) -> dict[str, int] | None:
        """The median SM clock sampled, its max and how many samples; None with none."""
        if not self.samples:
            return None
        current = int(statistics.median(c for c, _ in self.samples))
        highest = max(m for _, m in self.samples)
        return {"sm_mhz": current, "max_mhz": highest, "samples": len(self.samples)}


def agree(a: float, b: float, within: float) -> bool:
    """Whether two rounds' tok/s differ by at most `within` of the higher one."""
    return abs(a - b) <= within * max(a, b)


def warm_up(url: str, model: str, api_key: str, streams: int, max_tokens: int, within: float,
            rounds: int, deadline: float) -> dict[str, Any]:  # fmt: skip
    """Untimed rounds of `streams` clients (one completion each) until two rounds in a row agree
    within `within`, at most `rounds`: {"rounds": each round's tok/s, "settled", "within"}."""
    seen: list[float] = []
    while len(seen) < rounds:
        seen.append(round(tok_s(url, model, api_key, streams, 1, max_tokens, deadline), 2))
        if len(seen) >= 2 and agree(seen[-1], seen[-2], within):
            break
    settled = len(seen) >= 2 and agree(seen[-1], seen[-2], within)
    return {"rounds": seen, "settled": settled, "within": within}


def measure(url: str, model: str, api_key: str, streams: list[int], requests: int,
            max_tokens: int, timeout_s: float, warmup_within: float = 0.05, warmup_rounds: int = 6,
            clock: Clock = gpuclock.sm_clock) -> dict[str, Any]:  # fmt: skip
    """The figures of the server at url: output tok/s per number of streams, the settings they
    were measured with, the warm-up that came before them and the GPU clock while they ran
    (None where there is none to read)."""
    if not streams or min(streams) < 1 or requests < 1 or max_tokens < 1 or timeout_s <= 0:
        raise SparkpleError("streams, requests and max tokens must be >= 1, the timeout > 0")
    if warmup_rounds < 2 or not 0 < warmup_within < 1:
        raise SparkpleError("the warm-up needs >= 2 rounds and a share within (0, 1)")
    deadline = time.monotonic() + timeout_s
    complete(url, model, api_key, min(max_tokens, 8), timeout_s)  # the first request, untimed
    warmup = warm_up(url, model, api_key, max(streams), max_tokens, warmup_within,
                     warmup_rounds, deadline)  # fmt: skip
    with ClockSampler(clock) as sampler:
        figures = {
            str(n): round(tok_s(url, model, api_key, n, requests, max_tokens, deadline), 2)
            for n in sorted(set(streams))
        }
    return {"tok_s": figures, "settings": settings(streams, requests, max_tokens),
            "warmup": warmup, "gpu_clock": sampler.figure(), "time": time.time()}  # fmt: skip


def settings(streams: list[int], requests: int, max_tokens: int) -> dict[str, Any]:
    """What figures are measured with: only figures of the same settings compare."""
    return {"streams": sorted(set(streams)), "requests": requests, "max_tokens": max_tokens,
            "prompt_chars": len(PROMPT)}  # fmt: skip


def verdict(host: str, new: dict[str, Any], old: dict[str, Any], floor: float) -> tuple[bool, str]:
    """(passed, what says so): the lowest new/old ratio over the stream counts, against the
    floor; its first line names both figures, the second each stream count's."""
    if new.get("settings") != old.get("settings"):
        raise SparkpleError(
            f"the figures were measured with other settings ({new.get('settings')} and "
            f"{old.get('settings')}): measure the current release again with these"
        )
    common = sorted(set(new["tok_s"]) & set(old["tok_s"]), key=int)
    if not common:
        raise SparkpleError("the two figures share no number of streams: measure both alike")
    ratios = {n: new["tok_s"][n] / old["tok_s"][n] if old["tok_s"][n] > 0 else 1.0
              for n in common}  # fmt: skip
    worst = min(common, key=lambda n: ratios[n])
    passed = ratios[worst] >= floor
    head = (
        f"speed gate: {host} {new['tok_s'][worst]:.1f} tok/s vs {old['tok_s'][worst]:.1f} tok/s "
        f"(ratio {ratios[worst]:.2f} {'>=' if passed else '<'} {floor:g})"
    )
    each = ", ".join(
        f"{n} stream{'s' * (int(n) > 1)} {new['tok_s'][n]:.1f}/{old['tok_s'][n]:.1f}"
        for n in common
    )
    return passed, f"{head}\nper stream count, new/old tok/s: {each}"


def describe_warmup(figures: dict[str, Any]) -> str:
    warmup = figures.get("warmup")
    if not isinstance(warmup, dict):
        return "no warm-up recorded"
    seen = ", ".join(f"{r:.1f}" for r in warmup["rounds"])
    within = f"{warmup['within']:.0%}"
    if warmup["settled"]:
        return f"settled after {len(warmup['rounds'])} rounds ({seen} tok/s, within {within})"
    return f"did NOT settle in {len(warmup['rounds'])} rounds ({seen} tok/s, not within {within})"


def describe_clock(figures: dict[str, Any]) -> str:
    clock = figures.get("gpu_clock")
    if not isinstance(clock, dict):
        return "none reported (no nvidia-smi)"
    return f"{clock['sm_mhz']}/{clock['max_mhz']} MHz (median of {clock['samples']})"


def clock_of(figures: dict[str, Any]) -> int | None:
    clock = figures.get("gpu_clock")
    return int(clock["sm_mhz"]) if isinstance(clock, dict) else None


def conditions(host: str, new: dict[str, Any], old: dict[str, Any] | None) -> str:
    """The lines that say what each figure was measured under: its warm-up, its GPU clock."""
    warmup, clock = f"new {describe_warmup(new)}", f"new {describe_clock(new)}"
    if old is not None:
        warmup, clock = (
            f"{warmup}; old {describe_warmup(old)}",
            f"{clock}; old {describe_clock(old)}",
        )
    return f"speed gate: {host} warm-up: {warmup}\nspeed gate: {host} GPU clock: {clock}"


def clocks_apart(host: str, new: dict[str, Any], old: dict[str, Any], share: float) -> str:
    """'' where the two figures' GPU clocks may be compared (within `share` of the higher, or
    either unknown); otherwise the line that refuses to compare them."""
    a, b = clock_of(new), clock_of(old)
    if not gpuclock.differ(a, b, share):
        return ""
    return (
        f"speed gate: {host} not compared: GPU clock {a} MHz (new) vs {b} MHz (old) differ by "
        f"more than {share:.0%}"
    )


def run(args: argparse.Namespace) -> int:
    if args.step == "measure":
        kept = read_figures(args.out) if args.reuse else None
        if kept and kept["settings"] == settings(args.streams, args.requests, args.max_tokens):
            print(f"kept: {args.out} ({json.dumps(kept['tok_s'], sort_keys=True)} tok/s)")
            return EXIT_OK
        figures = measure(
            args.url.rstrip("/"), args.model, os.environ.get("OPENAI_API_KEY", ""), args.streams,
            args.requests, args.max_tokens, args.timeout_s, args.warmup_within,
            args.warmup_rounds, lambda: gpuclock.sm_clock(args.nvidia_smi),
        )  # fmt: skip
        figures["release"] = args.release
        write_text(Path(args.out), json.dumps(figures, indent=1, sort_keys=True) + "\n")
        print(json.dumps(figures, sort_keys=True))
        return EXIT_OK
    new, old = read_figures(args.new), read_figures(args.old)
    if new is None:
        raise SparkpleError(f"no figures at {args.new}")
    said = conditions(args.host, new, old)
    refused = clocks_apart(args.host, new, old, args.clock_share) if old is not None else ""
    if refused:
        print(f"{refused}\n{said}")
        return EXIT_NOT_COMPARED
    # the release before could not be measured: nothing to hold the new one to
    passed, line = (
        verdict(args.host, new, old, args.ratio) if old is not None
        else (True, f"speed gate: {args.host}: no figures of the release before, none compared")
    )  # fmt: skip
    print(f"{line}\n{said}")
    if passed and args.keep:
        write_text(Path(args.keep), json.dumps(new, indent=1, sort_keys=True) + "\n")
    return EXIT_OK if passed else EXIT_CHECK_FAILED


def read_figures(path: str) -> dict[str, Any] | None:
    """The figures at path; None where there are none (a missing or unreadable file)."""
    try:
        figures = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(figures, dict) and isinstance(figures.get("tok_s"), dict)
    return figures if ok and "settings" in figures else None


def add_parser(sub: Any, name: str) -> None:
    p = sub.add_parser(name, help="the rollout's speed gate: measure a server, compare releases")
    steps = p.add_subparsers(dest="step", required=True)
    m = steps.add_parser("measure", help="output tok/s of a server (key: OPENAI_API_KEY)")
    m.add_argument("--url", required=True, help="the server's API, e.g. http://127.0.0.1:8000")
    m.add_argument("--model", required=True, help="the served model name")
    m.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    m.add_argument("--requests", type=int, default=2, help="completions per stream")
    m.add_argument("--max-tokens", type=int, default=128)
    m.add_argument("--timeout-s", type=float, default=120, help="the whole measurement's bound")
    m.add_argument(
        "--warmup-within", type=float, default=0.05, help="warm: two rounds in a row within this"
    )
    m.add_argument("--warmup-rounds", type=int, default=6, help="the most warm-up rounds")
    m.add_argument("--nvidia-smi", default="nvidia-smi", help="what reads the GPU's clock")
    m.add_argument("--release", default="", help="the release id the figures belong to")
    m.add_argument("--out", required=True)
    m.add_argument(
        "--reuse", action="store_true", help="keep figures at --out taken with these settings"
    )
    c = steps.add_parser("check", help="the new release's figures against the old one's")
    c.add_argument("--new", required=True)
    c.add_argument("--old", required=True)
    c.add_argument("--host", required=True)
    c.add_argument("--ratio", type=float, default=0.9, help="the lowest new/old ratio allowed")
    c.add_argument("--keep", default="", help="where the new figures go when they pass")
    c.add_argument(
        "--clock-share", type=float, default=0.1, help="clocks further apart: not compared"
    )
    p.set_defaults(func=run)
