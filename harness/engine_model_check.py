"""What transformers makes of a whole tiny model (sparkple synth-checkpoint --whole-model), run
in the vLLM test venv (transformers implements Qwen4ExpForConditionalGeneration, BF16 PLE only).

    python engine_model_check.py SNAPSHOT RESULT_JSON

Writes the tensors (name -> [dtype, shape]) the snapshot holds, the ones transformers' own
model of the snapshot's config saves (save_pretrained: the checkpoint's names, experts one by
one, the PLE table in split_ngram_parts shards), and what from_pretrained reports loading the
snapshot (missing, unexpected and mismatched keys).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, Qwen4ExpForConditionalGeneration


def tensors(directory: Path) -> dict[str, list]:
    found: dict[str, list] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                part = f.get_slice(name)
                found[name] = [part.get_dtype(), list(part.get_shape())]
    return found


def main() -> int:
    snapshot, result = Path(sys.argv[1]), Path(sys.argv[2])
    config = AutoConfig.from_pretrained(snapshot)
    torch.manual_seed(0)
    model = Qwen4ExpForConditionalGeneration(config).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        transformers_saves = tensors(Path(saved))
    _, info = Qwen4ExpForConditionalGeneration.from_pretrained(
        snapshot, dtype=torch.bfloat16, output_loading_info=True
    )
    report = {
        "snapshot": tensors(snapshot),
        "transformers_saves": transformers_saves,
        "loading_info": {k: sorted(str(x) for x in v) for k, v in info.items()},
    }
    result.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
