"""An API closed unless opened on purpose: a Spark's API beyond loopback needs sparkple_api_key
or sparkple_api_insecure, the gateway's endpoint gateway_api_keys or gateway_api_insecure, and a
keyed gateway must send the Sparks their own key. The roles' own tasks, run by Ansible on this
machine; site.yml itself refuses before anything changes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible_local import run_playbook

ROOT = Path(__file__).resolve().parents[2]
PLAY = f"""
- hosts: localhost
  gather_facts: false
  vars_files: [{ROOT}/roles/sparkple_common/defaults/main.yml]
  tasks:
    - ansible.builtin.include_tasks: {ROOT}/roles/sparkple_common/tasks/api_exposure.yml
"""


@pytest.mark.parametrize(
    ("variables", "ok"),
    [
        ({}, True),  # the default: 127.0.0.1
        ({"sparkple_api_host": "::1"}, True),
        ({"sparkple_api_host": "0.0.0.0"}, False),
        ({"sparkple_api_host": "10.0.0.11"}, False),
        ({"sparkple_api_host": "0.0.0.0", "sparkple_api_key": "k-from-the-vault"}, True),
        ({"sparkple_api_host": "0.0.0.0", "sparkple_api_insecure": True}, True),
    ],
)
def test_a_spark_api_beyond_loopback_needs_a_key_or_the_word(
    tmp_path: Path, variables: dict, ok: bool
) -> None:
    done = run_playbook(tmp_path, PLAY, variables)
    assert (done.returncode == 0) is ok, done.stdout[-2000:]
    if not ok:
        assert "Set sparkple_api_key (from the" in done.stdout
        assert "sparkple_api_insecure: true" in done.stdout


def gateway_checks(
    tmp_path: Path, gateway: dict, sparks: dict[str, dict]
) -> subprocess.CompletedProcess:
    """The gateway role's refusals (its first tasks), on an inventory of a gateway and Sparks."""
    tasks = yaml.safe_load((ROOT / "roles" / "gateway" / "tasks" / "main.yml").read_text())
    names = ("Refuse an endpoint open to the network without keys",
             "Refuse a backend key other than the Sparks' own")  # fmt: skip
    checks = [t for t in tasks if t["name"] in names]
    assert [t["name"] for t in checks] == list(names)
    inventory = {
        "all": {
            "children": {
                "gateway": {"hosts": {"gw": {"ansible_connection": "local"}}},
                "sparks": {"hosts": sparks},
            }
        }
    }
    play = [{"hosts": "gateway", "gather_facts": False,
             "vars_files": [str(ROOT / "roles" / "gateway" / "defaults" / "main.yml")],
             "tasks": checks}]  # fmt: skip
    # the gateway's own values as extra vars: they win over the role defaults the play reads
    extra = {"sparkple_api_port": 8000, **gateway}
    return run_playbook(tmp_path, yaml.safe_dump(play), extra, inventory=inventory, timeout=120)


KEYED = {"spark-1": {"sparkple_api_key": "spark-key"}, "spark-2": {"sparkple_api_key": "spark-key"}}


@pytest.mark.parametrize(
    ("gateway", "sparks", "refused"),
    [
        ({}, KEYED, "gateway_api_keys is empty"),
        ({"gateway_api_insecure": True, "gateway_backend_api_key": "spark-key"}, KEYED, ""),
        ({"gateway_bind_address": "127.0.0.1", "gateway_backend_api_key": "spark-key"}, KEYED, ""),
        ({"gateway_api_keys": ["client-key"], "gateway_backend_api_key": "spark-key"}, KEYED, ""),
        # keyed Sparks, and the gateway would pass the client's key through: refused
        ({"gateway_api_keys": ["client-key"]}, KEYED, "is not\nthat key"),
        (
            {"gateway_api_keys": ["c"], "gateway_backend_api_key": "other"},
            KEYED,
            "is not\nthat key",
        ),
        # Sparks with no key of their own (loopback behind a local proxy, say): nothing to match
        ({"gateway_api_keys": ["client-key"]}, {"spark-1": {}}, ""),
    ],
)
def test_the_gateway_is_closed_unless_opened_and_sends_the_sparks_key(
    tmp_path: Path, gateway: dict, sparks: dict, refused: str
) -> None:
    done = gateway_checks(tmp_path, gateway, sparks)
    if not refused:
        assert done.returncode == 0, done.stdout[-2000:]
        return
    assert done.returncode != 0, done.stdout[-2000:]
    said = re.sub(r"\s+", " ", done.stdout)
    assert re.sub(r"\s+", " ", refused) in said, said[-2000:]


def test_site_yml_refuses_an_open_api_before_anything_changes(tmp_path: Path) -> None:
    """The real site.yml on an inventory whose Spark serves 0.0.0.0 with no key: it stops at
    the first task of its first role, with nothing changed."""
    inventory = {"sparks": {"hosts": {"spark-open": {
        "ansible_connection": "local", "ansible_become": False,
        "sparkple_api_host": "0.0.0.0"}}}}  # fmt: skip
    done = run_playbook(tmp_path, ROOT / "site.yml", {}, inventory=inventory)
    assert done.returncode != 0
    assert "Refuse an API open to the network without a key" in done.stdout, done.stdout[-3000:]
    assert "Set sparkple_api_key" in done.stdout and "sparkple_api_insecure: true" in done.stdout
    recap = re.search(r"spark-open\s*:\s*ok=(\d+)\s+changed=(\d+)", done.stdout)
    assert recap is not None and recap.group(2) == "0", done.stdout[-1500:]
