"""`sparkple patch render|check|port`."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from ..errors import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from .check import check
from .port import EditReport, PortInputError, PortReport, port, write_draft
from .profile import parse_var_args
from .render import MANIFEST_NAME, render


def _cmd_render(args: argparse.Namespace) -> int:
    manifest = render(args.profile, args.originals, args.out, parse_var_args(args.var))
    for entry in manifest["files"]:
        print(f"{entry['kind']:8} {entry['path']}  {entry['patched_sha256']}")
    print(f"rendered {manifest['profile']} (vLLM {manifest['vllm_version']}) into {args.out}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    problems = check(args.out, compile_files=args.compile)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{args.out}: {len(problems)} problem(s); re-render with `sparkple patch render`")
        return 1
    compiled = " and compiles" if args.compile else ""
    print(f"{args.out}: every file matches {MANIFEST_NAME}{compiled}")
    return 0


def _edit_label(edit: EditReport, repeated: set[tuple[str, str]]) -> str:
    """`rel template`, with the edit's number where the file uses the template twice."""
    label = f"{edit.rel} {edit.template}"
    return f"{label} (edit {edit.index + 1})" if (edit.rel, edit.template) in repeated else label


def print_port_report(report: PortReport, drafted: str | None = None) -> int:
    """One line per original and per edit, then the verdict; return the exit code."""
    version = report.vllm_version or "(version unknown)"
    print(f"port {report.profile.name} (vLLM {report.profile.vllm_version}) to vLLM {version}")
    for orig in report.originals:
        if orig.status == "changed":
            print(f"changed {orig.rel}  {orig.new_sha256}")
        else:
            print(f"{orig.status:7} {orig.rel}")
    uses = Counter((edit.rel, edit.template) for edit in report.edits)
    repeated = {key for key, n in uses.items() if n > 1}
    for edit in report.edits:
        label = _edit_label(edit, repeated)
        if edit.holds:
            print(f"holds   {label}")
        else:
            print(f"BROKEN  {label}: anchor occurs {edit.count} times")
    if drafted is not None:
        print(f"drafted {drafted}: check its '# PORT:' comments")
    changed = sum(orig.status == "changed" for orig in report.originals)
    counts = (
        f"{len(report.originals)} originals ({changed} changed, {len(report.missing)} missing), "
        f"{len(report.edits) - len(report.broken)} of {len(report.edits)} anchors hold"
    )
    if report.ok:
        print(f"{report.profile.name} ports to vLLM {version}: {counts}")
        return EXIT_OK
    print(f"{report.profile.name} needs a person to port to vLLM {version}: {counts}")
    for orig in report.missing:
        print(f"  missing original {orig.rel}: find where vLLM {version} moved it")
    for edit in report.broken:
        label = f"{_edit_label(edit, repeated)} ({edit.mode})"
        if edit.count == 0:
            print(f"  find a new anchor for {label}: the old one occurs 0 times")
        else:
            print(f"  widen the anchor of {label}: it occurs {edit.count} times")
    return EXIT_CHECK_FAILED


def _cmd_port(args: argparse.Namespace) -> int:
    try:
        report = port(args.source_profile, args.vllm_sources, args.vllm_version)
        drafted = None
        if args.write is not None:
            drafted = str(write_draft(report, args.write, args.name))
    except PortInputError as exc:
        print(f"sparkple patch port: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return print_port_report(report, drafted)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str) -> None:
    parser = subparsers.add_parser(name, help="render and check vLLM patch profiles")
    actions = parser.add_subparsers(dest="patch_command", metavar="ACTION", required=True)
    render_p = actions.add_parser("render", help="render a profile against original vLLM files")
    render_p.add_argument("--profile", required=True, help="profile name or directory")
    render_p.add_argument(
        "--originals", required=True, help="directory of originals, relative to the vllm package"
    )
    render_p.add_argument("--out", required=True, help="directory that receives the result")
    render_p.add_argument(
        "--var", action="append", default=[], metavar="NAME=VALUE", help="template variable"
    )
    render_p.set_defaults(func=_cmd_render)
    check_p = actions.add_parser("check", help="verify a rendered directory against its manifest")
    check_p.add_argument("out", help="directory written by `sparkple patch render`")
    check_p.add_argument(
        "--compile", action="store_true", help="also compile every file with this Python"
    )
    check_p.set_defaults(func=_cmd_check)
    port_p = actions.add_parser(
        "port", help="check a profile against another vLLM release and draft its successor"
    )
    port_p.add_argument(
        "--from", dest="source_profile", required=True, help="profile name or directory"
    )
    port_p.add_argument(
        "--vllm-sources",
        required=True,
        help="the new release: the vllm package directory, a directory holding vllm/, or a wheel",
    )
    port_p.add_argument(
        "--write", metavar="DIR", help="draft the new profile into DIR (new or empty)"
    )
    port_p.add_argument(
        "--name", help="the draft's profile name (default: vllm-<major>.<minor> of the version)"
    )
    port_p.add_argument(
        "--vllm-version", help="the new release's version (default: from the wheel or sources)"
    )
    port_p.set_defaults(func=_cmd_port)
