# The lab target: a Debian systemd container standing in for a DGX Spark.
# Built from the offline mmdebstrap base (see .ci/lab-images); no registry is used.
FROM local/sparkple-lab-base:bookworm
# apt's cache_valid_time must not treat the build-time lists as fresh
RUN touch -d @0 /var/lib/apt/lists
# Stand-in for the NVIDIA runtime the real Spark registers with nvidia-ctk: plain runc.
COPY daemon.json /etc/docker/daemon.json
LABEL org.sparkple.lab="target"
STOPSIGNAL SIGRTMIN+3
CMD ["/lib/systemd/systemd"]
