"""Prometheus' text exposition format, as node_exporter's textfile collector reads it: each
family's HELP and TYPE once, then its samples, label values escaped. Standard library only
(ple_metrics runs on the host's system Python)."""

from __future__ import annotations

PREFIX = "sparkple_"


class Exposition:
    """Prometheus text exposition: HELP and TYPE once per family, then its samples."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> str:
        full = PREFIX + name
        self.lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        return full

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        label_text = ""
        if labels:
            inner = ",".join(f'{k}="{escape(v)}"' for k, v in sorted(labels.items()))
            label_text = "{" + inner + "}"
        self.lines.append(f"{name}{label_text} {format_value(value)}")

    def metric(
        self,
        name: str,
        kind: str,
        help_text: str,
        value: float,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.sample(self.family(name, kind, help_text), value, labels)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))
