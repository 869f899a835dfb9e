"""transformers' greedy tokens and top-k logprobs for the engine tests' requests, run in the
vLLM test venv (transformers implements Qwen4ExpForConditionalGeneration with a BF16 PLE).

    python engine_reference.py SNAPSHOT SPEC_JSON RESULT_JSON

Every request of the spec's first run (harness/engine_run.py's format), alone, no cache: each
step runs the whole sequence so far and takes the argmax of the last position's logits (the
logprobs: log_softmax of those logits in float32). The result: {"outputs": {ID: {"tokens",
"logprobs"}}, "loading_info", "seconds"}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen4ExpForConditionalGeneration


def main() -> int:
    snapshot, spec_path, result_path = (Path(a) for a in sys.argv[1:4])
    spec = json.loads(spec_path.read_text())
    k = int(spec.get("logprobs", 3))
    started = time.monotonic()
    model, info = Qwen4ExpForConditionalGeneration.from_pretrained(
        snapshot, dtype=torch.bfloat16, output_loading_info=True
    )
    model.eval()
    outputs = {}
    requests = [r for batch in spec["runs"][0]["batches"] for r in batch]
    with torch.no_grad():
        for request in requests:
            ids = list(request["prompt"])
            tokens, steps = [], []
            for _ in range(int(request["max_tokens"])):
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                top = torch.topk(logprobs, k)
                steps.append(
                    [[int(t), float(v)] for t, v in zip(top.indices, top.values, strict=True)]
                )
                token = int(top.indices[0])
                tokens.append(token)
                ids.append(token)
            outputs[request["id"]] = {"tokens": tokens, "logprobs": steps}
    result = {
        "outputs": outputs,
        "loading_info": {key: sorted(str(x) for x in v) for key, v in info.items()},
        "seconds": time.monotonic() - started,
    }
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
