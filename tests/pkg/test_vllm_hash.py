"""Cross-check with vLLM 0.33.0 itself: its hash and layout code, read from the PyPI wheel.

The wheel is fetched once with `pip download --no-deps` into the git-ignored .cache/; the
methods of vLLM's Qwen4ExpNGramEmbedding that compute the layout and the row ids are compiled
from its source and run on CPU next to ours. Skipped when the wheel cannot be had.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from sparkple.geometry import PLEGeometry
from sparkple.ngram import row_ids
from sparkple.synth import make_config

from .conftest import ROOT

torch = pytest.importorskip("torch")

WHEEL_GLOB = "vllm-0.33.0-*.whl"
SOURCE = "vllm/models/qwen4_exp/nvidia/ngram_embedding.py"
METHODS = {
    "_splitmix64",
    "_is_prime_64",
    "_nth_prime_after",
    "_make_layer_multipliers",
    "_make_vocab_layout",
    "_shift_precompute",
    "_shift_apply",
    "compute_ngram_ids",
}


def find_wheel() -> Path | None:
    cache = ROOT / ".cache"
    found = sorted(cache.rglob(WHEEL_GLOB)) if cache.exists() else []
    if found:
        return found[0]
    dest = cache / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "vllm==0.33.0", "-d", str(dest)],
        capture_output=True,
        timeout=600,
    )
    found = sorted(dest.glob(WHEEL_GLOB))
    return found[0] if res.returncode == 0 and found else None


@pytest.fixture(scope="module")
def vllm_hash():
    wheel = find_wheel()
    if wheel is None:
        pytest.skip("the vllm==0.33.0 wheel is not available (no PyPI access?)")
    source = zipfile.ZipFile(wheel).read(SOURCE).decode()
    tree = ast.parse(source)
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen4ExpNGramEmbedding"
    )
    body = [
        n
        for n in cls.body
        if isinstance(n, ast.Assign) or (isinstance(n, ast.FunctionDef) and n.name in METHODS)
    ]
    assert {n.name for n in body if isinstance(n, ast.FunctionDef)} == METHODS
    module = ast.Module(
        body=[ast.ClassDef(name="VllmHash", bases=[], keywords=[], body=body, decorator_list=[])],
        type_ignores=[],
    )
    ast.fix_missing_locations(module)
    namespace = {"torch": torch, "ple_ngram_ids": None}
    exec(compile(module, f"{wheel.name}/{SOURCE}", "exec"), namespace)
    return namespace["VllmHash"]


def vllm_instance(cls, g: PLEGeometry):
    obj = cls.__new__(cls)
    obj.ngram_size, obj.heads_per_ngram, obj.eos_token_id = (
        g.ngram_size,
        g.heads_per_ngram,
        g.eos_token_id,
    )
    obj.layer_multipliers = torch.tensor(g.multipliers, dtype=torch.long)
    obj.ngram_heads_vocab_sizes = torch.tensor(g.head_sizes, dtype=torch.long)
    obj.ngram_heads_offsets = torch.tensor(g.head_offsets, dtype=torch.long)
    return obj


CONFIGS = {
    "real": make_config(vocab_base=20_000_000),
    "small": make_config(vocab_base=1000, eos_token_id=5, vocab_size=11, hash_seed=7),
    "4gram": make_config(vocab_base=300, ngram_size=4, heads_per_ngram=2, head_dim=32),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("layer", [0, 1])
def test_layout_and_multipliers_match_vllm(vllm_hash, name, layer):
    cfg = CONFIGS[name]
    g = PLEGeometry.from_config(cfg, ple_layer=layer)
    t = cfg["text_config"]
    heads = (t["ngram_size"] - 1) * t["heads_per_ngram"]
    assert list(g.multipliers) == vllm_hash._make_layer_multipliers(
        ngram_size=t["ngram_size"],
        unigram_vocab_size=t["vocab_size"],
        seed=t["seed"],
        ple_dense_layer_id=layer,
    )
    sizes, offsets, total = vllm_hash._make_vocab_layout(
        ngram_vocab_size_base=t["ngram_vocab_size_base"],
        ngram_heads=heads,
        ple_dense_layer_id=layer,
    )
    assert (list(g.head_sizes), list(g.head_offsets), g.addressed_rows) == (sizes, offsets, total)


@pytest.mark.parametrize("name", CONFIGS)
def test_row_ids_match_vllm_compute_ngram_ids(vllm_hash, name):
    g = PLEGeometry.from_config(CONFIGS[name])
    obj = vllm_instance(vllm_hash, g)
    rng = np.random.default_rng(11)
    c = g.ngram_size - 1
    for _ in range(30):
        reqs = int(rng.integers(1, 6))
        lengths = rng.integers(0, 40, size=reqs)
        total = int(lengths.sum())
        pad = int(rng.integers(0, 3))  # tokens past query_start_loc[-1], as CUDA graphs pad
        ids = rng.integers(
            0, min(g.vocab_size, 12 if name == "small" else g.vocab_size), size=total + pad
        )
        ids[rng.random(total + pad) < 0.1] = g.eos_token_id
        qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ctx = rng.integers(0, g.vocab_size, size=(reqs, c))
        ctx[rng.random((reqs, c)) < 0.3] = g.eos_token_id
        if total + pad == 0:
            continue
        ours = row_ids(ids, qsl, ctx, g)
        theirs = obj.compute_ngram_ids(
            torch.from_numpy(ids), torch.from_numpy(qsl), torch.from_numpy(ctx)
        ).numpy()
        assert np.array_equal(ours, theirs)
