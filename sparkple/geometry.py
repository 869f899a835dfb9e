"""The PLE table's geometry, derived from a checkpoint's config.json the way vLLM derives it.

The table is one embedding of `total_rows` rows; heads 0..H-1 each own a contiguous slice
whose size is a prime, and the checkpoint splits the rows into `shards` equal parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .errors import CheckpointError

MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
PLE_LAYER_PRIME = 10007
NVFP4_BLOCK = 16

# Defaults vLLM applies when a config omits the key.
DEFAULT_SPLIT_NGRAM_PARTS = 512
DEFAULT_SEED = 1234


def splitmix64(value: int) -> int:
    """One splitmix64 step on an unsigned 64-bit integer."""
    value = (value + SPLITMIX_GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * SPLITMIX_M1) & MASK64
    value = ((value ^ (value >> 27)) * SPLITMIX_M2) & MASK64
    return (value ^ (value >> 31)) & MASK64


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit integers."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def primes_above(base: int, count: int) -> list[int]:
    """The first `count` primes >= base (vLLM: the k-th prime after base - 1)."""
    found: list[int] = []
    candidate = max(2, base)
    while len(found) < count:
        if is_prime(candidate):
            found.append(candidate)
        candidate += 1
    return found


def layer_multipliers(ngram_size: int, vocab_size: int, seed: int, layer: int) -> list[int]:
    """Odd hash multipliers for PLE layer `layer` (its index among the PLE layers)."""
    max_multiplier = ((1 << 63) - 1) // vocab_size
    half = max(1, max_multiplier // 2)
    base = seed + PLE_LAYER_PRIME * layer
    return [
        2 * (splitmix64((base + SPLITMIX_GAMMA * (i + 1)) & MASK64) % half) + 1
        for i in range(ngram_size)
    ]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's section of config.json (its text_config, or the top level)."""
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


def _int_key(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise CheckpointError(
            f"config.json has no {key!r}: this is not a PLE checkpoint, or its config is incomplete"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(
            f"config.json {key!r} must be one integer, got {value!r}"
            + (
                " (vLLM calls int() on it; a list breaks the model)"
                if key == "eos_token_id"
                else ""
            )
        )
    return value


@dataclass(frozen=True)
class PLEGeometry:
    ngram_size: int
    heads_per_ngram: int
    num_heads: int
    head_dim: int
    head_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    total_rows: int
    shards: int
    rows_per_shard: int
    eos_token_id: int
    vocab_size: int
    multipliers: tuple[int, ...]
    ple_layer_ids: tuple[int, ...] = (2,)

    @property
    def addressed_rows(self) -> int:
        """Rows the hash can address (the table pads them up to total_rows)."""
        return max(o + s for o, s in zip(self.head_offsets, self.head_sizes, strict=True))

    @classmethod
    def from_config(
        cls,
        cfg: dict[str, Any],
        *,
        ple_layer: int = 0,
        stored_multipliers: list[int] | None = None,
        stored_head_sizes: list[int] | None = None,
        stored_head_offsets: list[int] | None = None,
    ) -> PLEGeometry:
        """Geometry from config.json (top level or its text_config), as vLLM computes it.

        `ple_layer` is the index of the PLE layer among the sorted ple_layer_ids. Values the
        checkpoint stores (multipliers, head sizes and offsets) win over computed ones.
        """
        text = text_config(cfg)
        ngram_size = _int_key(text, "ngram_size")
        heads_per_ngram = _int_key(text, "heads_per_ngram")
        if ngram_size < 2 or heads_per_ngram < 1:
            raise CheckpointError(
                f"config.json: ngram_size {ngram_size} must be >= 2 and heads_per_ngram "
                f"{heads_per_ngram} >= 1"
            )
        num_heads = (ngram_size - 1) * heads_per_ngram
        embed_dim = _int_key(text, "ple_embed_dim")
        if embed_dim % num_heads:
            raise CheckpointError(
                f"config.json: ple_embed_dim {embed_dim} is not divisible by {num_heads} heads"
            )
        head_dim = embed_dim // num_heads
        vocab_size = _int_key(text, "vocab_size")
        eos = _int_key(text, "eos_token_id")
        base = _int_key(text, "ngram_vocab_size_base")
        divisor = _int_key(text, "make_ngram_vocab_size_divisible_by")
        shards = _int_key(text, "split_ngram_parts", DEFAULT_SPLIT_NGRAM_PARTS)
        seed = _int_key(text, "seed", DEFAULT_SEED)
        if vocab_size < 1 or base < 2 or divisor < 1 or shards < 1:
            raise CheckpointError(
                "config.json: vocab_size, ngram_vocab_size_base, "
                "make_ngram_vocab_size_divisible_by and split_ngram_parts must be positive"
            )
        layer_ids = text.get("ple_layer_ids") or [2]
        if not isinstance(layer_ids, list) or not all(isinstance(x, int) for x in layer_ids):
            raise CheckpointError(f"config.json ple_layer_ids must be a list of ints: {layer_ids}")

        # Head h of dense PLE layer L is the (L*H + h + 1)-th prime >= base.
        primes = primes_above(base, (ple_layer + 1) * num_heads)
        sizes = stored_head_sizes or primes[ple_layer * num_heads :]
        offsets = stored_head_offsets or [sum(sizes[:h]) for h in range(num_heads)]
        multipliers = stored_multipliers or layer_multipliers(
            ngram_size, vocab_size, seed, ple_layer
        )
        if len(sizes) != num_heads or len(offsets) != num_heads or len(multipliers) != ngram_size:
            raise CheckpointError(
                f"stored hash buffers have the wrong length for {num_heads} heads and "
                f"ngram_size {ngram_size}: sizes {len(sizes)}, offsets {len(offsets)}, "
                f"multipliers {len(multipliers)}"
            )
        addressed = max(o + s for o, s in zip(offsets, sizes, strict=True))
        total = _round_up(addressed, divisor)
        return cls(
            ngram_size=ngram_size,
            heads_per_ngram=heads_per_ngram,
            num_heads=num_heads,
            head_dim=head_dim,
            head_sizes=tuple(int(s) for s in sizes),
            head_offsets=tuple(int(o) for o in offsets),
            total_rows=total,
            shards=shards,
            rows_per_shard=-(-total // shards),
            eos_token_id=eos,
            vocab_size=vocab_size,
            multipliers=tuple(int(m) for m in multipliers),
            ple_layer_ids=tuple(sorted(set(layer_ids))),
        )

    def shard_rows(self, shard: int) -> int:
        """Rows the checkpoint stores in `shard` (the last ones may be short or empty)."""
        start = shard * self.rows_per_shard
        return max(0, min(self.rows_per_shard, self.total_rows - start))

    @property
    def decoder_layer(self) -> int:
        """Zero-based decoder layer index of the first PLE layer (ple_layer_ids is one-based)."""
        return self.ple_layer_ids[0] - 1


@dataclass(frozen=True)
class RowFormat:
    """How one packed row is laid out: codes first, then block scales."""

    quant: Literal["nvfp4", "fp8"]
    codes_width: int
    scales_width: int
    row_width: int

    @classmethod
    def for_quant(cls, quant: str, head_dim: int) -> RowFormat:
        if quant == "nvfp4":
            if head_dim % NVFP4_BLOCK:
                raise CheckpointError(f"NVFP4 needs head_dim divisible by 16, got {head_dim}")
            codes, scales = head_dim // 2, head_dim // NVFP4_BLOCK
            return cls("nvfp4", codes, scales, codes + scales)
        if quant == "fp8":
            return cls("fp8", head_dim, 0, head_dim)
        raise CheckpointError(f"unknown quantization {quant!r}: expected 'nvfp4' or 'fp8'")
