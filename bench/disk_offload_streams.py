"""bench/disk_offload_compare.py's step streams (decode, MTP, a prompt in chunks) and how the
arms run one in lockstep, timing each step and counting its disk, page-cache and syscalls."""

from __future__ import annotations

import argparse
import hashlib
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
from disk_offload_arms import Arms
from disk_offload_pagecache import resident_bytes
from disk_offload_syscalls import strace_counts
from measure import read_bytes

# (kind, requests, tokens a request per step, drafts a request per step); the prompt stream's
# step kind is split into its first chunk and the later ones when reported
STREAMS = {
    "decode@1": (1, 1, 0),
    "decode@8": (8, 1, 0),
    "mtp 4x4": (4, 4, 3),
    "chunk": (1, 0, 0),
}
DECODE_PROMPT = 3  # a decode request's prompt: its prefill runs before the measured steps


# (step kind, scheduled (request, tokens computed before, tokens this step), drafts per request)
Step = tuple[str, list[tuple[str, int, int]], dict[str, int] | None]


def stream_steps(kind: str, args: argparse.Namespace, vocab: int, seed: int):
    """(requests: name -> (tokens, prompt_len), setup steps, measured steps, gap seconds)."""
    reqs, per_step, drafts = STREAMS[kind]
    rng = np.random.default_rng(seed)
    if kind == "chunk":
        prompt = args.chunks * args.chunk_tokens
        requests = {"p": (rng.integers(0, vocab, prompt + 8), prompt)}
        size = args.chunk_tokens
        chunks: list[Step] = [
            ("chunk first" if c == 0 else "chunk later", [("p", c * size, size)], None)
            for c in range(args.chunks)
        ]
        return requests, [], chunks, args.chunk_ms / 1e3
    count = args.mtp_steps if drafts else args.decode_steps
    length = DECODE_PROMPT + count * per_step + 8
    requests = {f"r{i}": (rng.integers(0, vocab, length), DECODE_PROMPT) for i in range(reqs)}
    setup = [[(name, 0, DECODE_PROMPT) for name in requests]]
    steps: list[Step] = []
    for n in range(count):
        done = DECODE_PROMPT + n * per_step
        steps.append(
            (
                kind,
                [(name, done, per_step) for name in requests],
                {name: drafts for name in requests} if drafts else None,
            )
        )
    return requests, setup, steps, args.decode_ms / 1e3


def run_lockstep(
    arms: Arms,
    lanes: tuple[str, ...],
    kind: str,
    args: argparse.Namespace,
    vocab: int,
    seed: int,
    temp: str,
    syscalls: dict[str, int] | None = None,
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, list[str]]]:
    """One stream, its steps run by each arm in turn on the same tokens (the order alternating
    step by step), so that both arms' step n meet the same moment of the shared machine. In a
    decode stream sparkple's odd steps run with its decode advice off ("sparkple-noadvice").

    A prompt stream runs one arm after the other instead: sparkple's lookahead works in the
    background, and in lockstep it would also work (and compete for the disk) while 0.34's
    step runs, time the device's work between two steps does not give it.

    Returns ({label: {step kind: figures}}, {arm: each step's staged rows' digest}).
    Disk bytes: a 0.34 step's are its thread's (it issues all of its reads on the calling
    thread, inside the step), the rest of the stream's are sparkple's (its gather and
    lookahead threads read too); page cache: by files (mincore)."""
    if kind == "chunk" and len(lanes) > 1:
        out: dict[str, dict[str, dict[str, Any]]] = {}
        staged: dict[str, list[str]] = {}
        for arm in lanes:
            part, digests = run_lockstep(arms, (arm,), kind, args, vocab, seed, temp)
            out.update(part)
            staged.update(digests)
        return out, staged
    requests, setup, steps, gap = stream_steps(kind, args, vocab, seed)
    runners = {arm: arms.runner(arm) for arm in lanes}
    # A stream without setup steps (the prompt) arrives at a cold table: evicted before its
    # requests are added, as adding one starts sparkple's lookahead on its pages.
    evict_first = temp == "cold" and not setup
    for arm in lanes if evict_first else ():
        left = arms.evict(arm)
        if left:
            raise RuntimeError(f"{left} pages of {arm}'s files stayed resident after eviction")
    if evict_first:  # the stream's disk and page cache counted from the eviction on
        cache0 = {arm: resident_bytes(arms.paths(arm)) for arm in lanes}
        disk0 = read_bytes()
    for arm in lanes:
        for name, (tokens, prompt_len) in requests.items():
            runners[arm].add(name, tokens, prompt_len)
        for scheduled in setup:
            runners[arm].step(scheduled)
    if temp == "cold" and not evict_first:
        for arm in lanes:
            left = arms.evict(arm)
            if left:
                raise RuntimeError(f"{left} pages of {arm}'s files stayed resident after eviction")
    toggle = kind != "chunk" and syscalls is None
    out = {}
    staged = {arm: [] for arm in lanes}
    tokens_of = dict.fromkeys(lanes, 0)
    in_step = dict.fromkeys(lanes, 0)
    if not evict_first:
        cache0 = {arm: resident_bytes(arms.paths(arm)) for arm in lanes}
        disk0 = read_bytes()
    counting: AbstractContextManager[None] = (
        strace_counts(syscalls) if syscalls is not None else nullcontext()
    )
    with counting:
        for n, (step_kind, scheduled, drafts) in enumerate(steps):
            if n:
                time.sleep(gap)  # the device computes the step before
            tokens = sum(count for _, _, count in scheduled)
            for arm in lanes if (n + seed) % 2 == 0 else lanes[::-1]:
                label = arm
                if arm == "sparkple" and toggle and n % 2:
                    label = "sparkple-noadvice"
                arms.set_advice(label != "sparkple-noadvice")
                b0 = thread_read_bytes()
                runners[arm].step(scheduled, drafts=drafts)
                in_step[arm] += thread_read_bytes() - b0
                crit = arms.critical(arm)
                entry = out.setdefault(label, {}).setdefault(
                    step_kind, {"critical_s": [], "tokens": 0}
                )
                entry["critical_s"].append(crit)
                entry["tokens"] += tokens
                tokens_of[arm] += tokens
                staged[arm].append(hashlib.blake2b(arms.staged(arm, tokens)).hexdigest())
    arms.set_advice(True)
    disk_total = read_bytes() - disk0
    disk = {arm: in_step[arm] for arm in lanes}
    if "sparkple" in lanes:
        disk["sparkple"] = disk_total - sum(v for a, v in in_step.items() if a != "sparkple")
    elif len(lanes) == 1:
        disk[lanes[0]] = disk_total
    for arm in lanes:
        cache = resident_bytes(arms.paths(arm)) - cache0[arm]
        for entry in out[arm].values():  # the stream's bytes shared out by tokens
            share = entry["tokens"] / tokens_of[arm]
            entry["disk_bytes"], entry["cache_bytes"] = disk[arm] * share, cache * share
            entry["stream_tokens"] = tokens_of[arm]
    for arm in lanes:
        for name in requests:
            runners[arm].remove(name)
    return out, staged


def thread_read_bytes() -> int:
    """The bytes the calling thread made the disk read (/proc/thread-self/io read_bytes)."""
    with open("/proc/thread-self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/thread-self/io has no read_bytes")
