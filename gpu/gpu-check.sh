#!/usr/bin/env bash
# The GPU check, one set of checks run three ways: `make gpu-check [PYTHON=...]` in a checkout,
# `bash gpu-check.sh` inside the unpacked `make gpu-bundle` archive (offline), and inside the
# serving image (playbooks/gpu_check.yml). In order: the preamble (what it runs on, or a
# one-line refusal, exit 2), the torch tier (torch, triton and numpy only), the bundle's
# packages laid out, the import smoke test, then each check script and the gpu-marked tests;
# the figures go to one JSON and a short text summary in $GPU_CHECK_OUT.
#   --cpu-smoke  the same on the CPU, small (any machine whose Python has torch; exit 0)
# Environment: PYTHON (default python3), GPU_CHECK_OUT, SPARKPLE_GPU_RENDERED (rendered patch
# files to use, as the serving image mounts them; default: rendered here or in the bundle).
set -euo pipefail
python=${PYTHON:-python3}
if [[ $python == */* && -x $python ]]; then  # a path, from where it was given
    python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
fi
here=$(cd "$(dirname "$0")" && pwd)
if [[ -d $here/sparkple ]]; then root=$here; else root=$(dirname "$here"); fi
cd "$root"

# The checks: NAME SCRIPT, each run as SCRIPT {cuda|cpu} RENDERED RESULT_JSON SNAPSHOT=TABLE,
# exit 0 when its checks pass; one more check is one more line. Each step (the torch tier, each
# check, the gpu-marked tests) is stopped after GPU_CHECK_TIMEOUT_S (default 200 s).
checks=(
    "graph harness/gpu_graph_check.py"
    "host_split harness/gpu_host_split.py"
    "disk_offload harness/gpu_disk_offload.py"
)
limit=${GPU_CHECK_TIMEOUT_S:-200}
# On a GPU the whole run ends within GPU_CHECK_BUDGET_S (default 450 s: under 8 minutes with
# the report), each step stopped at what is left of it (the budget is set below).
bound() { # seconds the next step may take: its limit, or what is left of the budget
    local left=$((budget - SECONDS))
    ((left < limit)) || left=$limit
    ((left > 0)) || left=1
    echo "$left"
}
# Every test file with `gpu`-marked tests (tests/vllm/test_gpu_check.py checks this list), run
# after the checks under CI's rules, and none may skip here (SPARKPLE_CUDA_REQUIRED). Only the
# project's own plugin (tests/conftest.py) is loaded: a machine's other pytest plugins (say
# pytest-xdist without its execnet) have nothing to do with them.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
gpu_tests=(
    tests/pkg/test_gpu.py
    tests/runtime/test_image_smoke.py
    tests/runtime/test_worker.py
    tests/vllm/test_gpu_check.py
    tests/vllm/test_vllm_integration.py
)

device=cuda
case "${1:-}" in
    "") ;;
    --cpu-smoke) device=cpu ;;
    *) echo "usage: $0 [--cpu-smoke]" >&2; exit 2 ;;
esac
if [[ $device == cuda ]]; then budget=${GPU_CHECK_BUDGET_S:-450}; else budget=3600; fi
if [[ $device == cuda ]] && ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L failed): run it on a machine with one" >&2
    exit 2
fi
if ! command -v "$python" >/dev/null 2>&1; then
    echo "gpu-check: no Python at '$python': set PYTHON to an interpreter with torch" >&2
    exit 2
fi

out=${GPU_CHECK_OUT:-$root/gpu-check-results}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the refusals first, before anything is extracted, downloaded or rendered
"$python" gpu/preamble.py "$device" "$work/preamble.json" >/dev/null
failed=0
# the project's own device code first, with torch, triton and numpy alone: its figures are
# written even when the vLLM tier below cannot run (on the CPU, Triton's interpreter)
echo "gpu-check: torch tier (gpu/torch_tier.py)"
interpret=()
if [[ $device == cpu ]]; then interpret=(TRITON_INTERPRET=1); fi
if ! (cd "$work" && env "${interpret[@]}" PYTHONPATH="$root" timeout "$(bound)" "$python" \
    "$root/gpu/torch_tier.py" "$device" "$out/torch.json"); then
    failed=1
fi
needs=()
sources=""  # vLLM's Python sources, where it is not installed
if [[ -d bundle/vllm-src ]]; then
    # the unpacked bundle: vLLM's sources, and the packages it carries that this machine
    # lacks (or has older, or incompatible), laid out for this Python (gpu/carried.py)
    "$python" gpu/carried.py bundle "$work/carried" "$out/carried.json"
    sources=$root/bundle/vllm-src
    vllm_path=$sources:$work/carried
    rendered=${SPARKPLE_GPU_RENDERED:-$root/bundle/rendered}
    needs=(bundle/needs.json)
elif [[ -n ${SPARKPLE_GPU_RENDERED:-} ]]; then
    # the serving image: its own vLLM, the rendered files the service mounts
    vllm_path=""
    rendered=$SPARKPLE_GPU_RENDERED
else
    # a checkout: the default patch profile's vLLM release, its Python sources from the
    # cached wheel, and that profile rendered here
    sources=$("$python" gpu/bundle.py sources | tail -1)
    vllm_path=$sources
    rendered=$work/rendered
    profile=$(PYTHONPATH=$root "$python" -c 'from sparkple.patch import DEFAULT_PROFILE as p; print(p)')
    PYTHONPATH=$root "$python" -m sparkple.cli patch render --profile "$profile" \
        --originals "$sources/vllm" --out "$rendered" >/dev/null
fi
export PYTHONPATH="$root${vllm_path:+:$vllm_path}"
if [[ $device == cpu ]]; then
    # vLLM's CPU platform on any machine, and the V2 runner that serves this model on CUDA
    # (vLLM picks it where triton imports; a CPU torch may come without triton). No GPU
    # visible, on purpose: vLLM 0.34's CPU platform refuses an x86 config without a Triton it
    # can use (platforms/cpu.py), and counts the CUDA Triton only where CUDA_VISIBLE_DEVICES
    # is empty (triton_utils/importing.py); no vLLM kernel runs in the smoke mode
    export VLLM_TARGET_DEVICE=cpu VLLM_USE_V2_MODEL_RUNNER=1 CUDA_VISIBLE_DEVICES=
fi

"$python" gpu/preamble.py "$device" "$out/preamble.json" "${needs[@]}"
(cd "$work" && "$python" "$root/gpu/import_smoke.py" "$device" "$rendered")

# a synthetic checkpoint and its table: 0.7 GiB on the GPU, small for the smoke mode
if [[ $device == cuda ]]; then size=(--vocab-base 500000 --files 4); else size=(--vocab-base 3000 --files 2); fi
"$python" -m sparkple.cli synth-checkpoint "$work/snapshot" "${size[@]}" >/dev/null
"$python" -m sparkple.cli build-table "$work/snapshot" "$work/table" --quiet
results=("torch=$out/torch.json")
for check in "${checks[@]}"; do
    read -r name script <<<"$check"
    echo "gpu-check: $name ($script)"
    if ! (cd "$work" && env -u SPARKPLE_PLE_TABLE_DIR timeout "$(bound)" "$python" "$root/$script" \
        "$device" "$rendered" "$out/$name.json" "$work/snapshot=$work/table"); then
        failed=1
    fi
    results+=("$name=$out/$name.json")
done
# the gpu-marked tests, with vLLM's sources as the checks had them (the bundle carries pytest
# where PYTHON lacks it); not in the serving image, whose vLLM files are the patched ones
gpu_pytest=(env CI=true SPARKPLE_VLLM_PYTHON="$python" SPARKPLE_VLLM_SOURCES="$sources"
    "$python" -m pytest -q -p no:cacheprovider -m gpu "${gpu_tests[@]}")
if [[ $device == cuda && -n $sources ]]; then
    echo "gpu-check: the gpu-marked tests (${gpu_tests[*]})"
    if ! SPARKPLE_CUDA_REQUIRED=1 timeout "$(bound)" "${gpu_pytest[@]}" \
        >"$out/gpu-tests.log" 2>&1; then
        failed=1
    fi
    tail -n 3 "$out/gpu-tests.log"
    echo "gpu-check: the gpu-marked tests' output is in $out/gpu-tests.log"
elif [[ -n $sources ]]; then
    # the smoke mode: they are collected as they would run (pytest, the paths, the imports)
    if collected=$("${gpu_pytest[@]}" --collect-only 2>&1); then
        echo "gpu-check: the gpu-marked tests collect ($(tail -n 1 <<<"$collected")); they run" \
            "where there is a GPU"
    else
        echo "$collected"
        echo "gpu-check: the gpu-marked tests do not collect"
        failed=1
    fi
elif [[ $device == cuda ]]; then
    echo "gpu-check: gpu-marked tests not run in the serving image (its vLLM files are the" \
        "patched ones): run make gpu-check or the bundle for them"
fi
"$python" gpu/report.py "$out" "$out/preamble.json" "${results[@]}" || failed=1
exit "$failed"
