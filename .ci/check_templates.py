"""Parse every Jinja template of the project (roles' *.j2 and templates/vllm/**).

Only the syntax is checked here; rendering is exercised by molecule (roles) and by
the patch engine's tests (templates/vllm).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jinja2

ROOT = Path(__file__).resolve().parent.parent
SKIP = {".cache", ".venv", ".git"}


def templates() -> list[Path]:
    found = [p for p in ROOT.rglob("*.j2") if not SKIP.intersection(p.relative_to(ROOT).parts)]
    vllm = ROOT / "templates" / "vllm"
    if vllm.is_dir():
        found += [p for p in vllm.rglob("*") if p.is_file() and p.suffix != ".j2"]
    return sorted(set(found))


def main() -> int:
    env = jinja2.Environment(extensions=["jinja2.ext.do", "jinja2.ext.loopcontrols"])
    bad = 0
    paths = templates()
    for path in paths:
        try:
            env.parse(path.read_text(encoding="utf-8"), name=str(path.relative_to(ROOT)))
        except jinja2.TemplateSyntaxError as exc:
            bad += 1
            print(f"{exc.filename}:{exc.lineno}: {exc.message}", file=sys.stderr)
        except UnicodeDecodeError:
            continue
    print(f"templates: {len(paths) - bad} of {len(paths)} parse")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
