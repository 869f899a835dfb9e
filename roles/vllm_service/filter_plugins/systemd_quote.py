"""systemd_word: one argv word written so that systemd's ExecStart= hands it over unchanged.

systemd splits ExecStart= at whitespace, strips quotes (also inside a word: `a={"b":1}` loses
its double quotes), unescapes C escapes, expands `%` specifiers and `$VAR`. A word is therefore
written double-quoted with `\\` and `"` escaped, `%` doubled and `$` doubled.
"""

from __future__ import annotations

from collections.abc import Callable


def systemd_word(value: object) -> str:
    text = str(value)
    if any(c in text for c in "\n\r\0"):
        raise ValueError(f"an ExecStart= word cannot hold a newline or NUL: {text!r}")
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("%", "%%").replace("$", "$$") + '"'


class FilterModule:
    def filters(self) -> dict[str, Callable[..., object]]:
        return {"systemd_word": systemd_word}
