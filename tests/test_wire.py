"""Pure values of the exchange, without processes: the wire codec, the return layout, the status."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_vit_balance.exchange import (
    ExchangeRoute,
    LeafSignature,
    ReturnLayout,
    ViTStatus,
    elements_per_row,
    pack_rows,
    rows_per_image,
    take_rows,
    transit_dtype,
    unpack_rows,
)
from lightning_vit_balance.planning import RebalancePlan
from lightning_vit_balance.problems import PROBLEMS, InputProblem, describe_problem, problem_details

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool]


def _values(dtype: torch.dtype, rows: int) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.arange(rows * 3).reshape(rows, 3) % 3 == 0
    if dtype.is_floating_point:
        return (torch.randn(rows, 3, generator=torch.Generator().manual_seed(rows)) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.tensor([[info.max, info.min, r] for r in range(rows)], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_buffer_round_trip_per_dtype(dtype: torch.dtype) -> None:
    """Each dtype shares one buffer with a bf16 and an int64 output and comes back bit for bit."""
    leaves = [_values(dtype, 4), _values(torch.bfloat16, 2), _values(torch.int64, 3)]
    transit = transit_dtype([leaf.dtype for leaf in leaves])
    buffer = torch.cat([pack_rows(leaf, transit) for leaf in leaves])
    assert buffer.dtype == transit
    start = 0
    for leaf in leaves:
        size = leaf.shape[0] * elements_per_row(leaf, transit)
        back = unpack_rows(buffer[start : start + size], leaf.shape[0], leaf)
        assert back.dtype == leaf.dtype and torch.equal(back, leaf)
        start += size
    assert start == buffer.numel()


def _plan() -> RebalancePlan:
    # Rank 0: images of 16, 64 and 4 patches; rank 1: none; rank 2: one of 16.
    counts = ((16, 64, 4), (), (16,))
    destinations = ((2, 0, 1), (), (1,))
    costs = tuple(tuple(float(n * n) for n in row) for row in counts)
    return RebalancePlan(
        applied=True,
        reason="applied",
        solver="seed",
        patch_counts=counts,
        destinations=destinations,
        image_costs=costs,
        loads_before=(4368.0, 0.0, 256.0),
        loads_after=(4096.0, 272.0, 256.0),
    )


def test_return_layout_sizes_and_order() -> None:
    plan = _plan()
    kinds, merge, elements = ["patch", "merged"], 2, [5, 7]
    # Worker 1 encodes rank 0's image 2 (4 patches) then rank 2's image 0 (16 patches).
    worker = ReturnLayout.from_plan(plan, 1, kinds, merge, elements)
    assert worker.send_rows == (((0, 4), (0, 1)), ((0, 0), (0, 0)), ((4, 20), (1, 5)))
    assert worker.send_splits == (4 * 5 + 1 * 7, 0, 16 * 5 + 4 * 7)
    # Home rank 0 gets image 1 back from itself, image 2 from rank 1 and image 0 from rank 2.
    home = ReturnLayout.from_plan(plan, 0, kinds, merge, elements)
    assert home.receive_rows == ((64, 16), (4, 1), (16, 4))
    assert home.receive_splits == (64 * 5 + 16 * 7, 4 * 5 + 7, 16 * 5 + 4 * 7)
    # Received in (worker, index) order = images 1, 2, 0: restore puts image 0 first again.
    assert home.restore is not None
    received = torch.cat([torch.full((n, 1), i) for i, n in [(1, 64), (2, 4), (0, 16)]])
    assert take_rows(received, home.restore[0]).reshape(-1).tolist() == [0] * 16 + [1] * 64 + [2] * 4
    empty = ReturnLayout.from_plan(plan, 1, kinds, merge, elements)
    assert empty.receive_splits == (0, 0, 0) and empty.restore is None


def test_return_layout_matches_the_route() -> None:
    plan = _plan()
    for rank in range(plan.num_ranks):
        route = ExchangeRoute.from_plan(plan, rank)
        layout = ReturnLayout.from_plan(plan, rank, ["patch"], 1, [1])
        # Per-patch rows with one element each: the return trip mirrors the pixel trip.
        assert layout.send_splits == route.receive_patches
        assert layout.receive_splits == route.send_patches
    assert rows_per_image("merged", 16, 2) == 4 and rows_per_image("patch", 16, 2) == 16


def test_status_codec_round_trip_and_digest() -> None:
    leaves = (
        LeafSignature("0", "merged", "torch.float32", (24,), rows=10, expected=10),
        LeafSignature("2.1", "merged", "torch.bfloat16", (24,), rows=3, expected=4, problem=1),
    )
    status = ViTStatus(leaves=leaves)
    back = ViTStatus.decode(status.encode())
    assert back == status and [x.rows for x in back.leaves] == [10, 3] and back.flag == 2
    # The digest ignores rows (they differ per batch) but not dtypes or widths.
    same = ViTStatus(leaves=(dataclasses.replace(leaves[0], rows=99), leaves[1]))
    other = ViTStatus(leaves=(LeafSignature("0", "merged", "torch.float32", (48,)), leaves[1]))
    assert same.digest() == status.digest() != other.digest()
    failed = ViTStatus(error="OutOfMemoryError: " + "x" * 10_000)
    decoded = ViTStatus.decode(failed.encode())
    assert decoded.flag == 1 and decoded.error.startswith("OutOfMemoryError: xxx")
    assert len(failed.encode()) < 2048


def test_every_problem_has_one_template_and_named_fields() -> None:
    assert set(PROBLEMS) == {p for p in InputProblem if p is not InputProblem.OK}
    details = problem_details(InputProblem.GRID_VALUE, index=3, t=1, h=0, w=4)
    assert describe_problem(InputProblem.GRID_VALUE, details).startswith("grid_thw[3] = [1, 0, 4]")
    with pytest.raises(ValueError, match="GRID_VALUE takes the fields"):
        problem_details(InputProblem.GRID_VALUE, index=3)
    meta_grid = describe_problem(InputProblem.GRID_DEVICE, (2, 0, 0, 0))
    assert meta_grid.startswith("grid_thw is on a meta device")
