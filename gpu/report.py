"""The GPU check's figures as one JSON file and a short text summary.

Usage: python report.py OUT_DIR PREAMBLE_JSON NAME=RESULT_JSON [...]

Writes OUT_DIR/gpu-check.json ({"preamble": ..., "checks": {NAME: ...}, "ok": ...}) and
OUT_DIR/summary.txt (the machine, then each check's summary lines), and prints the summary.
A check that wrote no result counts as failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    out, preamble = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    checks: dict[str, dict] = {}
    lines: list[str] = []
    machine = preamble.get("torch_device") or preamble.get("gpu") or "CPU (smoke mode)"
    lines.append(
        f"{machine}, driver {preamble.get('driver', '-')}, Python {preamble['python']}, "
        f"torch {preamble['torch']} (CUDA {preamble['torch_cuda_build']}), "
        f"triton {preamble['triton']}, vLLM {preamble['vllm']}"
    )
    for arg in sys.argv[3:]:
        name, _, path = arg.partition("=")
        result_path = Path(path)
        if not result_path.is_file():
            checks[name] = {"ok": False, "summary": [f"{name}: wrote no result"]}
        else:
            checks[name] = json.loads(result_path.read_text())
        lines += checks[name].get("summary", [f"{name}: ok={checks[name].get('ok')}"])
    ok = all(check.get("ok") for check in checks.values())
    lines.append("gpu-check: " + ("every check passed" if ok else "a check FAILED"))
    report = {"preamble": preamble, "checks": checks, "ok": ok}
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"gpu-check: figures in {out / 'gpu-check.json'}, summary in {out / 'summary.txt'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
