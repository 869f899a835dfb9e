"""Apply kernel tunables live and give back the values they replaced (kernel_tuning).

A sysctl file only sets values: removing a key from it leaves the live value as it was until a
reboot. This records, per key, the live value before the first time sparkple changed it, in a
JSON state file, so that turning a tunable off restores the host's own value at once:

  sysctl apply   --state F KEY=VALUE ...   record what each key held, then set it
  sysctl restore --state F [--check]       put every recorded key back, forget it
  sysctl status  --state F                 print the state and the live values

Each command prints one JSON object ({"changed": [...], ...}); `--check` (and `status`) only
says what would change. A value that cannot be written back, or does not read back as written,
ends with "reboot needed" and exit status 1, and stays recorded for the next try.
Standard library only (kernel_tuning runs it with the host's python3).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .state import read_json_object, write_json


def key_path(proc_sys: Path, key: str) -> Path:
    return proc_sys / key.replace(".", "/")


def read_value(proc_sys: Path, key: str) -> str:
    return " ".join(key_path(proc_sys, key).read_text().split())


def write_value(proc_sys: Path, key: str, value: str) -> None:
    key_path(proc_sys, key).write_text(f"{value}\n")


def parse_pairs(pairs: list[str]) -> dict[str, str]:
    wanted = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or "/" in key:
            raise SystemExit(
                f"ple-sysctl: {pair!r} is not KEY=VALUE (e.g. vm.min_free_kbytes=4194304)"
            )
        wanted[key.strip()] = " ".join(value.split())
    return wanted


def apply(state_path: Path, proc_sys: Path, wanted: dict[str, str], check: bool) -> int:
    state = read_json_object(state_path)
    replaced: dict[str, str] = dict(state.get("replaced", {}))
    changed = []
    for key, value in wanted.items():
        try:
            current = read_value(proc_sys, key)
        except OSError as exc:
            print(f"ple-sysctl: cannot read {key}: {exc.strerror or exc}", file=sys.stderr)
            return 1
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
            print(f"ple-sysctl: cannot set {key}={value}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    print(json.dumps({"changed": changed, "replaced": replaced}, sort_keys=True))
    return 0


def restore(state_path: Path, proc_sys: Path, check: bool) -> int:
    state = read_json_object(state_path)
    replaced: dict[str, str] = dict(state.get("replaced", {}))
    changed, failed = [], []
    for key, old in sorted(replaced.items()):
        try:
            current = read_value(proc_sys, key)
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
    if not check:
        if replaced:
            write_json(state_path, {**state, "replaced": replaced})
        else:
            state_path.unlink(missing_ok=True)
    print(json.dumps({"changed": changed, "failed": failed, "replaced": replaced}, sort_keys=True))
    if failed:
        print(
            f"ple-sysctl: could not restore {', '.join(failed)} live: reboot needed to get the "
            "host's own values back",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["apply", "restore", "status"])
    p.add_argument("pairs", nargs="*", help="KEY=VALUE (apply)")
    p.add_argument("--state", type=Path, required=True, help="JSON file of replaced values")
    p.add_argument("--proc-sys", type=Path, default=Path("/proc/sys"))
    p.add_argument("--check", action="store_true", help="only say what would change")
    args = p.parse_args(argv)
    if args.command == "apply":
        if not args.pairs:
            p.error("apply needs at least one KEY=VALUE")
        return apply(args.state, args.proc_sys, parse_pairs(args.pairs), args.check)
    if args.pairs:
        p.error(f"{args.command} takes no KEY=VALUE")
    return restore(args.state, args.proc_sys, args.check or args.command == "status")


if __name__ == "__main__":
    sys.exit(main())
