"""The V2 runner's side of a step with vLLM's own classes (the Runner), and the schedule of
steps every PLE check runs: chunked prefill, decode, MTP drafts and their rejection, a removed
and a re-added request, one request whole and in chunks."""

from __future__ import annotations

import numpy as np
import torch

from harness.ple_layer import DEVICE, MAX_MODEL_LEN, request_states


class Runner:
    """The V2 runner's side of a step, reduced to what the PLE inputs are built from, with
    vLLM's own classes: RequestState (each request's slot and tokens, how many are computed),
    NewRequestData handed to the model state's add_request, and the InputBatch of each step.

    Tokens of a request past its prompt are what the sampler produced (a decode token, or
    MTP drafts): the runner writes them into the step's input ids as vLLM's
    combine_sampled_and_draft_tokens does, and into all_token_ids once accepted.
    """

    def __init__(self, state, max_model_len: int = MAX_MODEL_LEN) -> None:
        self.state = state
        self.requests = request_states(max_model_len)
        self.tokens: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(11)

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return self.requests.req_id_to_index

    def add(self, req_id: str, tokens: np.ndarray, prompt_len: int | None = None) -> None:
        """A new request (the runner's add_requests): its prompt is tokens[:prompt_len]; the
        rest are the tokens it will generate."""
        from vllm.v1.core.sched.output import NewRequestData

        prompt_len = len(tokens) if prompt_len is None else prompt_len
        prompt = [int(t) for t in tokens[:prompt_len]]
        self.remove(req_id)
        self.requests.add_request(req_id, prompt_len, prompt, 0, max_tokens=len(tokens))
        index = self.requests.req_id_to_index[req_id]
        # apply_staged_writes runs a Triton kernel, which vLLM disables without a GPU driver:
        # the staged values are written as it would write them
        self.requests.all_token_ids.gpu[index].zero_()
        self.requests.all_token_ids.gpu[index, :prompt_len] = torch.as_tensor(prompt)
        self.requests.num_computed_tokens.gpu[index] = 0
        for staged in (self.requests.all_token_ids, self.requests.num_computed_tokens):
            staged.clear_staged_writes()
        self.tokens[req_id] = np.asarray(tokens, dtype=np.int64).copy()
        self.state.add_request(
            index,
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=prompt,
                mm_features=[],
                sampling_params=None,
                pooling_params=None,
                block_ids=([],),
                num_computed_tokens=0,
                lora_request=None,
                prefill_token_ids=prompt,
            ),
        )

    def remove(self, req_id: str) -> None:
        """The runner's _remove_request: the model state first, then the request state."""
        if req_id in self.requests.req_id_to_index:
            self.state.remove_request(req_id)
            self.requests.remove_request(req_id)

    def rewrite(self, req_id: str, start: int, tokens: np.ndarray) -> None:
        """Later tokens replaced, as when speculated tokens are rejected and resampled."""
        self.tokens[req_id][start : start + len(tokens)] = tokens

    def step(
        self,
        scheduled,
        *,
        pad_tokens: int = 0,
        pad_reqs: int = 0,
        dummy: bool = False,
        drafts: dict[str, int] | None = None,
        host_shift: dict[str, int] | None = None,
        device_counts: dict[str, int] | None = None,
    ):
        """scheduled: (request id, tokens computed before, tokens this step) per request;
        drafts: how many of a request's tokens are MTP drafts (the last ones).
        Faults of the host's view, the device's inputs as scheduled: host_shift adds to a
        request's computed-prefill count on the host (bookkeeping off by that many tokens);
        device_counts gives a request fewer tokens on the device than the host scheduled
        (the device moved the boundaries: adaptive draft verification), the rest padding.

        Returns (input_ids, query_start_loc, ngram_context, number of real tokens) as the
        model's forward receives them; padding tokens and requests are added as CUDA-graph
        padding adds them.
        """
        from vllm.v1.worker.gpu.input_batch import InputBatch

        reqs = self.requests
        indices: list[int] = []
        lengths: list[int] = []
        chunks: list[torch.Tensor] = []
        for req_id, computed, count in scheduled:
            index = reqs.req_id_to_index.get(req_id, len(indices))
            indices.append(index)
            lengths.append(count)
            if req_id in self.tokens:
                tokens = self.tokens[req_id]
                prompt_len = int(reqs.prefill_len.np[index])
                # what the sampler accepted so far is in all_token_ids past the prompt
                accepted = tokens[prompt_len:computed]
                reqs.all_token_ids.gpu[index, prompt_len:computed] = torch.as_tensor(accepted)
                reqs.num_computed_tokens.gpu[index] = computed
                reqs.num_computed_tokens_np[index] = computed
                on_device = (device_counts or {}).get(req_id, count)
                chunks.append(torch.as_tensor(tokens[computed : computed + on_device]))
            else:
                chunks.append(torch.zeros(count, dtype=torch.int64))
        # what the runner's update_requests derives on the host
        np.minimum(
            reqs.num_computed_tokens_np, reqs.prefill_len.np, out=reqs.num_computed_prefill_tokens
        )
        num_reqs = len(scheduled)
        num_real = sum(lengths)
        moved = num_real - sum(len(chunk) for chunk in chunks)  # tokens the device has fewer
        garbage = torch.as_tensor(self.rng.integers(0, 1000, size=pad_tokens + moved))
        input_ids = torch.cat([*chunks, garbage]).to(torch.int32).to(DEVICE)
        starts = np.concatenate([[0], np.cumsum(lengths), [num_real] * pad_reqs]).astype(np.int32)
        device_lengths = [len(chunk) for chunk in chunks]
        device_starts = np.concatenate(
            [[0], np.cumsum(device_lengths), [num_real - moved] * pad_reqs]
        ).astype(np.int32)
        idx_np = np.asarray(indices, dtype=np.intp)
        prefill_len_np = reqs.prefill_len.np[idx_np].copy()
        computed_prefill = reqs.num_computed_prefill_tokens[idx_np].copy()
        for position, (req_id, _, _) in enumerate(scheduled):
            computed_prefill[position] += (host_shift or {}).get(req_id, 0)
        is_prefilling = computed_prefill < prefill_len_np
        draft_counts = None
        if drafts is not None:
            draft_counts = np.asarray(
                [drafts.get(req_id, 0) for req_id, _, _ in scheduled], dtype=np.int32
            )
        idx_mapping = torch.as_tensor(idx_np, dtype=torch.int64, device=DEVICE)
        qsl = torch.as_tensor(device_starts, device=DEVICE)
        batch = InputBatch(
            req_ids=[
                f"dummy-{i}" if dummy else req_id for i, (req_id, _, _) in enumerate(scheduled)
            ],
            num_reqs=num_reqs,
            num_reqs_after_padding=num_reqs + pad_reqs,
            idx_mapping=idx_mapping,
            idx_mapping_np=idx_np,
            expanded_idx_mapping=idx_mapping,
            expanded_local_pos=torch.zeros(num_reqs, dtype=torch.int32, device=DEVICE),
            num_scheduled_tokens=np.asarray(lengths, dtype=np.int32),
            num_tokens=num_real,
            num_tokens_after_padding=num_real + pad_tokens,
            num_draft_tokens=0 if draft_counts is None else int(draft_counts.sum()),
            num_draft_tokens_per_req=draft_counts,
            query_start_loc=qsl,
            query_start_loc_np=starts,
            seq_lens=torch.zeros(num_reqs + pad_reqs, dtype=torch.int32, device=DEVICE),
            seq_lens_cpu_upper_bound=torch.zeros(num_reqs + pad_reqs, dtype=torch.int32),
            dcp_local_seq_lens=None,
            num_computed_tokens_np=reqs.num_computed_tokens_np[idx_np].copy(),
            prefill_len_np=prefill_len_np,
            num_computed_prefill_tokens_np=computed_prefill,
            is_prefilling_np=is_prefilling,
            has_prefill=bool(is_prefilling.any()),
            decode_graph_eligible=not bool(is_prefilling.any()),
            input_ids=input_ids,
            positions=torch.zeros(num_real + pad_tokens, dtype=torch.int64, device=DEVICE),
            is_padding=torch.zeros(num_real + pad_tokens, dtype=torch.bool, device=DEVICE),
            logits_indices=torch.zeros(num_reqs, dtype=torch.int64, device=DEVICE),
            cu_num_logits=torch.arange(num_reqs + 1, dtype=torch.int32, device=DEVICE),
            cu_num_logits_np=np.arange(num_reqs + 1, dtype=np.int32),
            has_structured_output_reqs=False,
            prompt_lens=None,
        )
        inputs = self.state.prepare_inputs(batch, reqs)
        return input_ids, inputs["query_start_loc"], inputs["ngram_context"], num_real - moved


def request_tokens(vocab: int, eos: int, seed: int, length: int = 300) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=length)
    tokens[rng.random(length) < 0.05] = eos
    tokens[[40, 41, 128]] = eos  # back-to-back EOS and one at a chunk boundary
    return tokens


def schedule(runner: Runner, vocab: int, eos: int):
    """The steps every layer sees: mixed chunked prefill and decode with padding, speculative
    verification with a rejection, steps mixing prompt chunks, decode tokens and MTP drafts, a
    prompt removed before its later chunks and its id re-added with another prompt, a prompt
    far longer than the lookahead window, one request whole, and the same request in chunks.

    Prompt lengths: r0 110, r1 256, r2 7, r3 30 (the tokens after them are decode tokens).
    """
    for r, prompt_len in enumerate((110, 256, 7, 30)):
        runner.add(f"r{r}", request_tokens(vocab, eos, seed=10 + r), prompt_len)
    yield (
        "mixed prefill",
        [("r0", 0, 50), ("r1", 0, 128), ("r2", 0, 7)],
        {"pad_tokens": 5, "pad_reqs": 1},
    )
    yield "chunk and decode", [("r1", 128, 128), ("r0", 50, 60), ("r2", 7, 1), ("r3", 0, 30)], {}
    yield (
        "uniform decode",
        [("r0", 110, 1), ("r1", 256, 1), ("r2", 8, 1), ("r3", 30, 1)],
        {"pad_tokens": 4, "pad_reqs": 4},
    )
    yield "verify drafts", [("r0", 111, 4), ("r1", 257, 4)], {"drafts": {"r0": 3, "r1": 3}}
    # two of r0's three drafts were rejected: the tokens after the accepted one change
    runner.rewrite("r0", 113, np.random.default_rng(30).integers(0, vocab, size=20))
    yield (
        "after rejection",
        [("r0", 113, 4), ("r1", 261, 4)],
        {"pad_tokens": 8, "drafts": {"r0": 3, "r1": 3}},
    )
    # a long prompt (r4, 600 tokens: many lookahead windows) in chunks, beside decoding
    # requests with MTP drafts and a prompt (r5) that is removed after its first chunk
    runner.add("r5", request_tokens(vocab, eos, seed=50), 300)
    runner.add("r4", request_tokens(vocab, eos, seed=40, length=700), 600)
    yield (
        "prompt, decode and drafts",
        [("r0", 117, 4), ("r2", 9, 1), ("r4", 0, 100), ("r5", 0, 64)],
        {"pad_tokens": 3, "drafts": {"r0": 3}},
    )
    runner.remove("r5")
    yield (
        "after a removed prompt",
        [("r0", 121, 4), ("r3", 31, 4), ("r4", 100, 150)],
        {"drafts": {"r0": 3, "r3": 3}},
    )
    # the same request id again, with another prompt (vLLM's streaming input update)
    runner.add("r5", request_tokens(vocab, eos, seed=51), 200)
    yield "re-added prompt", [("r5", 0, 64), ("r4", 250, 150), ("r2", 10, 1)], {}
    yield "prompt tail and decode", [("r4", 400, 200), ("r5", 64, 136), ("r3", 35, 1)], {}
    yield "long prompt decodes", [("r4", 600, 4), ("r5", 200, 1)], {"drafts": {"r4": 3}}
    whole = request_tokens(vocab, eos, seed=20)
    runner.add("whole", whole)
    runner.add("chunked", whole, 256)
    yield "whole", [("whole", 0, len(whole))], {}
    position = 0
    for size in [128, 128] + [1] * (len(whole) - 256):
        yield "chunked", [("chunked", position, size)], {}
        position += size
