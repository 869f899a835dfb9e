# The lab's stand-in for the serving image (vllm/vllm-openai on a real Spark):
# Debian's Python 3, numpy and the patch engine's dependencies, the real vLLM Python sources of
# one release at the image's package path (.ci/lab-images builds one image per release, tagged
# vllm-VERSION: 0.34.0, the default the lab serves, and 0.33.0), and the lab server behind a
# `vllm` command, as the serving unit starts every image (`--entrypoint vllm ... serve`; the
# image's own entrypoint is the lab server too). It does not run vLLM: it has no GPU and no
# compiled vLLM kernels.
FROM local/sparkple-lab-python:bookworm
COPY site-packages/ /usr/local/lib/python3.11/dist-packages/
COPY lab_*.py /opt/sparkple-lab/
COPY vllm-command /usr/local/bin/vllm
LABEL org.sparkple.lab="serving-stand-in"
ENV PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["python3", "/opt/sparkple-lab/lab_server.py"]
