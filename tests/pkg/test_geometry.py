"""PLE geometry reproduces the real model's layout (docs/model.md#geometry) from its config keys."""

import pytest

from sparkple.builder.synth import make_config
from sparkple.errors import CheckpointError
from sparkple.geometry import PLEGeometry, RowFormat, is_prime, primes_above, splitmix64

REAL_SIZES = (
    20000003,
    20000023,
    20000033,
    20000047,
    20000059,
    20000063,
    20000069,
    20000077,
    20000081,
    20000093,
    20000107,
    20000147,
    20000153,
    20000159,
    20000161,
    20000171,
)


def real_geometry() -> PLEGeometry:
    return PLEGeometry.from_config(make_config(vocab_base=20_000_000))


def test_real_model_geometry_matches_facts():
    g = real_geometry()
    assert g.num_heads == 16 and g.head_dim == 160 and g.ngram_size == 3
    assert g.head_sizes == REAL_SIZES
    assert g.head_offsets[:3] == (0, 20000003, 40000026)
    assert g.addressed_rows == 320_001_446
    assert g.total_rows == 320_001_536
    assert g.shards == 128 and g.rows_per_shard == 2_500_012
    assert g.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert g.eos_token_id == 248_044 and g.vocab_size == 248_320
    assert g.decoder_layer == 1


def test_primes_and_splitmix():
    assert primes_above(20_000_000, 16) == list(REAL_SIZES)
    assert primes_above(2, 5) == [2, 3, 5, 7, 11]
    assert [n for n in range(50) if is_prime(n)] == [
        2,
        3,
        5,
        7,
        11,
        13,
        17,
        19,
        23,
        29,
        31,
        37,
        41,
        43,
        47,
    ]
    # splitmix64 of 0: the published first output of the generator seeded with 0
    assert splitmix64(0) == 0xE220A8397B1DCDAF


def test_uneven_shards_and_padding():
    cfg = make_config(vocab_base=1000, shards=7, divisible_by=64)
    g = PLEGeometry.from_config(cfg)
    assert g.total_rows % 64 == 0 and g.total_rows >= g.addressed_rows > g.total_rows - 64
    assert g.rows_per_shard == -(-g.total_rows // 7)
    assert sum(g.shard_rows(i) for i in range(7)) == g.total_rows
    assert g.shard_rows(6) < g.rows_per_shard


def test_stored_values_win():
    g = PLEGeometry.from_config(make_config(vocab_base=1000), stored_multipliers=[3, 5, 7])
    assert g.multipliers == (3, 5, 7)


def test_second_ple_layer_uses_later_primes_and_other_multipliers():
    cfg = make_config(vocab_base=1000)
    g0 = PLEGeometry.from_config(cfg)
    g1 = PLEGeometry.from_config(cfg, ple_layer=1)
    assert g1.head_sizes[0] > g0.head_sizes[-1]
    assert g1.multipliers != g0.multipliers


@pytest.mark.parametrize(
    "key,value",
    [("eos_token_id", [1, 2]), ("ngram_size", None), ("ple_embed_dim", 2561), ("vocab_size", "x")],
)
def test_bad_config_is_refused(key, value):
    cfg = make_config()
    if value is None:
        del cfg["text_config"][key]
    else:
        cfg["text_config"][key] = value
    with pytest.raises(CheckpointError, match=key if key != "ple_embed_dim" else "divisible"):
        PLEGeometry.from_config(cfg)


def test_row_formats():
    assert RowFormat.for_quant("nvfp4", 160) == RowFormat("nvfp4", 80, 10, 90)
    assert RowFormat.for_quant("fp8", 160) == RowFormat("fp8", 160, 0, 160)
    with pytest.raises(CheckpointError):
        RowFormat.for_quant("int4", 160)
