# The lab target: a Debian systemd container standing in for a DGX Spark.
# Built from the offline mmdebstrap base (see .ci/lab-images); no registry is used.
FROM local/sparkple-lab-base:bookworm
# apt's cache_valid_time must not treat the build-time lists as fresh
RUN touch -d @0 /var/lib/apt/lists
# Stand-in for the NVIDIA runtime the real Spark registers with nvidia-ctk: plain runc.
COPY daemon.json /etc/docker/daemon.json
# Ansible's modules run from bytecode kept on the host, not compiled again each task: most of the
# lab scenarios' CPU (lab/ansible_bytecode.py; site runs the .pth's import at start-up)
COPY ansible_bytecode.py /usr/local/lib/python3.11/dist-packages/lab_ansible_bytecode.py
RUN echo "import lab_ansible_bytecode" >/usr/local/lib/python3.11/dist-packages/lab_ansible_bytecode.pth
LABEL org.sparkple.lab="target"
STOPSIGNAL SIGRTMIN+3
CMD ["/lib/systemd/systemd"]
