"""The host's PLE and serving metrics: one collection run (`python3 -m sparkple.metrics.collect`)
written for node_exporter's textfile collector in Prometheus' exposition format. Standard library
only.
"""
