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


# The whole tiny model (synth-checkpoint --whole-model): what a real engine loads.


@pytest.fixture(scope="module")
def whole_models(tmp_path_factory):
    from sparkple.builder.synth import synth_whole_model

    work = tmp_path_factory.mktemp("whole")
    return {
        (quant, seed): synth_whole_model(work / f"{quant}-{seed}", quant=quant, seed=seed)
        for quant in ("bf16", "nvfp4", "fp8")
        for seed in (0, 1)
    }


@pytest.mark.parametrize("quant", ["bf16", "nvfp4", "fp8"])
def test_whole_model_holds_every_weight_and_the_table(whole_models, quant):
    from sparkple.builder.synth_whole_layout import WHOLE_MODEL_EOS, whole_model_weights

    snap = Snapshot(whole_models[(quant, 0)])
    cfg = snap.config()
    text = cfg["text_config"]
    # what vLLM's CPU path needs: linear attention only (no QSA), head dims 128, the output
    # gate named, hc_lowrank 12 (no pad rows in vLLM's merged hyper-connection weight)
    assert set(text["layer_types"]) == {"linear_attention"}
    assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128
    assert text["output_gate_type"] == "sigmoid"
    assert (text["hc_lowrank"], text["hc_count"]) == (12, 4)
    assert cfg["eos_token_id"] == text["eos_token_id"] == WHOLE_MODEL_EOS
    assert (
        text.get("ple_embedding_dtype")
        == {
            "bf16": None,
            "nvfp4": "nvfp4",
            "fp8": "float8_e4m3fn",
        }[quant]
    )
    weights = whole_model_weights(cfg)
    for name, shape, _ in weights:
        tensor = snap.tensor(name)
        assert (tensor.dtype, tensor.shape) == ("BF16", shape), name
    g = PLEGeometry.from_config(cfg)
    assert g.head_dim == 160 and g.decoder_layer == 1
    rows = snap.tensor(f"{EMB}.shard_0.weight")
    assert rows.shape == (g.rows_per_shard, {"bf16": 160, "nvfp4": 80, "fp8": 160}[quant])
    assert rows.dtype == {"bf16": "BF16", "nvfp4": "U8", "fp8": "F8_E4M3"}[quant]
    ple = [n for n in snap.weight_map if ".ple_embedding." in n]
    assert len(snap.weight_map) == len(weights) + len(ple)
    # a few MB, with a byte-level tokenizer
    size = sum(p.stat().st_size for p in snap.dir.glob("*.safetensors"))
    assert size < 16 * 2**20
    assert (snap.dir / "tokenizer.json").is_file()


def test_whole_model_seeds_draw_other_weights_and_rows_under_one_global_scale(whole_models):
    """Another seed: other weights and other PLE rows, the same global scale and hash (a table
    built from it passes the packed table's load checks: only its rows are wrong)."""
    for quant, scale in (("nvfp4", "weight_scale_2"), ("fp8", "weight_scale")):
        a, b = (Snapshot(whole_models[(quant, seed)]) for seed in (0, 1))
        name = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"
        assert a.tensor(name).read().tobytes() != b.tensor(name).read().tobytes()
        rows = f"{EMB}.shard_1.weight"
        assert a.tensor(rows).read().tobytes() != b.tensor(rows).read().tobytes()
        assert a.tensor(f"{EMB}.{scale}").read() == b.tensor(f"{EMB}.{scale}").read()
        mod = EMB.rsplit(".", 1)[0]
        for buffer in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            assert a.tensor(f"{mod}.{buffer}").read().tolist() == (
                b.tensor(f"{mod}.{buffer}").read().tolist()
            )


def test_whole_model_same_seed_same_bytes(whole_models, tmp_path):
    from sparkple.builder.synth import synth_whole_model

    again = synth_whole_model(tmp_path / "again", quant="nvfp4", seed=0)
    for f in sorted(again.glob("*.safetensors")):
        assert f.read_bytes() == (whole_models[("nvfp4", 0)] / f.name).read_bytes()


def test_cli_writes_a_whole_model(tmp_path):
    res = run_cli("synth-checkpoint", tmp_path / "w", "--whole-model", "--quant", "fp8")
    assert res.returncode == 0, res.stderr
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    assert cfg["text_config"]["ple_embedding_dtype"] == "float8_e4m3fn"
    assert "vision_config" in cfg
    assert run_cli("synth-checkpoint", tmp_path / "b", "--whole-model").returncode == 0
    assert (
        "ple_embedding_dtype"
        not in json.loads((tmp_path / "b" / "config.json").read_text())["text_config"]
    )
    # a BF16 table only for a whole model (the PLE-only snapshot's readers take NVFP4 and FP8)
    res = run_cli("synth-checkpoint", tmp_path / "c", "--quant", "bf16")
    assert res.returncode == 2 and "--whole-model" in res.stderr


@pytest.mark.slow
def test_whole_model_weights_are_transformers_own(whole_models, tmp_path):
    """The names and shapes written as code (whole_model_weights) against transformers' own
    Qwen4ExpForConditionalGeneration of the same config, in the vLLM test venv: the checkpoint
    it saves holds exactly the snapshot's tensors, and it loads the snapshot with no missing,
    unexpected or mismatched key."""
    from harness import engine

    report = engine.check_model(whole_models[("bf16", 0)], tmp_path)
    assert report["snapshot"] == report["transformers_saves"]
    assert report["loading_info"] == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
