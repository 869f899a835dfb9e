# The fleet scenario's light lab host: the lab target's systemd plus the stand-in serving image's
# Python packages (numpy, the real vLLM 0.34.0 sources: the default release's) and the lab server,
# so the server runs directly under systemd from a release's files instead of in a nested engine;
# vLLM 0.33.0's sources beside them at /opt/sparkple-lab/vllm-0.33.0 (its `vllm` package and
# dist-info), for the scenario's 0.33 release, whose unit puts that directory first on its
# PYTHONPATH (molecule/fleet/roles/lab_release_service); and CPU torch
# (.ci/lab-fleet-image puts its wheels' files in the build context), for the pair's link
# benchmark with gloo. Debian's node exporter is installed once here rather than by ple_metrics on
# each of the six hosts at once: the role's apt task then finds it present (its install from an
# empty host is not exercised by any scenario). The lists stay as fetched: fresh for an hour,
# then the role's cache_valid_time updates them.
FROM local/sparkple-lab-target:bookworm
LABEL org.sparkple.lab="fleet-host"
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -qy --no-install-recommends \
        prometheus-node-exporter && apt-get clean
COPY --from=local/sparkple-lab-serving:vllm-0.34.0 /usr/local/lib/python3.11/dist-packages/ /usr/local/lib/python3.11/dist-packages/
COPY --from=local/sparkple-lab-serving:vllm-0.34.0 /opt/sparkple-lab/ /opt/sparkple-lab/
COPY --from=local/sparkple-lab-serving:vllm-0.33.0 /usr/local/lib/python3.11/dist-packages/vllm/ /opt/sparkple-lab/vllm-0.33.0/vllm/
COPY --from=local/sparkple-lab-serving:vllm-0.33.0 /usr/local/lib/python3.11/dist-packages/vllm-0.33.0.dist-info/ /opt/sparkple-lab/vllm-0.33.0/vllm-0.33.0.dist-info/
COPY torch-site-packages/ /usr/local/lib/python3.11/dist-packages/
