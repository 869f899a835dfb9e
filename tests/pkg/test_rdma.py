"""sparkple.rdma: the one reading of sparkple_pair_ib_hca (NCCL_IB_HCA) that the link check, the
metrics program and the metrics role share."""

from __future__ import annotations

import pytest

from sparkple.pair.link import parse_hcas as link_hcas
from sparkple.rdma import Hca, HcaError, parse_hcas
from sparkple.serving.recipe import ServingError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("rocep1s0f1", [Hca("rocep1s0f1", None)]),
        ("=mlx5_0:1", [Hca("mlx5_0", 1)]),
        # a ConnectX-7's twin ports, as docs/two-sparks.md recommends
        ("rocep1s0f1,roceP2p1s0f1", [Hca("rocep1s0f1", None), Hca("roceP2p1s0f1", None)]),
        ("=mlx5_0:1, mlx5_1:2", [Hca("mlx5_0", 1), Hca("mlx5_1", 2)]),
        ("mlx5_0,", [Hca("mlx5_0", None)]),
    ],
)
def test_a_list_gives_each_device_and_port(value: str, expected: list[Hca]) -> None:
    assert parse_hcas(value) == expected
    # the link check reads the same devices, on the port NCCL takes where none is named
    assert link_hcas(value) == [(h.device, h.port_or_first) for h in expected]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("^mlx5_1", "exclusion list"),
        ("", "is empty"),
        (" , ", "is empty"),
        ("mlx5_0:x", "the port after mlx5_0: must be a number"),
        ("../etc", "is not an RDMA device name"),
        ("mlx5_0 mlx5_1", "is not an RDMA device name"),
        ("mlx5_0,mlx5_0", "twice"),
    ],
)
def test_what_names_no_device_is_refused_by_the_knob(value: str, words: str) -> None:
    with pytest.raises(HcaError, match=words) as info:
        parse_hcas(value)
    assert "sparkple_pair_ib_hca" in str(info.value)
    with pytest.raises(ServingError, match=words):
        link_hcas(value)
