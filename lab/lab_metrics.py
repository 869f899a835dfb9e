"""The lab server's `GET /metrics`: the vLLM series the fleet's monitoring reads, counted for real.

vLLM 0.33.0 exports its engine metrics with prometheus_client (`vllm/v1/metrics/loggers.py`,
`PrometheusStatLogger`): every series carries the labels `model_name` (the served name) and
`engine` (the engine index, "0" for one engine); counters get the `_total` suffix; the time to
first token is a histogram with the buckets of `vllm/v1/metrics/buckets.py`
(`TIME_TO_FIRST_TOKEN_BUCKETS`). vLLM's API key guards only paths under `/v1`
(`entrypoints/serve/middleware/authenticate.py`), so `/metrics` answers without one; the lab
does the same.

The lab counts what its front really does: the requests holding one of its `--max-num-seqs`
slots (running) and those waiting for one (the front's own count, passed to `render`), prompt
and generated tokens, finished requests, and the time from each request's arrival to its first
token.
Standard library only: the lab server runs with the serving image's Python.
"""

from __future__ import annotations

import threading

# vLLM 0.33.0's TIME_TO_FIRST_TOKEN_BUCKETS (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class ServingMetrics:
    """Thread-safe counters of the lab front, rendered in Prometheus' text format."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self._ttft_counts = [0] * len(TTFT_BUCKETS)
        self._ttft_sum = 0.0
        self._ttft_count = 0

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttft_sum += seconds
            self._ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self._ttft_counts[i] += 1

    def count_finished(self, prompt_tokens: int, generated_tokens: int, reason: str) -> None:
        with self._lock:
            self._prompt_tokens += prompt_tokens
            self._generation_tokens += generated_tokens
            self._success[reason] = self._success.get(reason, 0) + 1

    def render(self, running: int, waiting: int) -> str:
        """The exposition text, each family with its HELP and TYPE, as prometheus_client; the
        scheduler's gauges are the front's (`running` hold a slot, `waiting` wait for one)."""
        with self._lock:
            labels = f'engine="0",model_name="{self.model_name}"'
            lines: list[str] = []

            def family(name: str, kind: str, doc: str) -> None:
                lines.extend((f"# HELP {name} {doc}", f"# TYPE {name} {kind}"))

            family(
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
            )
            lines.append(f"vllm:num_requests_running{{{labels}}} {running:.1f}")
            family(
                "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed."
            )
            lines.append(f"vllm:num_requests_waiting{{{labels}}} {waiting:.1f}")
            family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
            lines.append(f"vllm:prompt_tokens_total{{{labels}}} {self._prompt_tokens:.1f}")
            family(
                "vllm:generation_tokens_total", "counter", "Number of generation tokens processed."
            )
            lines.append(f"vllm:generation_tokens_total{{{labels}}} {self._generation_tokens:.1f}")
            family(
                "vllm:request_success_total", "counter", "Count of successfully processed requests."
            )
            for reason, n in sorted(self._success.items()):
                lines.append(
                    f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {n:.1f}'
                )
            name = "vllm:time_to_first_token_seconds"
            family(name, "histogram", "Histogram of time to first token in seconds.")
            for bound, n in zip(TTFT_BUCKETS, self._ttft_counts, strict=True):
                lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {n:.1f}')
            lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {self._ttft_count:.1f}')
            lines.append(f"{name}_count{{{labels}}} {self._ttft_count:.1f}")
            lines.append(f"{name}_sum{{{labels}}} {self._ttft_sum!r}")
        return "\n".join(lines) + "\n"
