"""Print the state of a HF snapshot as JSON: what is missing, and a key that changes with its files.

Usage: snapshot_state.py SNAPSHOT_DIR MANIFEST
The key covers every file's name, size and mtime plus the manifest, so a verified snapshot
is verified again only when something changed.
"""

import hashlib
import json
import os
import sys


def main() -> int:
    snap, manifest = sys.argv[1], sys.argv[2]
    missing = []
    names = set()
    index = os.path.join(snap, "model.safetensors.index.json")
    for required in ("config.json", "model.safetensors.index.json"):
        if not os.path.isfile(os.path.join(snap, required)):
            missing.append(required)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names.update(json.load(f).get("weight_map", {}).values())
    if os.path.isfile(manifest):
        with open(manifest, encoding="utf-8") as f:
            names.update(line.split(None, 1)[1].lstrip("*").strip() for line in f if line.strip())
    else:
        missing.append(manifest)
    key = hashlib.sha256()
    for name in sorted(names):
        path = os.path.join(snap, name)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            missing.append(name)
            continue
        st = os.stat(path)
        key.update(f"{name} {st.st_size} {st.st_mtime_ns}\n".encode())
    if os.path.isfile(manifest):
        with open(manifest, "rb") as f:
            key.update(f.read())
    print(json.dumps({"missing": sorted(set(missing)), "key": key.hexdigest()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
