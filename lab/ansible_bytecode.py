"""Test machines only: keep the bytecode of the Python that Ansible sends, so no task compiles it
again.

Every Ansible task runs its module from a zip of the module and its module_utils (AnsiballZ),
written to a new temporary directory. Python's zipimport finds no bytecode in that zip and
compiles every source it imports, each task again: for a `stat` task on a lab host, 0.41 CPU-s in
the host's container without this file, 0.29 with it (the whole task, controller included:
0.65 and 0.50 CPU-s). The lab's scenarios and the role tests run thousands of tasks on two cores,
so this is a quarter of their CPU. A real Spark runs few tasks and is not given this file.

Installed, with a .pth whose import line site runs at start-up, in the lab images
(lab/target.Dockerfile) and in the test controller's venv (.ci/setup-venv). The cache is keyed by
the exact source bytes and the interpreter's bytecode tag, so a cached code object is the one
`compile` returns; only its file name (the task's temporary path) is set afresh, for tracebacks.
Anything that goes wrong falls back to compiling, as without this file.
"""

from __future__ import annotations

import os
import sys
import types
import zipimport
from collections.abc import Callable

# the lab hosts keep it here; the test controller in $SPARKPLE_CACHE (.ci/env)
CACHE_DIR = os.environ.get("LAB_ANSIBLE_BYTECODE_DIR", "/var/cache/lab-ansible-bytecode")
# only the zips AnsiballZ writes (ansible_<module>_payload.zip)
PAYLOAD_MARK = "_payload.zip" + os.sep

_compile_source: Callable[[str, bytes], types.CodeType] = zipimport._compile_source  # type: ignore[attr-defined]


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(
        _renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def _cached_compile(pathname: str, source: bytes) -> types.CodeType:
    if PAYLOAD_MARK not in pathname:
        return _compile_source(pathname, source)
    import hashlib  # here, not at start-up: most Pythons never import from a payload
    import marshal

    key = hashlib.sha256(source)
    key.update(sys.implementation.cache_tag.encode())
    path = os.path.join(CACHE_DIR, key.hexdigest())
    try:
        with open(path, "rb") as cached:
            return _renamed(marshal.load(cached), pathname)
    except (OSError, EOFError, ValueError, TypeError):
        pass
    code = _compile_source(pathname, source)
    try:  # written whole under a private name, then renamed: a reader never sees half
        os.makedirs(CACHE_DIR, exist_ok=True)
        partial = f"{path}.{os.getpid()}"
        with open(partial, "wb") as out:
            marshal.dump(code, out)
        os.replace(partial, path)
    except OSError:
        pass
    return code


zipimport._compile_source = _cached_compile  # type: ignore[attr-defined]
