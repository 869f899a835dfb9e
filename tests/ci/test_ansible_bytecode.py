"""lab/ansible_bytecode.py: the bytecode cache for the modules Ansible sends to the lab hosts and
runs on the test controller. Each case runs a fresh Python that loads the hook as site would,
then imports from a real zip, as AnsiballZ's payload is imported (-S: not the copy this
venv's site loads)."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "lab" / "ansible_bytecode.py"

SOURCE = b"VALUE = 'compiled from source'\n\ndef fail():\n    raise RuntimeError('here')\n"
# load the hook, import from the zip, print the value and the file a traceback names
PROGRAM = f"""
import sys, traceback
exec(compile(open({str(HOOK)!r}).read(), 'lab_ansible_bytecode', 'exec'))
sys.path.insert(0, sys.argv[1])
import payload_mod
try:
    payload_mod.fail()
except RuntimeError as err:
    print(payload_mod.VALUE, traceback.extract_tb(err.__traceback__)[-1].filename)
"""


def payload(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True)
    archive = folder / name
    with zipfile.ZipFile(archive, "w") as out:
        out.writestr("payload_mod.py", SOURCE)
    return archive


def run(archive: Path, cache: Path) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["LAB_ANSIBLE_BYTECODE_DIR"] = str(cache)
    proc = subprocess.run(
        [sys.executable, "-S", "-c", PROGRAM, str(archive)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    value, filename = proc.stdout.rstrip("\n").rsplit(" ", 1)
    return value, filename


def test_a_payloads_bytecode_is_kept_and_used_under_the_new_path(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = payload(tmp_path / "task-1", "ansible_stat_payload.zip")
    assert run(first, cache) == ("compiled from source", str(first / "payload_mod.py"))
    (entry,) = cache.iterdir()  # one source, one entry

    # the entry is what the next task runs: replace it, and the next task sees the replacement,
    # with the traceback naming the next task's own zip
    entry.write_bytes(
        marshal.dumps(
            compile("VALUE = 'from the cache'\n" + SOURCE.decode().split("\n", 2)[2], "x", "exec")
        )
    )
    second = payload(tmp_path / "task-2", "ansible_stat_payload.zip")
    assert run(second, cache) == ("from the cache", str(second / "payload_mod.py"))


def test_a_broken_entry_is_compiled_again_and_rewritten(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    archive = payload(tmp_path / "task", "ansible_stat_payload.zip")
    run(archive, cache)
    (entry,) = cache.iterdir()
    entry.write_bytes(b"\x00half")
    assert run(archive, cache)[0] == "compiled from source"
    assert marshal.loads(entry.read_bytes()).co_filename == str(archive / "payload_mod.py")


def test_other_zips_and_an_unwritable_cache_compile_as_python_does(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    other = payload(tmp_path / "wheel", "some_package.zip")
    assert run(other, cache)[0] == "compiled from source"
    assert not cache.exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    archive = payload(tmp_path / "task", "ansible_stat_payload.zip")
    assert run(archive, blocked / "cache")[0] == "compiled from source"
