"""vLLM's own engine generating tokens through sparkple's patch, on this CPU (conftest.py):
unpatched vLLM against transformers, the patched tree against unpatched vLLM, both under
several requests at once, chunked prefill, an early finish and a prefix-cache hit, and a table
of another checkpoint caught by the same comparison."""

from __future__ import annotations

import pytest

from .conftest import (
    BUDGET,
    FAULT,
    MARGIN,
    PAIR,
    PROMPTS,
    WORKLOAD,
    Result,
    assert_same_tokens,
    first_difference,
    logprob_difference,
    smallest_margin,
)

pytestmark = pytest.mark.slow

# transformers and vLLM compute in BF16 with different kernels and operation orders (vLLM's
# fused MoE, GatedDeltaNet and PLE kernels): their first-step logprobs differ by rounding, seen
# up to 0.04 (logits of 4..8 move in steps of 1/32); the tolerance is 0.08.
TRANSFORMERS_TOLERANCE = 0.08
STOCK = "Qwen4ExpPLEDeviceEmbedding"
PACKED = "Qwen4ExpPLEPackedTableEmbedding"


def requests(batches: list[list[dict[str, object]]]) -> list[str]:
    return [str(r["id"]) for batch in batches for r in batch]


def assert_clear_reference(reference: Result) -> None:
    """Every step of transformers' greedy path is clear of a BF16 tie (conftest.MARGIN): else
    the prompts (PROMPT_SEEDS) no longer suit the model and must be searched again."""
    for rid, output in reference.runs["bf16"]["outputs"].items():
        margin, step = smallest_margin(output["logprobs"])
        assert margin >= MARGIN, f"{rid}: transformers' top two differ by {margin} at step {step}"


def test_unpatched_vllm_generates_transformers_tokens(unpatched: Result, reference: Result) -> None:
    """The BF16 model: vLLM's greedy tokens are transformers', 2 prompts x 16 tokens, and the
    first step's top-3 logprobs agree within TRANSFORMERS_TOLERANCE."""
    assert reference.extra["loading_info"] == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    assert_clear_reference(reference)
    run = unpatched.runs["bf16"]
    assert STOCK in run["backends"]
    expected = reference.runs["bf16"]["outputs"]
    for rid in requests(PAIR):
        assert len(run["outputs"][rid]["tokens"]) == 16
        assert_same_tokens(rid, expected[rid]["tokens"], run["outputs"][rid]["tokens"])
        difference = logprob_difference(
            expected[rid]["logprobs"][0], run["outputs"][rid]["logprobs"][0]
        )
        assert difference <= TRANSFORMERS_TOLERANCE, (rid, difference)


@pytest.mark.parametrize("quant", ["nvfp4", "fp8"])
def test_patched_vllm_equals_unpatched(unpatched: Result, patched: Result, quant: str) -> None:
    """The packed table read from disk through the rendered vllm-0.34 profile gives vLLM's own
    tokens and top-3 logprobs, bit for bit, on every request the model ran."""
    stock, packed = unpatched.runs[quant], patched.runs[quant]
    assert STOCK in stock["backends"] and PACKED not in stock["backends"]
    assert PACKED in packed["backends"] and STOCK not in packed["backends"]
    assert packed["counters"]["rows_gathered"] > 0
    assert stock["outputs"].keys() == packed["outputs"].keys()
    for rid, want in stock["outputs"].items():
        got = packed["outputs"][rid]
        assert_same_tokens(f"{quant} {rid}", want["tokens"], got["tokens"])
        assert got["logprobs"] == want["logprobs"], (quant, rid)


def test_scheduling_several_requests_chunked_prefill_and_prefix_cache(
    unpatched: Result, patched: Result, reference: Result
) -> None:
    """WORKLOAD: four requests at once, prefilled in chunks of BUDGET tokens, one finishing
    after 3 tokens while the others go on, then a prompt that starts with another's, served
    partly from the prefix cache. Unpatched vLLM's tokens are transformers' (each request
    alone) on every request; the patched engine's equal unpatched vLLM's
    (test_patched_vllm_equals_unpatched)."""
    assert_clear_reference(reference)
    expected = reference.runs["bf16"]["outputs"]
    for run in (unpatched.runs["bf16"], unpatched.runs["nvfp4"], patched.runs["nvfp4"]):
        config = run["config"]
        assert config["enable_chunked_prefill"] and config["max_num_batched_tokens"] == BUDGET
        assert len(PROMPTS["long"]) > BUDGET  # its prefill took several steps
        assert config["enable_prefix_caching"]
        outputs = run["outputs"]
        assert set(outputs) == set(requests(WORKLOAD))
        assert len(outputs["short"]["tokens"]) == 3 and len(outputs["p0"]["tokens"]) == 16
        # the prefix cache served the 32 tokens (two blocks) the prompts share
        assert outputs["long-again"]["num_cached_tokens"] == 32
        assert all(outputs[r]["num_cached_tokens"] == 0 for r in requests(WORKLOAD[:1]))
    for rid in requests(WORKLOAD):
        assert_same_tokens(
            rid, expected[rid]["tokens"], unpatched.runs["bf16"]["outputs"][rid]["tokens"]
        )


def test_async_scheduling_is_off_on_the_cpu(unpatched: Result) -> None:
    """vLLM's CPU platform turns async scheduling off whatever is asked
    (platforms/cpu.py: "async scheduling is not required on CPU"), without an error: the
    engines here run synchronously."""
    assert unpatched.extra["async_scheduling"] == {"resolved": False, "error": None}
    assert not any(run["config"]["async_scheduling"] for run in unpatched.runs.values())


def test_a_table_of_another_checkpoint_changes_the_tokens(
    unpatched: Result, patched: Result
) -> None:
    """A planted fault: the packed table built from another checkpoint (seed 1) behind the
    NVFP4 model. The comparison that passes for the right table fails, naming the request and
    the first differing position."""
    stock, foreign = unpatched.runs["nvfp4"], patched.runs["foreign"]
    assert PACKED in foreign["backends"] and foreign["counters"]["rows_gathered"] > 0
    for rid in requests(FAULT):
        got = foreign["outputs"][rid]["tokens"]
        want = stock["outputs"][rid]["tokens"][: len(got)]
        position = first_difference(want, got)
        assert position is not None, f"{rid}: the foreign table gave the same tokens"
        with pytest.raises(
            AssertionError, match=rf"^{rid}: tokens differ first at position {position}:"
        ):
            assert_same_tokens(rid, want, got)
