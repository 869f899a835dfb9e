"""sparkple lab server: a stand-in for vLLM in the lab's serving image. It is NOT vLLM.

The lab target has no GB10 GPU, so the real engine cannot start. This server takes the
place of the image's entrypoint so that the service, its bind mounts, its health gate and
the operations units are exercised for real. Like vLLM's OpenAI server it is two processes:

- the engine (a child process) checks the patched vLLM files mounted over the image's own
  against their manifest, opens the packed PLE table named by SPARKPLE_PLE_TABLE_DIR
  through `sparkple.runtime.table` (the package bind-mounted read-only, as for vLLM) with the
  geometry of the mounted model's config.json, then serves completions on a unix socket: the
  prompt's UTF-8 bytes become token ids, their PLE rows are looked up in the table (row ids
  from `sparkple.runtime.ngram`, the gather from `sparkple.runtime.gather`, the NVFP4 decode
  from `sparkple.runtime.nvfp4`) and each next "token" is derived from the decoded rows. The
  text means nothing; the lookups are real.
- the API front answers `GET /health` itself: 200 once the engine reported both checks good,
  503 with the reason otherwise. It hands each `POST /v1/completions` to the engine, which
  sends the tokens back one at a time, and answers 504 when the engine does not send the next
  within the engine timeout. So a stopped engine (SIGSTOP) looks like a wedged vLLM engine:
  /health 200 while generations fail.
- `"stream": true` is answered as vLLM answers it: server-sent events, one `data:` chunk per
  token (the last one with its finish_reason), a usage chunk when
  `stream_options.include_usage` asks for one, then `data: [DONE]`. An engine failure after
  the first token is an error chunk, then `data: [DONE]`, as in vLLM.
- like vLLM's scheduler, at most --max-num-seqs requests run at a time (default 256); the
  others wait. `GET /metrics` shows both counts under vLLM's names
  (`vllm:num_requests_running`, `vllm:num_requests_waiting`), which is what a drain waits on.
  A request counts from its arrival until its last byte is written.

SIGTERM, to the front or to both processes, stops both cleanly (exit 0). An engine that dies
otherwise after it was ready makes the front exit 1, so that the supervisor sees a dead server.

It answers `/v1/models`, `/v1/completions` and `/v1/chat/completions` in the shape vLLM's
OpenAI server answers them (a request for another model name is a 404, as in vLLM).

A pair (two Sparks at TP 2, sparkple.pair.plan) is `--tensor-parallel-size 2 --nnodes 2`
with `--node-rank 0` on the head and `--node-rank 1 --headless` on the worker, both with
`--master-addr` and `--master-port` (vLLM's defaults 127.0.0.1 and 29501); any other
multi-node set-up is refused (exit 2). Modelled on vLLM 0.33.0's multiproc executor across
two nodes (docs/tensor-parallel.md; the link itself is lab_pair.py):
- the head's engine listens on --master-port (all addresses) for its worker once its table is
  open. /health answers 503 "waiting for node 1 of the pair at <addr>:<port>" until the worker
  joined, then 200 while it stays connected; a second worker is refused. When the worker goes
  (its connection closes, or its heartbeat stops for 3 s: a SIGSTOPped worker), /health
  answers 503 and generations fail at once, and the engine exits 1 after
  SPARKPLE_LAB_PEER_TIMEOUT_S, so the front exits 1: vLLM's head notices only when a step needs
  the worker, its engine core dies once the step's RPC times out
  (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s: envs.py:1863-1865, multiproc_executor.py:414),
  and its API server then exits (entrypoints/launchers/launcher.py:325-337). Unlike vLLM,
  whose /health stays 200 until then (entrypoints/serve/instrumentator/health.py:30), the lab
  says 503 at once.
- the worker serves no HTTP (vLLM's headless node runs only its executor,
  entrypoints/cli/serve.py:218-233): one process that opens its table, joins the head (retrying
  until SPARKPLE_LAB_JOIN_TIMEOUT_S, then exit 1) and, when the head goes, stays up: vLLM's
  worker waits for the next step with no timeout (v1/executor/multiproc_executor.py:1159) and
  nothing on its node watches the head. It never joins another head (restart it); SIGTERM
  stops it (exit 0).
- on joining, the two exchange their release (SPARKPLE_RELEASE_ID and
  SPARKPLE_PATCH_MANIFEST_SHA256), their table's fingerprint and fields and their config.json's
  sha256: a difference makes both exit 1 with a message naming both nodes and what differs,
  as the real patch's rank check does (sparkple/runtime/rankcheck.py).

Its command line is the subset of `vllm serve`'s that the service's unit passes (ACCEPTED_FLAGS
of the serving recipe, sparkple.serving.recipe; tests/vllm checks each flag against the default
release's own parser, vLLM 0.34.0's): anything else is refused like vLLM refuses an unknown
argument (exit 2), and JSON-valued flags must be valid JSON, so a unit that mangles an argument
fails in the lab too. The lab's own knobs are env vars:
SPARKPLE_LAB_ENGINE_TIMEOUT_S, the bound on each reply of the engine (seconds, default 30), and
SPARKPLE_LAB_TOKEN_DELAY_S, the time the engine takes per token (seconds, default 0), so that a
generation can last as long as a real one, and SPARKPLE_LAB_HEALTH_FAIL_FILE, a path: while a
file is there, /health answers 503 as vLLM's does once its engine core died (the operations
tests turn it on and off under a running server). A pair's: SPARKPLE_LAB_PEER_TIMEOUT_S, how
long a head's engine lives on after its worker went (seconds, default 2; vLLM's step timeout),
and SPARKPLE_LAB_JOIN_TIMEOUT_S, how long a worker tries to reach its head (seconds, default
600).

The code, by concern, in the modules beside this one (flat, as the images copy lab/lab_*.py to
/opt/sparkple-lab/): lab_engine.py (the engine process, its socket and the patch check),
lab_api.py (the front's HTTP handler, the OpenAI replies and streaming), lab_front.py (the
command line, the engine's start, watch and stop, main), lab_worker.py (a pair's headless
worker), lab_pair.py (the link between a pair's nodes) and lab_metrics.py (vLLM's series).
This file stays the entry point that the images, units and tests run.
"""

from __future__ import annotations

import sys

# beside this file, as in the lab images; what tests/vllm reads from this script too
from lab_front import main, parse_args

from sparkple.serving.recipe import ACCEPTED_FLAGS, PAIR_FLAGS

__all__ = ["ACCEPTED_FLAGS", "PAIR_FLAGS", "main", "parse_args"]


if __name__ == "__main__":
    sys.exit(main())
