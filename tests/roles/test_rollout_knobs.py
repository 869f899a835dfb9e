"""Every knob of the rollout has one home: playbooks/vars/rollout.yml.

The rollout's plays and task files read `rollout_*` names only, each defined in the vars file
(or registered or set on the way), and only the vars file reads the `sparkple_rollout_*` knobs
an operator sets; the health gate's settings are sparkple_common's, never restated there.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOKS = ROOT / "playbooks"
VARS = PLAYBOOKS / "vars" / "rollout.yml"
READERS = [
    PLAYBOOKS / "rollout.yml",
    PLAYBOOKS / "status.yml",
    *sorted((PLAYBOOKS / "tasks").glob("rollout_*.yml")),
]
SHARED = yaml.safe_load((ROOT / "roles" / "sparkple_common" / "defaults" / "main.yml").read_text())


def set_on_the_way(text: str) -> set[str]:
    """Names a reader registers or sets itself (register:, set_fact keys, task vars)."""
    names = set(re.findall(r"^\s*register:\s*(rollout_\w+)", text, re.M))
    names |= set(re.findall(r"^\s+(rollout_\w+):", text, re.M))
    return names


def test_every_rollout_name_the_playbooks_read_is_defined_in_the_vars_file() -> None:
    defined = set(yaml.safe_load(VARS.read_text()))
    # a fact or include variable one reader sets is read by the task files it includes
    set_by_readers = set().union(*(set_on_the_way(path.read_text()) for path in READERS))
    for path in READERS:
        text = path.read_text()
        # a name, not a task file (tasks/rollout_gate.yml)
        read = set(re.findall(r"\brollout_\w+(?!\w|\.yml)", text))
        missing = read - defined - set_by_readers
        assert not missing, f"{path.relative_to(ROOT)} reads {sorted(missing)}, not in {VARS.name}"


def test_only_the_vars_file_reads_the_operators_rollout_knobs() -> None:
    for path in READERS:
        knobs = re.findall(r"\bsparkple_rollout_\w+", path.read_text())
        # the plays' comments name the knobs an operator sets; no expression reads one
        assert not re.findall(r"\{\{[^}]*\bsparkple_rollout_", path.read_text()), path
        assert all(k in VARS.read_text() for k in knobs), (path, knobs)


def test_the_health_gate_settings_are_sparkple_commons() -> None:
    text = VARS.read_text()
    for name in (
        "sparkple_served_model_name",
        "sparkple_api_key",
        "sparkple_health_gate_timeout_s",
        "sparkple_health_gate_tokens",
    ):
        assert name in SHARED, name
    # the rollout neither restates them nor reads a service role's own variables
    values = yaml.safe_load(text)
    assert not [v for v in values.values() if "vllm_service_" in str(v)]
    # (the speed gate is the rollout's own: rollout_speed_gate_*)
    assert not [k for k in values if re.search(r"model|api_key|health_gate", k)], values
