"""The package's structure drawn from its imports alone: one box per room (the base modules and
each subpackage, with its modules), one arrow per room it imports, labelled with how many import
statements make it. Imports are read with ast (every `import`, anywhere in a module, relative ones
resolved), so the drawing shows what the code does, not what the docs say.

`python3 .ci/structure.py` rewrites the drawing in docs/structure.md; `--check` only reports
whether it differs (exit 1). Both fail when the rooms import each other in a circle.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sparkple"
DOC = ROOT / "docs" / "structure.md"
BEGIN, END = "<!-- structure:begin -->", "<!-- structure:end -->"
BASE = "base"


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return BASE


def imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every module `path` imports, anywhere in it, as an absolute name (for `from .. import x`
    the names are modules: each counts)."""
    package = list(path.relative_to(root).parts[:-1])  # for __init__.py: the package itself
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[: len(package) - node.level + 1])
            if node.module is None:
                found += [f"{base}.{alias.name}" for alias in node.names]
            else:
                found.append(f"{base}.{node.module}")
        elif isinstance(node, ast.ImportFrom):
            found.append(node.module or "")
    return found


def imported(path: Path) -> list[str]:
    """The sparkple modules `path` imports."""
    return [name for name in imports(path, ROOT) if name.split(".")[0] == "sparkple"]


def graph() -> tuple[dict[str, list[str]], Counter[tuple[str, str]]]:
    """room -> its modules; (room, room it imports) -> import statements."""
    rooms: dict[str, list[str]] = {}
    arrows: Counter[tuple[str, str]] = Counter()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        room = room_of(module)
        if path.stem != "__init__":
            rooms.setdefault(room, []).append(path.stem)
        for name in imported(path):
            if room_of(name) != room:
                arrows[(room, room_of(name))] += 1
    return rooms, arrows


def drawing() -> str:
    rooms, arrows = graph()
    order = TopologicalSorter({r: {t for f, t in arrows if f == r} for r in rooms})
    try:
        floors = list(order.static_order())  # bottom first
    except CycleError as exc:
        raise SystemExit(f"the rooms import each other in a circle: {exc.args[1]}") from None
    lines = ["```mermaid", "flowchart BT"]
    for room in floors:
        modules = ", ".join(rooms[room])
        lines.append(f'    {room}["<b>{room}</b><br/>{modules}"]')
    for (source, target), count in sorted(arrows.items()):
        lines.append(f"    {source} -->|{count}| {target}")
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = DOC.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    wanted = text[:start] + "\n" + drawing() + "\n" + text[end:]
    if "--check" in argv:
        if wanted != text:
            print(
                f"{DOC.relative_to(ROOT)} is not the drawing of the imports: run .ci/structure.py"
            )
            return 1
        return 0
    DOC.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
