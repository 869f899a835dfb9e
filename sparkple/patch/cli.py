"""`sparkple patch render|check`."""

from __future__ import annotations

import argparse

from .check import check
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
