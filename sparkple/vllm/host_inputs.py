"""Where a step's inputs land on the host: pinned buffers the device's copies go into, one
copy and one wait a step (the host step's only synchronization with the device)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sparkple.runtime.stepsplit import DevicePlan
from sparkple.runtime.worker import host_tensor


class HostInputs:
    """The host buffers of one layer's step inputs (int32, as the V2 runner keeps them on the
    device): every token id, request boundary and n-gram context row (the wait-before-forward
    order), the split step's source that the device tokens' windows read, and a few probed
    prompt tokens."""

    def __init__(
        self, max_tokens: int, max_reqs: int, context: int, probes: int, pin: bool
    ) -> None:
        self.pin = pin
        self.all = (
            host_tensor((max_tokens,), "int32", pin=pin),
            host_tensor((max_reqs + 1,), "int32", pin=pin),
            host_tensor((max_reqs, context), "int32", pin=pin),
        )
        # The split step's copy lands where the device tokens' windows read it: the n-gram
        # context rows, the step's tokens, then the prompt tokens of this step that those
        # windows reach back into (at most `context` per request; stepsplit.DevicePlan).
        self.device_source = host_tensor((2 * max_reqs * context + max_tokens,), "int32", pin=pin)
        self.device_source_np = self.device_source.numpy()
        self.boundaries_np = self.all[1].numpy()
        # A few of the step's prompt tokens as the device has them (the host step's probes).
        self.probes = host_tensor((probes,), "int32", pin=pin)
        self.probes_np = self.probes.numpy()

    def copy_all(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        wait: Callable[[], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One copy of the step's inputs into pinned host memory and one wait for it
        (`wait`, else an event on the current stream)."""
        sources = (input_ids, query_start_loc, ngram_context)
        for held, source in zip(self.all, sources, strict=True):
            if source.shape[0] > held.shape[0]:
                raise ValueError(
                    f"the step has {source.shape[0]} rows of PLE inputs, the host buffers "
                    f"hold {held.shape[0]} (max_num_batched_tokens, max_num_seqs)"
                )
        copies = []
        for held, source in zip(self.all, sources, strict=True):
            target = held[: source.shape[0]]
            target.copy_(source, non_blocking=self.pin)
            copies.append(target)
        self._wait(wait)
        ids, boundaries, context = (copy.numpy() for copy in copies)
        return ids, boundaries, context

    def copy_device(
        self,
        plan: DevicePlan | None,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        wait: Callable[[], None] | None = None,
        probes: tuple[torch.Tensor, list[int]] | None = None,
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """The split step's one copy and one wait: the request boundaries and, with a plan,
        the device's tokens (`input_ids`, the plan's span) and n-gram context straight into
        the source the plan's windows read (its prompt values are written there by the host);
        `probes` (the step's token ids, offsets): those tokens too, as many as the buffer holds.
        Returns numpy views made before the wait: the source (None without a plan), the
        boundaries and the probed tokens."""
        held = self.all[1]
        if query_start_loc.shape[0] > held.shape[0]:
            raise ValueError(
                f"the step has {query_start_loc.shape[0] - 1} requests, the host buffers "
                f"hold {held.shape[0] - 1} (max_num_seqs)"
            )
        copies = [(held[: query_start_loc.shape[0]], query_start_loc)]
        source = None
        if plan is not None:
            if plan.source_size > self.device_source.shape[0]:
                raise ValueError(
                    f"the step's device tokens read {plan.source_size} values, the host "
                    f"buffer holds {self.device_source.shape[0]} (max_num_batched_tokens, "
                    "max_num_seqs)"
                )
            values = self.device_source
            copies.append((values[: plan.span_base].view(ngram_context.shape), ngram_context))
            copies.append((values[plan.span_base : plan.host_base], input_ids))
            source = self.device_source_np[: plan.source_size]
            source[plan.host_base :] = plan.host_values
        offsets: list[int] = []
        if probes is not None:
            token_ids, offsets = probes[0], probes[1][: self.probes.shape[0]]
            for k, offset in enumerate(offsets):
                copies.append((self.probes[k : k + 1], token_ids[offset : offset + 1]))
        for target, values in copies:
            target.copy_(values, non_blocking=self.pin)
        boundaries = self.boundaries_np[: query_start_loc.shape[0]]
        self._wait(wait)
        return source, boundaries, self.probes_np[: len(offsets)]

    def _wait(self, wait: Callable[[], None] | None) -> None:
        if wait is not None:
            wait()
        elif self.pin:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            done.record()
            done.synchronize()
