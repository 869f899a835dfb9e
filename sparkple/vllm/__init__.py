"""The vLLM adapter (vLLM 0.33 and 0.34): a Qwen4Exp PLE storage backend that reads the packed
table from NVMe through mmap, and the host step that feeds it. It imports vLLM: only the serving
process (a profile's rendered module, templates/vllm/<profile>/ple_mmap_embedding.py.j2, and the
edits to vLLM's own files that import from it) and the tests and tools that run vLLM load it.

The table named by SPARKPLE_PLE_TABLE_DIR stays in its file: it is mapped read-only with
MADV_RANDOM, so its pages are evictable page cache, never a copy in RAM.

Step order (the rule every part keeps):
1. Host step, in the model state's `prepare_inputs`, before the forward or a CUDA-graph
   replay and outside any capture (host_step.py). With async scheduling it runs while
   the previous step is still on the device, so it does first what needs nothing from it:
   a. Before any device sync: the rows of every prompt token (the model state keeps each
      request's prefill tokens from `add_request`; `sparkple.runtime.stepsplit` says which tokens
      they are) are computed and handed to the gather thread, for every packed layer, and
      the lookahead moves on (the pages of later chunks were advised in the background).
      Everything else the step needs that does not depend on the device is made then too:
      where each device token's n-gram window will be read from, the buffers its row ids
      go through, the staging and device views of the gather and the upload, and the zeros
      of padding rows (`prepare_step`).
   b. Only when the step has tokens the device made (a sampled token, MTP drafts): those
      tokens and the n-gram context are copied to pinned memory laid out as the windows
      read them, with the request boundaries (one copy, one event wait); then their row ids
      are a take and a fixed handful of numpy calls into those buffers, and their few rows
      one range check, the page advice and a take into the staging slot, on the model
      thread. A step of prompt tokens alone never waits for the device.
   c. The model thread waits for the gather thread's rows (step timeout) and uploads the
      step into the layer's persistent device buffer on the forward's stream; a staging slot
      is reused only after its upload completed (an event per slot). Rows of padding tokens
      are zeros; dummy and capture runs read no table row.
2. The forward (eager, piecewise or a FULL graph replay) only reads that device buffer and
   decodes it there (NVFP4 with the fused Triton kernel on CUDA): no host synchronization,
   nothing that depends on host state; vLLM's own n-gram-id kernel is skipped.
Tensor parallelism (the embedding group is the TP group): every rank runs the host step for
the rows of its own range of the table only (vLLM's shard indices), zeros for the others; the
forward sums the packed bytes over the group with vLLM's all-reduce (as int8: one rank is
non-zero for each row, so the sum is its owner's bytes, bit-exact), then decodes. Dummy and
capture runs sum zeros.
All of the table logic is the runtime's (sparkple/runtime/); this package only adapts it to
vLLM. Its modules: settings.py (the environment, constants and the settings refused),
releases.py (what one release refuses that the other does not: the only place that asks),
packed_table.py (the layer), host_inputs.py (the step's copies to the host), load_check.py (the
table against the loaded checkpoint and the pair's ranks), host_step.py (the step order).
"""
