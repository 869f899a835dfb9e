"""Apply kernel tunables live and give back the values they replaced (kernel_tuning).

A sysctl file only sets values: removing a key from it leaves the live value as it was until a
reboot. This records, per key, the live value before the first time sparkple changed it, in a
JSON state file, so that turning a tunable off restores the host's own value at once:

  sysctl sync    --state F KEY=VALUE ...   set exactly these; every other recorded key goes back
  sysctl apply   --state F KEY=VALUE ...   record what each key held, then set it
  sysctl restore --state F [--check]       put every recorded key back, forget it
  sysctl status  --state F                 the state, what a restore would change, the live values

Each command prints one JSON object ({"changed": [...], ...}); `--check` (and `status`) only
says what would change. A value that cannot be written back, or does not read back as written,
ends with "reboot needed" and exit status 1, and stays recorded for the next try. A value out of
the range the kernel takes is refused before anything is written.
Standard library only (kernel_tuning runs it with the host's python3).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..supervise.state import read_json_object, write_json

# The integer tunables kernel_tuning sets and the range the kernel takes for each
# (Documentation/admin-guide/sysctl/vm.rst; docs/kernel-tuning.md). A value outside it is
# refused here with the range, not by the kernel with EINVAL after the host's value was recorded.
RANGES: dict[str, tuple[int, int]] = {
    "vm.compaction_proactiveness": (0, 100),
    "vm.swappiness": (0, 200),
}
# What `status` reports live: every tunable kernel_tuning can set (for a benchmark to record).
TUNABLES = (
    "vm.compaction_proactiveness",
    "vm.max_map_count",
    "vm.min_free_kbytes",
    "vm.swappiness",
    "vm.watermark_scale_factor",
)


def key_path(proc_sys: Path, key: str) -> Path:
    return proc_sys / key.replace(".", "/")


def read_value(proc_sys: Path, key: str) -> str:
    return " ".join(key_path(proc_sys, key).read_text().split())


def write_value(proc_sys: Path, key: str, value: str) -> None:
    key_path(proc_sys, key).write_text(f"{value}\n")


def live_values(proc_sys: Path, keys: Collection[str] = TUNABLES) -> dict[str, str | None]:
    """The live value of each key (None where it cannot be read: an older kernel, a container)."""
    values: dict[str, str | None] = {}
    for key in sorted(keys):
        try:
            values[key] = read_value(proc_sys, key)
        except OSError:
            values[key] = None
    return values


def bad_value(key: str, value: str) -> str | None:
    """Why `value` cannot be set for `key` (None when it can)."""
    if key not in RANGES:
        return None
    low, high = RANGES[key]
    try:
        number = int(value)
    except ValueError:
        return f"{key}={value!r} is not an integer (the kernel takes {low}-{high})"
    if not low <= number <= high:
        return f"{key}={value} is out of range: the kernel takes {low}-{high}"
    return None


def parse_pairs(pairs: list[str]) -> dict[str, str]:
    wanted = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key, value = key.strip(), " ".join(value.split())
        if not sep or not key or "/" in key or not value:
            raise SystemExit(
                f"ple-sysctl: {pair!r} is not KEY=VALUE (e.g. vm.min_free_kbytes=4194304)"
            )
        problem = bad_value(key, value)
        if problem:
            raise SystemExit(f"ple-sysctl: {problem}; nothing was changed")
        wanted[key] = value
    return wanted


def give_back(
    proc_sys: Path,
    replaced: dict[str, str],
    keep: Collection[str],
    check: bool,
    changed: list[str],
    failed: list[str],
) -> None:
    """Write back the host's value of every recorded key not in `keep`, forgetting each one that
    reads back as it was; one that does not goes to `failed` and stays recorded."""
    for key, old in sorted(replaced.items()):
        if key in keep:
            continue
        try:
            current: str | None = read_value(proc_sys, key)
        except OSError:
            current = None
        if current == old:
            if not check:
                del replaced[key]
            continue
        changed.append(key)
        if check:
            continue
        try:
            write_value(proc_sys, key, old)
            back = read_value(proc_sys, key)
        except OSError as exc:
            back = f"unwritable: {exc.strerror or exc}"
        if back != old:
            failed.append(f"{key} (wanted {old}, live {back})")
            continue
        del replaced[key]


def put(
    state_path: Path,
    state: dict[str, Any],
    proc_sys: Path,
    wanted: dict[str, str],
    replaced: dict[str, str],
    check: bool,
    changed: list[str],
) -> str | None:
    """Set each wanted value, recording the host's own value first; the error, if one stops it."""
    for key, value in wanted.items():
        try:
            current = read_value(proc_sys, key)
        except OSError as exc:
            return f"cannot read {key}: {exc.strerror or exc}"
        if current == value:
            continue
        changed.append(key)
        if check:
            continue
        # the host's own value: recorded once, never overwritten by one of ours
        replaced.setdefault(key, current)
        write_json(state_path, {**state, "replaced": replaced})
        try:
            write_value(proc_sys, key, value)
        except OSError as exc:
            return f"cannot set {key}={value}: {exc.strerror or exc}"
    return None


def run(
    state_path: Path,
    proc_sys: Path,
    wanted: dict[str, str] | None,
    keep_others: bool,
    check: bool,
) -> int:
    """Give back the recorded keys not wanted (unless keep_others), then set the wanted ones."""
    state = read_json_object(state_path)
    replaced: dict[str, str] = dict(state.get("replaced", {}))
    changed: list[str] = []
    failed: list[str] = []
    if not keep_others:
        give_back(proc_sys, replaced, wanted or {}, check, changed, failed)
    error = put(state_path, state, proc_sys, wanted or {}, replaced, check, changed)
    if not check:
        if replaced:
            write_json(state_path, {**state, "replaced": replaced})
        else:
            state_path.unlink(missing_ok=True)
    if error:
        print(f"ple-sysctl: {error}", file=sys.stderr)
        return 1
    print(json.dumps({"changed": changed, "failed": failed, "replaced": replaced}, sort_keys=True))
    if failed:
        print(
            f"ple-sysctl: could not restore {', '.join(failed)} live: reboot needed to get the "
            "host's own values back",
            file=sys.stderr,
        )
        return 1
    return 0


def status(state_path: Path, proc_sys: Path) -> int:
    """What a restore would change, and the live value of every tunable kernel_tuning sets."""
    state = read_json_object(state_path)
    replaced: dict[str, str] = dict(state.get("replaced", {}))
    changed: list[str] = []
    failed: list[str] = []
    give_back(proc_sys, dict(replaced), (), True, changed, failed)
    live = live_values(proc_sys, set(TUNABLES) | set(replaced))
    out = {"changed": changed, "failed": failed, "replaced": replaced, "live": live}
    print(json.dumps(out, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["sync", "apply", "restore", "status"])
    p.add_argument("pairs", nargs="*", help="KEY=VALUE (sync, apply)")
    p.add_argument("--state", type=Path, required=True, help="JSON file of replaced values")
    p.add_argument("--proc-sys", type=Path, default=Path("/proc/sys"))
    p.add_argument("--check", action="store_true", help="only say what would change")
    # intermixed: the role puts the options between the command and its KEY=VALUE words
    args = p.parse_intermixed_args(argv)
    if args.command == "apply" and not args.pairs:
        p.error("apply needs at least one KEY=VALUE")
    if args.command in ("restore", "status") and args.pairs:
        p.error(f"{args.command} takes no KEY=VALUE")
    if args.command == "status":
        return status(args.state, args.proc_sys)
    wanted = parse_pairs(args.pairs)
    return run(args.state, args.proc_sys, wanted, args.command == "apply", args.check)


if __name__ == "__main__":
    sys.exit(main())
