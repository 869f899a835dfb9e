"""Running the site's configured commands, and the flags of the unit they act on.

Commands are given as one string (a unit file or a role variable), split with shell rules and
run without a shell; `{name}` placeholders in each word are filled from a mapping, so a value
with spaces stays one argument.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path


def service_options() -> argparse.ArgumentParser:
    """The flags of every program that watches the serving unit (an argparse parent): the unit
    and container it acts on, and how often one kind of alert may repeat."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--unit", default="sparkple-vllm.service", help="systemd unit name ({unit})")
    p.add_argument("--container", default="sparkple-vllm", help="container name ({container})")
    p.add_argument(
        "--alert-min-interval-s", type=float, default=900.0, help="seconds between alerts of a kind"
    )
    return p


@dataclass(frozen=True)
class CommandResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def render_command(template: str, values: dict[str, str]) -> list[str]:
    """Split `template` into words and fill `{name}` placeholders in each word."""
    try:
        return [word.format(**values) for word in shlex.split(template)]
    except (KeyError, ValueError, IndexError) as exc:
        raise ValueError(
            f"command {template!r} has a bad placeholder ({exc}); "
            f"known placeholders: {', '.join('{' + k + '}' for k in sorted(values))}"
        ) from exc


def run_command(
    template: str, values: dict[str, str], timeout_s: float, stdout_path: Path | None = None
) -> CommandResult:
    """Run a configured command; a missing program or a timeout is a failed result, not a crash,
    because the loops that call this must keep running."""
    argv = render_command(template, values)
    if not argv:
        return CommandResult(argv, 0, "", "")
    try:
        if stdout_path is not None:
            with open(stdout_path, "wb") as out:
                to_file = subprocess.run(
                    argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
                )
            return CommandResult(argv, to_file.returncode, "", "")
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)
    except FileNotFoundError as exc:
        return CommandResult(argv, 127, "", f"{argv[0]}: not found ({exc})")
    except OSError as exc:  # not executable, not permitted, or the output file cannot be opened
        return CommandResult(argv, 126, "", f"{argv[0]}: cannot run ({exc})")
    except subprocess.TimeoutExpired:
        return CommandResult(argv, 124, "", f"timed out after {timeout_s:g} s")
