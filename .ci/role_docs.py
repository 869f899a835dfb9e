"""The `## Variables` table of every role's README, generated from its defaults/main.yml.

Each default is documented by the comment lines right above it; the table shows the name, the
default as written and that comment (a `# --- title` line heads a section of the defaults file,
documents no variable and stays out of the table). `python3 .ci/role_docs.py` rewrites the
tables; `--check` only reports the READMEs whose table differs (exit 1), so docs and defaults
cannot drift.
Both also require that the defaults and the argument specs (meta/argument_specs.yml) name the
same variables: every default is an option of some entry point, every option of `main` a default.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = re.compile(r"^([a-z][a-z0-9_]*):(.*)$")
SECTION_COMMENT = re.compile(r"^#\s*---")
SECTION = re.compile(r"^## Variables\n.*?(?=^## |\Z)", re.M | re.S)


def documented_defaults(defaults: Path) -> list[tuple[str, str, str]]:
    """(name, default as written, comment) for every top-level variable, in file order."""
    rows: list[tuple[str, str, str]] = []
    comment: list[str] = []
    current: list[str] | None = None  # name, inline value, continuation lines...
    pending: list[tuple[str, list[str], str]] = []
    for line in defaults.read_text().splitlines():
        match = TOP_LEVEL.match(line)
        if match:
            current = [match.group(1), match.group(2).strip()]
            pending.append((match.group(1), current, " ".join(comment)))
            comment = []
        elif SECTION_COMMENT.match(line):
            comment = []
            current = None
        elif line.startswith("#"):
            comment.append(line.lstrip("#").strip())
            current = None
        elif line.strip() and line != "---" and current is not None:
            current.append(line)
        elif not line.strip():
            comment = []
    for name, parts, text in pending:
        if not text:
            raise SystemExit(f"{defaults}: {name} has no comment line above it")
        rows.append((name, shown_default(parts[1], parts[2:]), text))
    return rows


def shown_default(inline: str, more: list[str]) -> str:
    if not more:
        return inline
    if inline in (">-", ">", "|", "|-"):
        return " ".join(part.strip() for part in more)
    value = yaml.safe_load("\n".join(["x: " + inline, *more]))["x"]
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()


def contract_mismatches(role: Path) -> list[str]:
    defaults = set(yaml.safe_load((role / "defaults" / "main.yml").read_text()) or {})
    specs = yaml.safe_load((role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    options = {name: set(spec.get("options") or {}) for name, spec in specs.items()}
    anywhere = set().union(*options.values())
    problems = [f"{role.name}: default {v} has no argument spec" for v in defaults - anywhere]
    problems += [
        f"{role.name}: main option {v} has no default"
        for v in options.get("main", set()) - defaults
    ]
    return sorted(problems)


def table(rows: list[tuple[str, str, str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["## Variables", "", "| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | `{cell(value)}` | {cell(text)} |" for name, value, text in rows]
    return "\n".join(lines) + "\n\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale: list[Path] = []
    mismatches = [m for role in sorted(ROOT.glob("roles/*/")) for m in contract_mismatches(role)]
    for problem in mismatches:
        print(problem)
    for defaults in sorted(ROOT.glob("roles/*/defaults/main.yml")):
        readme = defaults.parent.parent / "README.md"
        text = readme.read_text()
        section = SECTION.search(text)
        if not section:
            raise SystemExit(f"{readme}: no '## Variables' section to generate")
        # spliced in, not re.sub'd: the table's backslashes are text, not group references
        new = text[: section.start()] + table(documented_defaults(defaults)) + text[section.end() :]
        new = new.rstrip("\n") + "\n"
        if new != text:
            stale.append(readme.relative_to(ROOT))
            if not check:
                readme.write_text(new)
    for path in stale:
        print(f"{path}: Variables table {'differs from' if check else 'regenerated from'} defaults")
    return 1 if mismatches or (check and stale) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
