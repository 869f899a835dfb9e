"""The `sparkple` command line: one subcommand group per module, imported lazily.

Lazy imports keep `sparkple build-table` runnable with only the standard library
and numpy (the serving image's Python), without jinja2, yaml or torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import EXIT_CHECK_FAILED, SparkpleError

# subcommand -> module that defines `add_parser(subparsers, name)`; the parser's
# default `func(args) -> int` runs it.
COMMANDS: dict[str, str] = {
    "serving-plan": "sparkple.serving.cli",
    "launch-gate": "sparkple.serving.cli",
    "pair-link-check": "sparkple.pair.linkcli",
    "pair-transport": "sparkple.pair.linkcli",
    "pair-check": "sparkple.pair.linkbench",
    "bench": "sparkple.measure.benchmark",
    "speed-gate": "sparkple.measure.speedgate",
    "quality-gate": "sparkple.measure.qualitygate",
    "snapshot-manifest": "sparkple.manifest",
    "synth-checkpoint": "sparkple.builder.synth",
    "build-table": "sparkple.builder.tablecli",
    "verify-table": "sparkple.builder.tablecli",
    "inspect-table": "sparkple.builder.tablecli",
    "patch": "sparkple.patch.cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="sparkple", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, module in COMMANDS.items():
        if wanted is None or name == wanted:
            importlib.import_module(module).add_parser(sub, name)
        else:
            sub.add_parser(name, help=f"see `sparkple {name} --help`")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SparkpleError as exc:
        print(f"sparkple {args.command}: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
