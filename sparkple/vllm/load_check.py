"""The packed table against what vLLM loaded, right after the weights load and before profiling:
the checkpoint's global scale and hash buffers, the rows the hash addresses, and on a pair that
both ranks run one release with one table and split its rows between them. A table built from
another checkpoint, or a pair of two releases, stops the start here, not a request."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from vllm.config import get_current_vllm_config

from sparkple.geometry import PLEGeometry
from sparkple.runtime.rankcheck import Release, check_ranks, describe
from sparkple.runtime.rowshard import OwnedRows
from sparkple.runtime.table import PackedTable


class LoadedLayer(Protocol):
    """What the checks read of the packed-table layer (packed_table.PackedTableEmbedding, which
    calls them): its own fields, and vLLM's (the prefix, the scales the checkpoint loaded, the
    TP group)."""

    quant: str
    table: PackedTable
    owned: OwnedRows
    prefix: str
    tp_rank: int
    tp_size: int
    parallel_group: Any  # vLLM's GroupCoordinator
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    _hash_buffers: tuple[torch.Tensor, ...] | None
    _global_scale: float
    _table_dir: str


def checked_geometry(layer: LoadedLayer) -> PLEGeometry:
    """The hash as the checkpoint loaded it, checked against the layer's table right after the
    weights load (before profiling): its global scale, hash buffers and addressed rows, and on
    a pair the ranks (check_peers). A mismatch raises, naming each difference."""
    if layer._hash_buffers is None:
        raise RuntimeError("packed PLE table checked before bind_hash()")
    scale = layer.weight_scale_2 if layer.quant == "nvfp4" else layer.weight_scale
    loaded_scale = float(scale.reshape(-1)[0])
    multipliers, sizes, offsets = (
        tuple(int(v) for v in buffer.tolist()) for buffer in layer._hash_buffers
    )
    built = layer.table.geometry()
    problems = []
    if loaded_scale != layer._global_scale:
        problems.append(f"global scale {loaded_scale!r}, the table's {layer._global_scale!r}")
    for name, loaded, recorded in (
        ("multipliers", multipliers, built.multipliers),
        ("head sizes", sizes, built.head_sizes),
        ("head offsets", offsets, built.head_offsets),
    ):
        if loaded != recorded:
            problems.append(f"hash {name} {loaded[:4]}..., the table's {recorded[:4]}...")
    geometry = replace(built, multipliers=multipliers, head_sizes=sizes, head_offsets=offsets)
    if geometry.addressed_rows > layer.table.meta.total_rows:
        problems.append(
            f"the hash addresses {geometry.addressed_rows} rows, the table holds "
            f"{layer.table.meta.total_rows}"
        )
    if layer.tp_size > 1:
        check_peers(layer, problems)
    if problems:
        model = getattr(get_current_vllm_config().model_config, "model", None)
        raise ValueError(
            f"the packed PLE table {layer._table_dir} (built from snapshot "
            f"{layer.table.meta.source.snapshot_id}) does not match the checkpoint "
            f"{model or 'being loaded'} at {layer.prefix}: "
            + "; ".join(problems)
            + ". Rebuild the table from this checkpoint with `sparkple build-table --force`"
        )
    return geometry


def check_peers(layer: LoadedLayer, problems: list[str]) -> None:
    """Every rank of the group runs the same release (SPARKPLE_RELEASE_ID and
    SPARKPLE_PATCH_MANIFEST_SHA256, set by the serving unit) with the same table, and the
    ranks' ranges give each row one owner (a collective over the group's CPU side: every
    rank calls it at load, its own problems included, so a refusing rank's peers refuse
    with it). A rank with problems of its own raises them itself."""
    mine = describe(
        layer.tp_rank,
        layer._table_dir,
        layer.table.meta,
        layer.owned,
        problems,
        release=Release.from_env(),
    )
    entries: list[Any] = [None] * layer.tp_size
    dist.all_gather_object(entries, mine, group=layer.parallel_group.cpu_group)
    if not problems:
        check_ranks(entries)
