"""Run inside the vLLM test venv, once per tensor-parallel rank: the packed table at TP=2.

Usage: python ple_tp.py DEVICE RENDERED_DIR RESULT_JSON TP_RANK TP_SIZE INIT_FILE
       NAME=SNAPSHOT=TABLE_DIR[=RELEASE_ID=PATCH_MANIFEST_SHA256] [...]

Every rank's process sets up vLLM's own parallel state (`init_distributed_environment` and
`initialize_model_parallel` over gloo, rendezvous in INIT_FILE), so the TP group, and the PLE's
embedding group with it, are vLLM's. Each rank builds the rendered backend through vLLM's own
`Qwen4ExpNGramEmbedding` (its VocabParallelEmbedding gives the rank its row range) from the
checkpoint, loads it with vLLM's safetensors iterator, and runs the equivalence tests' mixed
batches through vLLM's (patched) model state: the host step gathers the rank's rows, the
forward all-reduces the packed bytes and decodes. All-reduces go through vLLM's custom op
(`torch.ops.vllm.all_reduce`), as on CUDA, where the platform asks for it. With TP_SIZE 1 the
same run is the single-rank full-table reference. Writes per case: a sha256 of every step's
output bytes, which table pages are resident afterwards (mincore), dummy-run outputs, and the
error a case's load raised (a refused pair). A case with a release runs with it in
SPARKPLE_RELEASE_ID and SPARKPLE_PATCH_MANIFEST_SHA256, as the serving unit sets them. The
pytest side compares the ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

import harness.ple_layer as ple
from harness.ple_steps import Runner, schedule
from sparkple.runtime.pagecache import PAGE_SIZE, resident_pages

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: equal digests are equal bits."""
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


def table_pages(embedding) -> dict:
    """Resident pages of the table file, inside and outside the pages of the rank's rows."""
    table = embedding.table
    resident = resident_pages(table.rows.ctypes.data, table.meta.data_bytes)
    width = table.meta.row_width
    first = embedding.owned.start * width // PAGE_SIZE
    last = -(-embedding.owned.end * width // PAGE_SIZE)  # one past the range's last page
    return {
        "pages": int(resident.size),
        "resident": int(resident.sum()),
        "resident_outside_own_range": int(resident[:first].sum() + resident[last:].sum()),
        "own_range_pages": last - first,
    }


def run_case(patched, state_module, snapshot: Path, table_dir: Path, release: list[str]) -> dict:
    from transformers import Qwen4ExpTextConfig

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    prefix = f"model.language_model.layers.{ple.PLE_DECODER_LAYER}.ple.ple_embedding."
    # set while the case runs: the patched model state runs the host step only then
    env = {"SPARKPLE_PLE_TABLE_DIR": str(table_dir)}
    if release:
        env["SPARKPLE_RELEASE_ID"], env["SPARKPLE_PATCH_MANIFEST_SHA256"] = release
    os.environ.update(env)
    try:
        return steps_of_case(patched, state_module, config, snapshot, prefix)
    finally:
        for name in env:
            os.environ.pop(name)


def steps_of_case(patched, state_module, config, snapshot: Path, prefix: str) -> dict:
    vocab, eos = int(config.vocab_size), int(config.eos_token_id)
    result: dict = {}
    try:
        layers = {k: ple.build(patched, config, snapshot, prefix, d)[0] for k, d in DTYPES.items()}
    except Exception as exc:  # a refused start: what vLLM's worker would die of
        return {"load_error": f"{type(exc).__name__}: {exc}"}
    embedding = layers["float32"].ngram_embedding
    result["backend"] = type(embedding).__name__
    result["tp"] = [embedding.tp_rank, embedding.tp_size]
    result["owned"] = [embedding.owned.start, embedding.owned.end]
    result["total_rows"] = embedding.table.meta.total_rows
    result["fingerprint"] = embedding.table.meta.fingerprint()
    result["data_file"] = embedding.table.meta.data_file
    result["resident_before"] = embedding.table.evict()  # cold: nothing read yet

    state = ple.model_state(state_module, torch.nn.ModuleList(layers.values()), config)
    runner = Runner(state)
    steps: dict[str, list] = {k: [] for k in DTYPES}
    padding_zero, nonzero = [], []
    names = []
    for name, scheduled, padding in schedule(runner, vocab, eos):
        input_ids, qsl, ctx, real = runner.step(scheduled, **padding)
        names.append(name)
        for key in DTYPES:
            out = ple.forward(layers[key], input_ids, qsl, ctx)
            steps[key].append(digest(out[:real]))
            nonzero.append(bool(out[:real].abs().sum() > 0))
            padding_zero.append(bool((out[real:] == 0).all()))
        if name in ("mixed prefill", "uniform decode"):
            # the in-forward path, all-reduce included, as one graph: vLLM's all-reduce is a
            # custom op that dynamo keeps whole (a graph break or host sync would raise)
            torch._dynamo.reset()
            compiled = torch.compile(ple.in_forward, fullgraph=True, backend="eager")
            for key in DTYPES:
                emb = layers[key].ngram_embedding
                tokens = input_ids.shape[0]
                same = torch.equal(compiled(emb, tokens), ple.in_forward(emb, tokens))
                result.setdefault("compiled_equal", []).append(bool(same))
    result["step_names"] = names
    result["steps"] = steps
    result["padding_rows_zero"] = all(padding_zero)
    result["every_step_nonzero"] = all(nonzero)
    result["pages"] = table_pages(embedding)
    result["rows_gathered"] = ple.counters(embedding)[0]

    # dummy, profile and capture runs: every rank sums zeros, no row is read
    before = ple.counters(embedding)
    dummy = state.prepare_dummy_inputs(4, 64)
    zeros = torch.zeros(64, dtype=torch.int32, device=ple.DEVICE)
    out = ple.forward(layers["float32"], zeros, dummy["query_start_loc"], dummy["ngram_context"])
    result["dummy_output_zero"] = bool((out == 0).all())
    result["dummy_counters_unchanged"] = ple.counters(embedding) == before
    for layer in layers.values():
        layer.ngram_embedding.close()
    return result


def main() -> None:
    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    tp_rank, tp_size, init_file = int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6])
    cases = [arg.split("=") for arg in sys.argv[7:]]
    ple.seed_loader_filter(rendered)
    results: dict[str, object] = {}
    with (
        tempfile.TemporaryDirectory() as work,
        ple.vllm_context(Path(work), tp_rank=tp_rank, tp_size=tp_size, init_file=init_file),
    ):
        from vllm.distributed import get_etp_group, get_tp_group

        tp = get_tp_group()
        results["etp_is_tp"] = get_etp_group() is tp
        # CUDA's platform sends collectives through vLLM's custom ops; so does this run
        tp.use_custom_op_call = True
        patched, state_module = ple.patched_modules(rendered)
        for name, snapshot, table_dir, *release in cases:
            results[name] = run_case(
                patched, state_module, Path(snapshot), Path(table_dir), release
            )
    result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
