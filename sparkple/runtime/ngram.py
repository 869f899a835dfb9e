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


def _check_layout(num_tokens: int, qsl: list[int], ctx_shape: tuple, context: int) -> None:
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
    return window_row_ids(flat[np.asarray(positions)[None, :] - back], geometry)


def window_row_ids(windows: np.ndarray, geometry: PLEGeometry) -> np.ndarray:
    """Row ids from each token's window: windows[k] holds the token k positions back of each
    token (windows[0] the tokens themselves), int64[ngram_size, T], as the request stores them;
    the EOS rule is applied here."""
    preds = _predecessors(windows, geometry.eos_token_id)
    return _mix(windows[0], preds, geometry)


def _predecessors(windows: np.ndarray, eos: int) -> list[np.ndarray]:
    """t1..t(n-1) of each token, EOS past the first EOS met going back.

    Going back k <= n - 1 positions never leaves the token's request (its context comes
    first): predecessor k is EOS exactly when one of t1..t(k-1) is an EOS (the n-gram never
    reaches back across one).
    """
    preds = [windows[1]]
    seen = windows[1] == eos
    for k in range(2, windows.shape[0]):
        preds.append(np.where(seen, eos, windows[k]))
        if k < windows.shape[0] - 1:
            seen |= windows[k] == eos
    return preds


@lru_cache(maxsize=16)
def _mix_constants(g: PLEGeometry) -> tuple[np.ndarray, list[tuple[slice, np.ndarray, np.ndarray]]]:
    """The hash's multipliers, and per order its heads' slice, sizes and offsets (made once
    per geometry: a decode step hashes a few tokens, where building them would dominate)."""
    sizes = np.asarray(g.head_sizes, dtype=np.int64)
    offsets = np.asarray(g.head_offsets, dtype=np.int64)
    orders = []
    for order in range(2, g.ngram_size + 1):
        heads = slice((order - 2) * g.heads_per_ngram, (order - 1) * g.heads_per_ngram)
        orders.append((heads, sizes[heads], offsets[heads]))
    return np.asarray(g.multipliers, dtype=np.int64), orders


def _mix(t0: np.ndarray, preds: list[np.ndarray], g: PLEGeometry) -> np.ndarray:
    m, orders = _mix_constants(g)
    out = np.empty((t0.shape[0], g.num_heads), dtype=np.int64)
    x = t0 * m[0]  # int64 arrays wrap on overflow, like torch.long
    for k, (heads, sizes, offsets) in enumerate(orders):
        x = x ^ (preds[k] * m[k + 1])
        target = out[:, heads]
        np.mod(x[:, None], sizes, out=target)  # floor mod, as torch's remainder
        target += offsets
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
