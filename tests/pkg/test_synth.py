"""Synthetic snapshots have the real layout and meaningful values."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from sparkple.builder.plan import plan_build
from sparkple.builder.safetensors_io import Snapshot
from sparkple.geometry import PLEGeometry
from sparkple.runtime.nvfp4 import dequantize_fp8_rows, dequantize_rows

from .conftest import run_cli

EMB = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"


def test_layout_names_and_config(snapshots):
    snap = Snapshot(snapshots("nvfp4", files=3))
    cfg = snap.config()["text_config"]
    for key in (
        "ngram_vocab_size_base",
        "eos_token_id",
        "vocab_size",
        "ngram_size",
        "seed",
        "heads_per_ngram",
        "ple_embed_dim",
        "ple_layer_ids",
    ):
        assert key in cfg
    assert cfg["split_ngram_parts"] == 128 and cfg["make_ngram_vocab_size_divisible_by"] == 128
    assert cfg["ple_layer_ids"] == [2] and isinstance(cfg["eos_token_id"], int)
    g = PLEGeometry.from_config(snap.config())
    assert snap.tensor(f"{EMB}.shard_0.weight").shape == (g.rows_per_shard, 80)
    assert snap.tensor(f"{EMB}.shard_127.weight_scale").dtype == "F8_E4M3"
    assert snap.tensor(f"{EMB}.weight_scale_2").dtype == "F32"
    mod = EMB.rsplit(".", 1)[0]
    assert snap.tensor(f"{mod}.layer_multipliers").read().tolist() == list(g.multipliers)
    assert snap.tensor(f"{mod}.ngram_heads_vocab_sizes").read().tolist() == list(g.head_sizes)
    # the index is in lexical order and the files hold different numbers of tensors
    keys = list(snap.weight_map)
    assert keys == sorted(keys)
    counts = Counter(snap.weight_map.values())
    assert len(counts) == 3 and len(set(counts.values())) == 3
    # lexical order splits numerically adjacent shards across files
    files_of_first = {snap.weight_map[f"{EMB}.shard_{i}.weight"] for i in range(12)}
    assert len(files_of_first) > 1


def test_values_decode_to_quantized_gaussians(snapshots):
    plan = plan_build(snapshots("nvfp4", files=3))
    shard = plan.shards[5]
    assert shard.scales is not None
    packed = np.concatenate([shard.codes.memmap(), shard.scales.memmap()], axis=1)
    values = dequantize_rows(packed, plan.global_scale)
    assert np.isfinite(values).all() and values.std() > 0
    assert np.abs(values).max() <= 6 * 448 * plan.global_scale * 1.0001
    assert len({r.tobytes() for r in packed}) == len(packed)  # rows differ
    fp8 = plan_build(snapshots("fp8", quant="fp8", files=2, vocab_base=700))
    rows = fp8.shards[0].codes.memmap()
    assert np.isfinite(dequantize_fp8_rows(rows, fp8.global_scale)).all()


def test_cli_writes_a_snapshot(tmp_path):
    res = run_cli(
        "synth-checkpoint",
        tmp_path / "s",
        "--quant",
        "fp8",
        "--vocab-base",
        "300",
        "--files",
        "2",
        "--seed",
        "3",
    )
    assert res.returncode == 0, res.stderr
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    assert run_cli("synth-checkpoint", tmp_path / "t", "--files", "0").returncode == 2


def test_same_seed_same_bytes(tmp_path):
    from sparkple.builder.synth import synth_checkpoint

    a = synth_checkpoint(tmp_path / "a", vocab_base=200, files=2, seed=4)
    b = synth_checkpoint(tmp_path / "b", vocab_base=200, files=2, seed=4)
    for f in sorted(a.glob("*.safetensors")):
        assert f.read_bytes() == (b / f.name).read_bytes()


@pytest.mark.parametrize("quant", ["nvfp4", "fp8"])
def test_table_gib_option_sizes_the_table(quant):
    from sparkple.builder.synth import vocab_base_for_bytes

    width = 90 if quant == "nvfp4" else 160
    base = vocab_base_for_bytes(2 * 2**30, width)
    assert abs(base * 16 * width / 2**30 - 2) < 0.01


def test_the_synthetic_checkpoint_carries_a_byte_level_tokenizer(tmp_path) -> None:
    """vLLM's serving benchmark loads a tokenizer from the model directory: the synthetic
    checkpoint has one token per byte (256 distinct printable symbols) and an end-of-text
    token, all below the smallest synthetic vocabulary."""
    import json

    from sparkple.builder.synth import synth_checkpoint
    from sparkple.builder.tokenizer import BYTES, EOS, byte_symbols

    snap = synth_checkpoint(tmp_path / "snap", vocab_base=300, files=1)
    tok = json.loads((snap / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert len(vocab) == BYTES == len(set(byte_symbols()))
    assert all(s.isprintable() and not s.isspace() for s in vocab)
    assert sorted(vocab.values()) == list(range(BYTES)) and tok["model"]["merges"] == []
    assert tok["added_tokens"][0]["id"] == BYTES and tok["added_tokens"][0]["content"] == EOS
    config = json.loads((snap / "tokenizer_config.json").read_text())
    assert config["eos_token"] == EOS and config["tokenizer_class"] == "PreTrainedTokenizerFast"
