"""Row ids of the PLE table for a batch of tokens, bit-exact with vLLM's hash.

For a token t0 with predecessors t1..t(n-1) (EOS at the start of a request, and never reaching
back across an EOS), order g mixes x_g = XOR_{k<g} t_k * m_k in wrapping int64; head h of order
g reads row offset[h] + floor_mod(x_g, size[h]). Arguments follow vLLM's compute_ngram_ids:
`query_start_loc` splits `input_ids` into requests and `ngram_context[r]` holds the
ngram_size - 1 tokens before request r's chunk, oldest first, so chunks hash like one pass.
Tokens past query_start_loc[-1] (padding) continue the last request, as in vLLM.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from ..geometry import PLEGeometry

if TYPE_CHECKING:
    import torch


def _check_layout(
    num_tokens: int, qsl: list[int], ctx_shape: tuple[int, ...], context: int
) -> None:
    """Refuse a request layout the hash would silently misread."""
    num_reqs = len(qsl) - 1
    if num_reqs < 1:
        raise ValueError("query_start_loc needs at least two entries (one request)")
    if (
        qsl[0] != 0
        or qsl[-1] > num_tokens
        or any(b < a for a, b in zip(qsl, qsl[1:], strict=False))
    ):
        raise ValueError(
            f"query_start_loc must rise from 0 to at most {num_tokens} tokens, got {qsl[:8]}..."
        )
    if len(ctx_shape) != 2 or ctx_shape[0] < num_reqs or ctx_shape[1] != context:
        raise ValueError(f"ngram_context must be [>= {num_reqs}, {context}], got {list(ctx_shape)}")


def _flat_layout(qsl: np.ndarray, num_tokens: int, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Request index per token, and where each token sits in the context-interleaved array."""
    positions = np.arange(num_tokens, dtype=np.int64)
    req = np.searchsorted(qsl[1:-1], positions, side="right").astype(np.int64)
    return req, positions + context * (req + 1)


def row_ids(
    input_ids: np.ndarray,
    query_start_loc: np.ndarray,
    ngram_context: np.ndarray,
    geometry: PLEGeometry,
) -> np.ndarray:
    """The num_heads row ids of each token: int64[T, num_heads]."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    qsl = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
    ctx = np.asarray(ngram_context, dtype=np.int64)
    n, t, r = geometry.ngram_size, ids.shape[0], qsl.shape[0] - 1
    c = n - 1
    _check_layout(t, qsl.tolist(), ctx.shape, c)
    req, tok_pos = _flat_layout(qsl, t, c)
    # One array: request r's context, then its tokens, then request r+1's context, ...
    flat = np.empty(t + c * r, dtype=np.int64)
    seg_start = qsl[:-1] + c * np.arange(r, dtype=np.int64)
    flat[tok_pos] = ids
    flat[(seg_start[:, None] + np.arange(c)).reshape(-1)] = ctx[:r].reshape(-1)
    return row_ids_at(flat, tok_pos, geometry)


def row_ids_at(flat: np.ndarray, positions: np.ndarray, geometry: PLEGeometry) -> np.ndarray:
    """Row ids of the tokens flat[positions], int64[T, num_heads], where each token has its
    request's ngram_size - 1 preceding tokens (its context) right before it in `flat`."""
    flat = np.asarray(flat, dtype=np.int64)
    back = np.arange(geometry.ngram_size, dtype=np.int64)[:, None]
    windows = flat[np.asarray(positions)[None, :] - back]  # a new array: the hash may write it
    out = np.empty((windows.shape[1], geometry.num_heads), dtype=np.int64)
    return WindowHash.of(geometry).rows_into(windows, out)


def window_row_ids(windows: np.ndarray, geometry: PLEGeometry) -> np.ndarray:
    """Row ids from each token's window: windows[k] holds the token k positions back of each
    token (windows[0] the tokens themselves), int64[ngram_size, T], as the request stores them;
    the EOS rule is applied here (on a copy: `windows` is left as it is)."""
    windows = np.array(windows, dtype=np.int64)
    out = np.empty((windows.shape[1], geometry.num_heads), dtype=np.int64)
    return WindowHash.of(geometry).rows_into(windows, out)


class WindowHash:
    """vLLM's hash of one geometry over token windows, a fixed handful of numpy calls however
    many orders and heads (made once per geometry: a decode step hashes a few tokens, where
    building the constants, or a call per order, would dominate).

    x_g = XOR_{k<g} t_k * m_k is a running XOR down the window's rows; head h of order g reads
    row offset[h] + floor_mod(x_g, size[h]).
    """

    def __init__(self, g: PLEGeometry) -> None:
        self.ngram_size = g.ngram_size
        self.num_heads = g.num_heads
        self.eos = g.eos_token_id
        self.multipliers = np.asarray(g.multipliers, dtype=np.int64)[:, None]
        # the running-XOR row of each head: order g is row g - 1
        self.head_rows = np.arange(g.num_heads, dtype=np.intp) // g.heads_per_ngram + 1
        self.sizes = np.asarray(g.head_sizes, dtype=np.int64)
        self.offsets = np.asarray(g.head_offsets, dtype=np.int64)
        if (self.sizes < 1).any():
            raise ValueError(f"head sizes must be positive, got {g.head_sizes[:4]}...")
        # every id it makes: head h's are offset[h] + [0, size[h])
        self.bounds = (int(self.offsets.min()), int((self.offsets + self.sizes).max()))

    @staticmethod
    @lru_cache(maxsize=16)
    def of(g: PLEGeometry) -> WindowHash:
        return WindowHash(g)

    def rows_into(
        self,
        windows: np.ndarray,
        out: np.ndarray,
        mixed: np.ndarray | None = None,
        seen: np.ndarray | None = None,
    ) -> np.ndarray:
        """Row ids of each window into out (int64[T, num_heads]), returned.

        windows: integer [ngram_size, T], overwritten: predecessor k becomes EOS where one of
        t1..t(k-1) is an EOS (the n-gram never reaches back across one; going back k <=
        ngram_size - 1 positions never leaves the token's request, its context comes first).
        mixed (int64[ngram_size, T]) and seen (bool[ngram_size - 2, T]): scratch to reuse.
        """
        if self.ngram_size > 2:
            seen = np.equal(windows[1:-1], self.eos, out=seen)
            if self.ngram_size > 3:  # (one row is its own running OR)
                np.logical_or.accumulate(seen, axis=0, out=seen)
            np.copyto(windows[2:], self.eos, where=seen)
        # int64 arrays wrap on overflow, like torch.long
        mixed = np.multiply(windows, self.multipliers, out=mixed, dtype=np.int64)
        np.bitwise_xor.accumulate(mixed, axis=0, out=mixed)
        np.take(mixed.T, self.head_rows, axis=1, out=out, mode="clip")
        np.mod(out, self.sizes, out=out)  # floor mod, as torch's remainder
        out += self.offsets
        return out


def row_ids_torch(
    input_ids: torch.Tensor,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
    geometry: PLEGeometry,
) -> torch.Tensor:
    """Torch version of row_ids on the tensors' device: torch.int64[T, num_heads]."""
    import torch

    ids = input_ids.reshape(-1).long()
    dev = ids.device
    qsl = query_start_loc.reshape(-1).long().to(dev)
    ctx = ngram_context.long().to(dev)
    n, t, r = geometry.ngram_size, ids.shape[0], qsl.shape[0] - 1
    c = n - 1
    # On a GPU, reading query_start_loc back would stall the stream: check shapes only.
    qsl_host = qsl.tolist() if dev.type == "cpu" else [0] * max(1, qsl.shape[0])
    _check_layout(t, qsl_host, tuple(ctx.shape), c)
    positions = torch.arange(t, dtype=torch.int64, device=dev)
    req = torch.searchsorted(qsl[1:-1].contiguous(), positions, right=True)
    tok_pos = positions + c * (req + 1)
    flat = torch.empty(t + c * r, dtype=torch.int64, device=dev)
    seg_start = qsl[:-1] + c * torch.arange(r, dtype=torch.int64, device=dev)
    flat[tok_pos] = ids
    flat[(seg_start[:, None] + torch.arange(c, device=dev)).reshape(-1)] = ctx[:r].reshape(-1)
    idx = torch.arange(flat.shape[0], dtype=torch.int64, device=dev)
    marker = torch.where(flat == geometry.eos_token_id, idx, torch.full_like(idx, -1))
    marker[seg_start] = torch.maximum(marker[seg_start], seg_start - 1)
    last_eos = torch.cummax(marker, dim=0).values if flat.numel() else marker
    prev_eos = last_eos[tok_pos - 1]
    eos = torch.full_like(ids, geometry.eos_token_id)
    m = torch.tensor(geometry.multipliers, dtype=torch.int64, device=dev)
    sizes = torch.tensor(geometry.head_sizes, dtype=torch.int64, device=dev)
    offsets = torch.tensor(geometry.head_offsets, dtype=torch.int64, device=dev)
    out = torch.empty((t, geometry.num_heads), dtype=torch.int64, device=dev)
    x = ids * m[0]
    hp = geometry.heads_per_ngram
    for order in range(2, n + 1):
        k = order - 1
        pred = torch.where(tok_pos - k > prev_eos, flat[tok_pos - k], eos)
        x = torch.bitwise_xor(x, pred * m[k])
        heads = slice((order - 2) * hp, (order - 1) * hp)
        out[:, heads] = torch.remainder(x[:, None], sizes[heads]) + offsets[heads]
    return out
