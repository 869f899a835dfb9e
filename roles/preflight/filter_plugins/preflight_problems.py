"""preflight_problems: what a host lacks to serve, one line each (sparkple.preflight), from the
probes the role ran on it and its knobs.

    preflight_missing: "{{ probes | preflight_problems(wants, sparkple_data_dir) }}"
    preflight_nvme_script: "{{ 'nvme' | preflight_module_file }}"

The package is this checkout's, the one sparkple_package installs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError

CHECKOUT = Path(__file__).resolve().parents[3]


def preflight_problems(
    probes: Mapping[str, Any], wants: Mapping[str, Any], data_dir: str
) -> list[str]:
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    from sparkple.preflight import Probes, Wants, problems

    try:
        found = Probes(**typed(Probes, probes))
        knobs = Wants(**typed(Wants, wants))
    except (TypeError, KeyError, ValueError) as exc:
        raise AnsibleFilterError(f"preflight_problems: {exc}") from None
    return problems(found, knobs, data_dir)


def typed(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The values as the dataclass's fields are typed (a template may hand over text)."""
    out: dict[str, Any] = {}
    for field in fields(cls):
        value = values[field.name]
        kind = str(field.type)
        if value is None or value == "None":
            out[field.name] = None
        elif kind.startswith("tuple"):
            out[field.name] = tuple(str(v) for v in value)
        elif kind == "bool":
            out[field.name] = value if isinstance(value, bool) else str(value).lower() == "true"
        elif kind.startswith("int"):
            out[field.name] = int(float(value))
        elif kind == "float":
            out[field.name] = float(value)
        else:
            out[field.name] = str(value)
    return out


def preflight_module_file(module: str) -> str:
    """The path of one of the package's modules (`nvme` -> CHECKOUT/sparkple/nvme.py), for the
    probes run on a host as scripts before sparkple_package has put the package there."""
    path = CHECKOUT / "sparkple" / f"{module}.py"
    if not path.is_file():
        raise AnsibleFilterError(f"preflight_module_file: the package has no module {module!r}")
    return str(path)


class FilterModule:
    def filters(self) -> dict[str, Callable[..., object]]:
        return {
            "preflight_problems": preflight_problems,
            "preflight_module_file": preflight_module_file,
        }
