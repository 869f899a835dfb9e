"""Measuring a running server: the fleet benchmark and its A/B comparison, the rollout's speed and
quality gates, the GPU clock they record, and the runner of vLLM's own serving benchmark.
"""
