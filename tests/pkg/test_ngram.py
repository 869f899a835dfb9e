"""Row-id hash: bit-exact against a per-token pure-Python reference (docs/model.md#row-ids)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkple.builder.synth import make_config
from sparkple.geometry import PLEGeometry
from sparkple.runtime.ngram import WindowHash, row_ids, row_ids_torch, window_row_ids

M64 = (1 << 64) - 1
EOS = 5  # a small vocabulary makes EOS frequent in random sequences


def to_i64(v: int) -> int:
    v &= M64
    return v - (1 << 64) if v >> 63 else v


def reference_ids(
    tokens: list[int], context: list[int], g: PLEGeometry, only: list[int] | None = None
) -> list[list[int]]:
    """One request: the row ids of each token (or of tokens `only`), one at a time."""
    seq = list(context) + list(tokens)
    c = g.ngram_size - 1
    out = []
    for p in range(c, len(seq)) if only is None else [c + i for i in only]:
        # e: the last EOS strictly before p, -1 if none
        e = next((q for q in range(p - 1, -1, -1) if seq[q] == g.eos_token_id), -1)
        t = [seq[p - k] if p - k > e else g.eos_token_id for k in range(g.ngram_size)]
        t[0] = seq[p]
        row = []
        x = to_i64(t[0] * g.multipliers[0])
        for order in range(2, g.ngram_size + 1):
            x = to_i64(x ^ to_i64(t[order - 1] * g.multipliers[order - 1]))
            for h in range((order - 2) * g.heads_per_ngram, (order - 1) * g.heads_per_ngram):
                row.append(g.head_offsets[h] + x % g.head_sizes[h])  # Python % is floor mod
        out.append(row)
    return out


REAL = PLEGeometry.from_config(make_config(vocab_base=20_000_000))
SMALL = PLEGeometry.from_config(make_config(vocab_base=1000, eos_token_id=EOS, vocab_size=11))
FOUR = PLEGeometry.from_config(
    make_config(vocab_base=500, ngram_size=4, heads_per_ngram=2, head_dim=32, eos_token_id=EOS)
)
TWO = PLEGeometry.from_config(
    make_config(vocab_base=700, ngram_size=2, heads_per_ngram=3, head_dim=32, eos_token_id=EOS)
)


def batch(requests: list[tuple[list[int], list[int]]]):
    ids = np.array([t for toks, _ in requests for t in toks], dtype=np.int64)
    qsl = np.cumsum([0] + [len(toks) for toks, _ in requests]).astype(np.int64)
    ctx = np.array([c for _, c in requests], dtype=np.int64)
    return ids, qsl, ctx


def test_first_token_of_real_model():
    g = REAL
    ids = row_ids(np.array([1000]), np.array([0, 1]), np.array([[g.eos_token_id] * 2]), g)
    assert ids.tolist() == reference_ids([1000], [g.eos_token_id] * 2, g)
    assert all(
        g.head_offsets[h] <= ids[0, h] < g.head_offsets[h] + g.head_sizes[h] for h in range(16)
    )


token = st.integers(0, 10)
big_token = st.integers(0, 248_319)


@st.composite
def requests(draw, geometry, tok):
    c = geometry.ngram_size - 1
    n = draw(st.integers(1, 5))
    return [
        (draw(st.lists(tok, min_size=0, max_size=12)), draw(st.lists(tok, min_size=c, max_size=c)))
        for _ in range(n)
    ]


@pytest.mark.parametrize("geometry", [SMALL, FOUR, TWO], ids=["trigram", "4gram", "bigram"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_matches_reference_with_eos_inside(geometry, data):
    reqs = data.draw(requests(geometry, token))
    ids, qsl, ctx = batch(reqs)
    got = row_ids(ids, qsl, ctx, geometry)
    want = [r for toks, c in reqs for r in reference_ids(toks, c, geometry)]
    assert got.shape == (len(ids), geometry.num_heads)
    assert got.tolist() == want


@settings(max_examples=60, deadline=None)
@given(reqs=requests(REAL, big_token))
def test_matches_reference_on_real_geometry_and_torch(reqs):
    torch = pytest.importorskip("torch")
    ids, qsl, ctx = batch(reqs)
    got = row_ids(ids, qsl, ctx, REAL)
    assert got.tolist() == [r for toks, c in reqs for r in reference_ids(toks, c, REAL)]
    t = row_ids_torch(torch.from_numpy(ids), torch.from_numpy(qsl), torch.from_numpy(ctx), REAL)
    assert t.dtype == torch.int64 and np.array_equal(t.numpy(), got)


@settings(max_examples=100, deadline=None)
@given(seq=st.lists(token, min_size=1, max_size=30), cuts=st.lists(st.integers(0, 30), max_size=4))
def test_chunked_equals_at_once(seq, cuts):
    g = SMALL
    start_ctx = [EOS, EOS]
    whole = row_ids(np.array(seq), np.array([0, len(seq)]), np.array([start_ctx]), g)
    bounds = sorted({0, len(seq), *[c for c in cuts if c < len(seq)]})
    parts = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        ctx = (start_ctx + seq[:a])[-2:]  # the two tokens before the chunk, oldest first
        parts.append(row_ids(np.array(seq[a:b]), np.array([0, b - a]), np.array([ctx]), g))
    assert np.array_equal(np.concatenate(parts), whole)


@pytest.mark.parametrize("geometry", [SMALL, FOUR, TWO, REAL], ids=["3", "4", "2", "real"])
def test_window_hash_ids_lie_within_its_bounds_and_leave_the_windows_alone(geometry):
    rng = np.random.default_rng(3)
    windows = rng.integers(-(2**62), 2**62, (geometry.ngram_size, 2000))
    windows[rng.random(windows.shape) < 0.2] = geometry.eos_token_id
    before = windows.copy()
    ids = window_row_ids(windows, geometry)
    assert np.array_equal(windows, before)
    low, high = WindowHash.of(geometry).bounds
    assert (low, high) == (min(geometry.head_offsets), geometry.addressed_rows)
    assert low <= ids.min() and ids.max() < high


def test_padding_tokens_continue_the_last_request_and_bad_layouts_fail():
    g = SMALL
    ids = np.array([1, 2, 3, 4, 6], dtype=np.int64)
    got = row_ids(ids, np.array([0, 2, 4]), np.array([[EOS, EOS], [7, 8]]), g)
    assert got[4].tolist() == reference_ids([3, 4, 6], [7, 8], g)[2]
    with pytest.raises(ValueError):
        row_ids(ids, np.array([1, 5]), np.array([[EOS, EOS]]), g)
    with pytest.raises(ValueError):
        row_ids(ids, np.array([0, 5]), np.array([[EOS, EOS, EOS]]), g)
    with pytest.raises(ValueError, match="rise"):
        row_ids(ids, np.array([0, 3, 2]), np.array([[EOS, EOS]] * 2), g)


def test_large_batch_is_vectorised():
    g = REAL
    rng = np.random.default_rng(0)
    t = 65_536
    ids = rng.integers(0, g.vocab_size, size=t)
    ids[rng.integers(0, t, size=100)] = g.eos_token_id
    qsl = np.array([0, 1000, 30_000, t])
    ctx = rng.integers(0, g.vocab_size, size=(3, 2))
    got = row_ids(ids, qsl, ctx, g)
    sample = [0, 999, 1000, 29_999, 30_000, t - 1]
    for r, (a, b) in enumerate(zip(qsl, qsl[1:], strict=False)):
        mine = [i for i in sample if a <= i < b]
        want = reference_ids(ids[a:b].tolist(), ctx[r].tolist(), g, only=[i - a for i in mine])
        assert [got[i].tolist() for i in mine] == want
