"""Pure values of the exchange, without processes: the wire codec, the return layout, the status."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_vit_balance import encoding
from lightning_vit_balance.exchange import (
    ExchangeRoute,
    LeafSignature,
    PixelTrip,
    RankMetadata,
    ReturnLayout,
    SendPieces,
    ViTStatus,
    grid_runs,
    metadata_of_rows,
    metadata_row,
    row_runs,
    rows_per_image,
    split_rows,
    take_rows,
)
from lightning_vit_balance.planning import RebalancePlan
from lightning_vit_balance.problems import PROBLEMS, InputProblem, describe_problem, problem_details
from lightning_vit_balance.routes import RouteCache
from lightning_vit_balance.wire import (
    elements_per_row,
    pack_return,
    pack_rows,
    transit_dtype,
    unpack_return,
    unpack_rows,
)

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


#: Output mixes whose transit once failed: int16 (no backend carries it), float8 next to float32
#: (torch promotes no float8), an integer in a complex128 transit (no 16-byte integer), and the
#: transit chosen for each.
MIXES = [
    ((torch.int8, torch.uint8), torch.uint8),
    ((torch.int16,), torch.int32),
    ((torch.uint8, torch.int16, torch.bool), torch.int32),
    ((torch.bool,), torch.uint8),
    ((torch.float32, torch.float8_e4m3fn), torch.float32),
    ((torch.float8_e5m2, torch.int64), torch.float16),
    ((torch.complex128, torch.int64, torch.bool, torch.float64), torch.complex128),
    ((torch.complex64, torch.int32), torch.complex64),
]


@pytest.mark.parametrize(("dtypes", "transit"), MIXES)
def test_every_output_mix_travels_in_a_dtype_the_backends_carry(
    dtypes: tuple[torch.dtype, ...], transit: torch.dtype
) -> None:
    """Bit for bit back, in a transit of uint8, int32, int64 or a floating dtype every value fits."""
    leaves = [_mixed_values(dtype, rows) for dtype, rows in zip(dtypes, (4, 2, 3, 5))]
    assert transit_dtype(dtypes) == transit
    buffer = torch.cat([pack_rows(leaf, transit) for leaf in leaves])
    start = 0
    for leaf in leaves:
        size = leaf.shape[0] * elements_per_row(leaf, transit)
        back = unpack_rows(buffer[start : start + size], leaf.shape[0], leaf)
        assert back.dtype == leaf.dtype and back.shape == leaf.shape
        assert torch.equal(back.view(torch.uint8), leaf.view(torch.uint8))  # bits, float8 too
        start += size
    assert start == buffer.numel()
    # float8_e8m0fnu (powers of two down to 2**-127) does not fit float16.
    assert transit_dtype([torch.float8_e8m0fnu]) == torch.float32


def _mixed_values(dtype: torch.dtype, rows: int) -> torch.Tensor:
    if dtype.is_complex:
        real = _values(torch.float64, rows)
        return torch.complex(real, -real).to(dtype)
    if dtype.itemsize == 1 and dtype.is_floating_point:
        return _values(torch.float32, rows).clamp(-400, 400).to(dtype)
    return _values(dtype, rows)


def _hand_plan(
    counts: tuple[tuple[int, ...], ...], destinations: tuple[tuple[int, ...], ...], power: int
) -> RebalancePlan:
    """An applied plan given by hand, each image costing ``patches ** power``."""
    costs = tuple(tuple(float(n**power) for n in row) for row in counts)
    loads_after = [0.0] * len(counts)
    for row, dests in zip(costs, destinations):
        for cost, d in zip(row, dests):
            loads_after[d] += cost
    return RebalancePlan(
        applied=True,
        reason="applied",
        solver="seed",
        patch_counts=counts,
        destinations=destinations,
        image_costs=costs,
        loads_before=tuple(sum(row, 0.0) for row in costs),
        loads_after=tuple(loads_after),
    )


def _plan() -> RebalancePlan:
    # Rank 0: images of 16, 64 and 4 patches; rank 1: none; rank 2: one of 16.
    return _hand_plan(((16, 64, 4), (), (16,)), ((2, 0, 1), (), (1,)), power=2)


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


@settings(max_examples=200, deadline=None, derandomize=True)
@given(counts=st.lists(st.integers(0, 5), max_size=12), data=st.data())
def test_row_runs_are_the_items_slices_merged(counts: list[int], data: st.DataObject) -> None:
    # Each item's rows [a, b) in the given order (some of the items, shuffled or sorted), then
    # adjacent ones merged and empty ones dropped, spelled out one item at a time.
    order = data.draw(st.permutations(range(len(counts))))
    order = order[: data.draw(st.integers(0, len(order)))]
    if data.draw(st.booleans()):
        order = sorted(order)
    offsets = [sum(counts[:i]) for i in range(len(counts) + 1)]
    merged: list[tuple[int, int]] = []
    for i in order:
        a, b = offsets[i], offsets[i + 1]
        if b > a and merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        elif b > a:
            merged.append((a, b))
    assert row_runs(counts, order) == tuple(merged)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(grids=st.lists(st.sampled_from([(1, 2, 2), (1, 4, 2), (3, 2, 2)]), max_size=20))
def test_grid_runs_round_trip(grids: list[tuple[int, int, int]]) -> None:
    # The metadata gather carries runs of equal rows: as few as there are changes of row, and
    # the rows come back exactly, from the flat values with whatever follows them.
    runs = grid_runs(grids)
    assert len(runs) == sum(1 for i, row in enumerate(grids) if i == 0 or grids[i - 1] != row)
    flat = np.array([[value for run in runs for value in run] + [9, 9, 9, 9]], dtype=np.int64)
    header = np.zeros((1, 10), dtype=np.int64)
    header[0, 1] = len(runs)
    assert metadata_of_rows(header, flat)[0].grids == tuple(grids)


_GRID_ROWS = st.sampled_from([(1, 2, 2), (1, 4, 2), (3, 2, 2), (1, 14, 6), (40, 4, 4)])
_RANK_METADATA = st.builds(
    lambda status, grids, channels, vit_us: RankMetadata(
        status=status,
        details=(7, 9, 0, 0) if status else (0, 0, 0, 0),
        channels=channels,
        dtype_code=1,
        requires_grad=channels % 2 == 0,
        grids=() if status else tuple(grids),
        fingerprint=(5, -3, 1 << 40),
        vit_us=vit_us,
    ),
    st.sampled_from([InputProblem.OK, InputProblem.OK, InputProblem.PIXEL_ROWS]),
    st.lists(_GRID_ROWS, max_size=12),
    st.integers(1, 2000),
    st.integers(-1, 10**7),
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ranks=st.lists(_RANK_METADATA, min_size=1, max_size=9))
def test_metadata_of_gathered_rows_round_trip(ranks: list[RankMetadata]) -> None:
    # Every rank's row as the metadata gather sends it; what every rank reads back is the same
    # metadata, patch counts included, whatever the padding after each rank's runs holds.
    capacity = max(len(grid_runs(m.grids)) for m in ranks)
    rows = torch.stack([metadata_row(m, grid_runs(m.grids), capacity + 1) for m in ranks]).numpy()
    grids_at = rows.shape[1] - 4 * (capacity + 1)
    rows[:, -4:] = 3  # past every rank's runs: never read
    read = metadata_of_rows(rows[:, :grids_at], rows[:, grids_at:])
    assert read == tuple(ranks)
    assert [m.patch_counts for m in read] == [tuple(t * h * w for t, h, w in m.grids) for m in ranks]


def test_restore_merges_images_that_come_back_one_after_the_other() -> None:
    # Rank 0's six images (frames of a video, say): 1-3 are encoded by rank 1, the rest at home.
    # They come back as 0, 4, 5 (rank 0's own), then 1, 2, 3: the original order is three runs of
    # the received rows, not six slices, so the return trip copies three pieces each way.
    counts = ((4, 4, 4, 4, 8, 4), (16,))
    plan = _hand_plan(counts, ((0, 1, 1, 1, 0, 0), (1,)), power=1)
    layout = ReturnLayout.from_plan(plan, 0, ["patch", "merged"], 2, [3, 1])
    assert layout.restore == (((0, 4), (16, 28), (4, 16)), ((0, 1), (4, 7), (1, 4)))
    received = torch.cat([torch.full((counts[0][i], 1), i) for i in (0, 4, 5, 1, 2, 3)])
    expected = [i for i, n in enumerate(counts[0]) for _ in range(n)]
    assert take_rows(received, layout.restore[0]).reshape(-1).tolist() == expected

    # Through the codec, values and gradients equal slicing and cat under plain autograd.
    leaves = [torch.randn(28, 3, dtype=torch.float64), torch.randn(7, 1, dtype=torch.float64)]
    transit = transit_dtype([leaf.dtype for leaf in leaves])
    elements = [elements_per_row(leaf, transit) for leaf in leaves]
    back = torch.randn(sum(layout.receive_splits), dtype=transit, requires_grad=True)
    returned = unpack_return(back, leaves, layout, elements)
    reference = _plain_unpack(back, leaves, layout)
    assert all(torch.equal(out, want) for out, want in zip(returned, reference))
    weights = [torch.randn(leaf.shape, dtype=leaf.dtype) for leaf in leaves]

    def loss(outputs: list[torch.Tensor]) -> torch.Tensor:
        return sum((out * weight).sum() for out, weight in zip(outputs, weights))

    (got,) = torch.autograd.grad(loss(returned), back)
    (want,) = torch.autograd.grad(loss(reference), back)
    assert torch.equal(got, want)


def test_return_layout_matches_the_route() -> None:
    plan = _plan()
    for rank in range(plan.num_ranks):
        route = ExchangeRoute.from_plan(plan, rank)
        layout = ReturnLayout.from_plan(plan, rank, ["patch"], 1, [1])
        # Per-patch rows with one element each: the return trip mirrors the pixel trip.
        assert layout.send_splits == route.receive_patches
        assert layout.receive_splits == route.send_patches
    assert rows_per_image("merged", 16, 2) == 4 and rows_per_image("patch", 16, 2) == 16


def _trip_plan() -> RebalancePlan:
    # Rank 0 keeps image 1 and sends images 0 and 2 to rank 1 (rows out of order); rank 1 keeps its
    # image and gets images from rank 0 and rank 2 (its own sit between arrivals); rank 2 keeps image 1.
    return _hand_plan(((4, 2, 6), (3,), (5, 1)), ((1, 0, 1), (1,), (1, 2)), power=1)


def _simulated_trips(plan: RebalancePlan, home: bool) -> list[torch.Tensor]:
    """Every rank's batch after the forward trip, the collective done by hand: rows are
    ``1000 * rank + patch row`` so each row says where it came from."""
    ranks = range(plan.num_ranks)
    counts = plan.patch_counts
    pixels = [torch.arange(sum(c), dtype=torch.float32)[:, None] + 1000 * r for r, c in enumerate(counts)]
    trips = [PixelTrip.from_route(ExchangeRoute.from_plan(plan, r), counts[r], home=home) for r in ranks]
    sent = [torch.cat([pixels[r][a:b] for a, b in trips[r].sent] + [pixels[r][:0]]) for r in ranks]
    chunks = [torch.split(sent[r], list(trips[r].send_splits)) for r in ranks]
    batches = []
    for r in ranks:
        assert [trips[s].send_splits[r] for s in ranks] == list(trips[r].receive_splits)
        batch = torch.full((trips[r].rows, 1), -1.0)
        a, b = trips[r].received_rows
        batch[a:b] = torch.cat([chunks[s][r] for s in ranks])
        at = trips[r].local_at
        for start, stop in trips[r].local:
            batch[at : at + stop - start] = pixels[r][start:stop]
            at += stop - start
        batches.append(batch)
    return batches


@pytest.mark.parametrize("home", [True, False])
def test_pixel_trip_builds_the_balanced_batch(home: bool) -> None:
    plan = _trip_plan()
    offsets = [[sum(c[:i]) for i in range(len(c))] for c in plan.patch_counts]
    for rank, batch in enumerate(_simulated_trips(plan, home)):
        images = [(s, i) for s, i in plan.arrivals(rank) if home or s != rank]
        expected = [1000 * s + offsets[s][i] + k for s, i in images for k in range(plan.patch_counts[s][i])]
        assert batch.reshape(-1).tolist() == expected
    trips = [PixelTrip.from_route(ExchangeRoute.from_plan(plan, r), plan.patch_counts[r]) for r in range(3)]
    # Home rows skip the collective, except on rank 1, whose own image sits between arrivals.
    assert [t.send_splits for t in trips] == [(0, 10, 0), (0, 3, 0), (0, 5, 0)]
    assert trips[0].local == ((4, 6),) and trips[0].sent == ((0, 4), (6, 12))
    assert trips[1].local == () and trips[1].receive_splits == (10, 3, 5)
    assert trips[2].received_rows == (1, 1) and trips[2].local_at == 0 and trips[2].rows == 1


@pytest.mark.parametrize("home", [True, False])
def test_trip_pieces_are_the_runs_of_the_pixel_rows(home: bool) -> None:
    plan = _hand_plan(((4, 2, 6, 3, 5), (3,), (5, 1)), ((1, 0, 2, 1, 0), (1,), (1, 2)), power=1)
    for rank, counts in enumerate(plan.patch_counts):
        trip = PixelTrip.from_route(ExchangeRoute.from_plan(plan, rank), counts, home=home)
        pixels = torch.arange(float(sum(counts)))[:, None]
        pieces = split_rows(pixels, trip.pieces.cuts)
        assert sum(p.shape[0] for p in pieces) == pixels.shape[0]
        for runs, picked in ((trip.sent, trip.pieces.sent), (trip.local, trip.pieces.local)):
            want = take_rows(pixels, runs) if runs else pixels[:0]
            assert torch.equal(torch.cat([pieces[k] for k in picked] + [pixels[:0]]), want)
    # Rank 0 keeps images 1 and 4 and sends 0 and 3 to rank 1, 2 to rank 2: five runs, five pieces
    # (without the home images, image 4's rows are past the last cut).
    trip = PixelTrip.from_route(ExchangeRoute.from_plan(plan, 0), plan.patch_counts[0], home=home)
    assert trip.pieces.cuts == ((4, 2, 6, 3, 5) if home else (4, 2, 6, 3))
    assert trip.pieces.sent == (0, 3, 2) and trip.pieces.local == ((1, 4) if home else ())


def _codec_leaves() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randn(7, 3, generator=generator).requires_grad_(True),  # row 6 is sent nowhere
        torch.randn(3, 2, generator=generator).to(torch.bfloat16).requires_grad_(True),
        torch.arange(6, dtype=torch.int64)[:, None] * -(2**40),  # integers travel bit for bit
    ]


def _codec_layout() -> ReturnLayout:
    send_rows = (((0, 2), (0, 1), (0, 2)), ((2, 6), (1, 3), (2, 6)))
    receive_rows = tuple(tuple(b - a for a, b in ranges) for ranges in send_rows)
    # The rows come back as [worker 0's, worker 1's]; the images' own order is worker 1's first.
    restore = (((2, 6), (0, 2)), ((1, 3), (0, 1)), ((2, 6), (0, 2)))
    return ReturnLayout(send_rows, (0, 0), receive_rows, (0, 0), restore)


def _plain_unpack(back: torch.Tensor, leaves: list[torch.Tensor], layout: ReturnLayout) -> list[torch.Tensor]:
    """Chunks, cat and restore under plain autograd."""
    transit = back.dtype
    chunks: list[list[torch.Tensor]] = [[] for _ in leaves]
    at = 0
    for rows_from_worker in layout.receive_rows:
        for k, rows in enumerate(rows_from_worker):
            size = rows * elements_per_row(leaves[k], transit)
            chunks[k].append(unpack_rows(back[at : at + size], rows, leaves[k]))
            at += size
    assert layout.restore is not None
    return [take_rows(torch.cat(c), r) for c, r in zip(chunks, layout.restore)]


def test_return_buffer_values_and_gradients_match_plain_autograd() -> None:
    """pack_return / unpack_return equal slicing, casting and cat under autograd, gradients too."""
    leaves, layout = _codec_leaves(), _codec_layout()
    transit = transit_dtype([leaf.dtype for leaf in leaves])
    plain = torch.cat(
        [pack_rows(leaf[a:b], transit) for ranges in layout.send_rows for leaf, (a, b) in zip(leaves, ranges)]
    )
    packed = pack_return(leaves, layout, transit)
    # Bit for bit: integers reinterpreted as float32 can read as NaN.
    assert packed.dtype == transit and torch.equal(packed.detach().view(torch.int32), plain.view(torch.int32))
    upstream = torch.randn(packed.shape, generator=torch.Generator().manual_seed(5))
    expected = torch.autograd.grad(plain, leaves[:2], upstream)
    for got, want in zip(torch.autograd.grad(packed, leaves[:2], upstream), expected):
        assert got.dtype == want.dtype and torch.equal(got, want)

    back = plain.detach().requires_grad_(True)
    elements = [elements_per_row(leaf, transit) for leaf in leaves]
    returned = unpack_return(back, leaves, layout, elements)
    reference = _plain_unpack(back, leaves, layout)
    for leaf, out, want in zip(leaves, returned, reference):
        assert out.dtype == leaf.dtype and torch.equal(out, want)
        assert out.requires_grad == leaf.dtype.is_floating_point
    weights = torch.arange(18.0).reshape(6, 3)
    # Only the float32 output feeds the loss: the rest of the buffer's gradient is zero.
    (got,) = torch.autograd.grad((returned[0] * weights).sum(), back)
    (want,) = torch.autograd.grad((reference[0] * weights).sum(), back)
    assert torch.equal(got, want) and got[6:].abs().sum() > 0
    both = [(out[0] * weights).sum() + out[1].float().sum() for out in (returned, reference)]
    assert torch.equal(*(torch.autograd.grad(loss, back)[0] for loss in both))


def _tagged_rows(plan: RebalancePlan, images: list[tuple[int, int]], kind: str, width: int) -> torch.Tensor:
    """Rows of output ``kind`` of ``images``, each row ``[1e6 * rank + 1e3 * image + row]`` repeated."""
    rows = [
        1e6 * src + 1e3 * i + j
        for src, i in images
        for j in range(rows_per_image(kind, plan.patch_counts[src][i], 2))
    ]
    return torch.tensor(rows, dtype=torch.float64)[:, None].repeat(1, width)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_simulated_return_trip_gives_every_home_its_rows_and_gradients(data: st.DataObject) -> None:
    """Every rank packs its balanced batch's outputs, the collective is done by hand under autograd,
    every rank unpacks: each gets its own images' rows in their order, and each worker's outputs get
    the gradients their rows' homes gave them (the pieces, restore and gaps of both codecs)."""
    ranks = data.draw(st.integers(2, 4))
    counts = tuple(
        tuple(4 * n for n in data.draw(st.lists(st.integers(1, 6), max_size=5))) for _ in range(ranks)
    )
    destinations = tuple(tuple(data.draw(st.integers(0, ranks - 1)) for _ in row) for row in counts)
    plan = _hand_plan(counts, destinations, power=1)
    kinds = data.draw(st.lists(st.sampled_from(["patch", "merged"]), min_size=1, max_size=3))
    widths = [k + 1 for k in range(len(kinds))]
    leaves = [
        [
            _tagged_rows(plan, list(plan.arrivals(r)), kind, width).requires_grad_(True)
            for kind, width in zip(kinds, widths)
        ]
        for r in range(ranks)
    ]
    layouts = [ReturnLayout.from_plan(plan, r, kinds, 2, widths) for r in range(ranks)]
    sent = [
        torch.split(pack_return(leaves[r], layouts[r], torch.float64), list(layouts[r].send_splits))
        for r in range(ranks)
    ]
    weights = [torch.randn(()) for _ in range(ranks)]
    loss = torch.zeros((), dtype=torch.float64)
    for home in range(ranks):
        back = torch.cat([sent[worker][home] for worker in range(ranks)])
        outputs = unpack_return(back, leaves[home], layouts[home], widths)
        for kind, width, out in zip(kinds, widths, outputs):
            expected = _tagged_rows(plan, [(home, i) for i in range(len(counts[home]))], kind, width)
            torch.testing.assert_close(out.detach(), expected, rtol=0, atol=0)
            loss = loss + (out * (weights[home] + out.detach() * 1e-9)).sum()
    loss.backward()
    for r in range(ranks):
        for leaf in leaves[r]:
            assert leaf.grad is not None
            homes = torch.div(leaf.detach(), 1e6, rounding_mode="floor").long()
            # Each row's gradient is its home's weight plus its own tag's share: exact in float64.
            expected = torch.stack(weights).double()[homes] + leaf.detach() * 1e-9
            torch.testing.assert_close(leaf.grad, expected, rtol=1e-12, atol=0)


def test_send_pieces_cut_rows_sent_nowhere_and_refuse_homes_out_of_order() -> None:
    # Output 0: rows 0-1 to home 0, row 2 nowhere, rows 3-4 to home 1, rows 5+ nowhere.
    layout = ReturnLayout((((0, 2), (0, 0)), ((3, 5), (0, 1))), (0, 0), ((0, 0), (0, 0)), (0, 0), None)
    assert layout.send_pieces == SendPieces(cuts=((2, 1, 2), (1,)), order=((0, 0), (0, 2), (1, 0)))
    leaves = [torch.arange(7.0)[:, None].requires_grad_(True), torch.tensor([[9.0]], requires_grad=True)]
    packed = pack_return(leaves, layout, torch.float32)
    assert packed.tolist() == [0.0, 1.0, 3.0, 4.0, 9.0]
    (grad,) = torch.autograd.grad(packed, leaves[0], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert grad.reshape(-1).tolist() == [1.0, 2.0, 0.0, 3.0, 4.0, 0.0, 0.0]
    backwards = ReturnLayout((((2, 4),), ((0, 2),)), (0, 0), ((0,), (0,)), (0, 0), None)
    with pytest.raises(ValueError, match=r"send_rows\[1\]\[0\] = \(0, 2\) starts before row 4"):
        _ = backwards.send_pieces


def test_route_cache_makes_each_plans_values_once() -> None:
    plan, other = _plan(), _trip_plan()
    cache = RouteCache(plans=2)
    route = cache.route(plan, 0)
    assert route == ExchangeRoute.from_plan(plan, 0) and cache.route(plan, 0) is route
    assert cache.route(plan, 1) is not route  # per rank
    trip = cache.trip(plan, 0)
    assert trip == PixelTrip.from_route(route, plan.patch_counts[0]) and cache.trip(plan, 0) is trip
    assert "pieces" in vars(trip)  # made with it, not in the call's forward
    assert cache.trip(plan, 0, home=False) == PixelTrip.from_route(route, plan.patch_counts[0], home=False)
    layout = cache.layout(plan, 0, (("patch", "merged"), 2, (5, 7)))
    assert layout == ReturnLayout.from_plan(plan, 0, ["patch", "merged"], 2, [5, 7])
    assert "receive_pieces" in vars(layout) and "send_pieces" in vars(layout)  # made with it
    assert cache.layout(plan, 0, (("patch", "merged"), 2, (5, 7))) is layout
    assert cache.layout(plan, 0, (("patch", "merged"), 2, (5, 8))) is not layout  # another signature
    # A plan equal in value is another plan: found by identity, never by hashing a whole plan.
    assert cache.route(dataclasses.replace(plan), 0) is not route
    # warm() makes the last signature's layout for a new plan; the oldest plan is dropped.
    cache.warm(other, 1, homes=(True, False))
    with mock.patch.object(ReturnLayout, "from_route", side_effect=AssertionError("made again")):
        cache.layout(other, 1, (("patch", "merged"), 2, (5, 8)))
        cache.trip(other, 1, home=False)
    assert cache.route(plan, 0) is not route


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


def test_status_codec_takes_an_error_naming_an_undecodable_file() -> None:
    """A file name Python decoded with ``surrogateescape`` holds lone surrogates, which strict UTF-8
    cannot encode: the failing rank raised UnicodeEncodeError alone, before the detail gather the
    others waited in (gloo then aborted them at the next step's gather). Every rank now reads the
    failing rank's own text, also past the message's cut."""
    name = os.fsdecode(b"/data/img_\xff.jpg")
    for error in (f"ValueError: cannot decode {name}", "ValueError: " + name * 400):
        failed = ViTStatus(error=error)
        assert len(failed.encode()) <= 2048
        assert error.startswith(ViTStatus.decode(failed.encode()).error)


class _Unprintable(ValueError):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_a_vit_error_whose_text_cannot_be_read_still_travels() -> None:
    """``str(error)`` raising would have raised on that rank alone, the others left waiting."""
    status = encoding.EncodedBatch([], None, [], _Unprintable(), 0.0).status()
    assert status.error == "_Unprintable: (its message could not be read: str() raised RuntimeError)"


def test_status_codec_of_outputs_too_many_to_list_keeps_their_problems() -> None:
    """Past the detail's bytes, the outputs with a problem travel with the digest and count of all:
    the text on every rank still names the cause, and a difference is still told."""
    leaves = tuple(
        LeafSignature(f"vision_model.layers.{k}.pooled", "merged", "torch.float32", (24,), rows=4, expected=4)
        for k in range(60)
    )
    bad = dataclasses.replace(leaves[7], rows=3, problem=1)
    status = ViTStatus(leaves=(*leaves[:7], bad, *leaves[8:]))
    assert len(json.dumps([dataclasses.astuple(x) for x in leaves])) > 2048
    back = ViTStatus.decode(status.encode())
    assert back.leaves == (bad,) and back.flag == 2
    assert (back.digest(), back.count) == (status.digest(), 60)
    reference = ViTStatus(leaves=leaves)
    told = encoding._describe(back, reference, 2)
    assert told is not None and "'vision_model.layers.7.pooled' has 3 rows" in told, told
    # Outputs that differ (a dtype on one rank) with none at fault are told by their digests.
    cast = ViTStatus(leaves=(*leaves[:59], dataclasses.replace(leaves[59], dtype="torch.float64")))
    decoded = ViTStatus.decode(cast.encode())
    assert decoded.leaves == () and decoded.flag == 0
    told = encoding._describe(decoded, ViTStatus.decode(reference.encode()), 2)
    assert told is not None and "60 outputs that travel back differ from the first rank's 60" in told, told
    assert encoding._describe(ViTStatus.decode(reference.encode()), reference, 2) is None
    # A problem at a path too long for the bytes still travels, its path cut.
    # 3 and 4 bytes in UTF-8 (12 escaped as JSON's ASCII), and a lone surrogate (6, its escape).
    for char in ("深", "\N{GRINNING FACE}", "\udcff"):
        long = dataclasses.replace(bad, path=char * 3000)
        back = ViTStatus.decode(ViTStatus(error="", leaves=(*leaves, long)).encode())
        assert back.flag == 2 and back.leaves[-1].path == char * 200 and back.count == 61
    # Many outputs at fault: as many as fit travel (counted once, not dumped again for each).
    many = tuple(dataclasses.replace(leaf, rows=3, problem=1) for leaf in leaves * 40)
    data = ViTStatus(leaves=many).encode()
    assert len(data) <= 2044 and 0 < len(ViTStatus.decode(data).leaves) < len(many)


def test_a_status_just_about_its_bytes_fits_with_its_length_header() -> None:
    """Every length around the limit: the detail row holds a 4-byte length before the text, so a
    text of up to ``_DETAIL_BYTES - 4`` bytes is what fits (a longer one failed to copy into its
    row on the failing rank alone, and the others waited in the detail gather)."""
    from lightning_vit_balance.exchange import _DETAIL_BYTES, _decode_detail, _encode_detail

    leaf = LeafSignature("p", "merged", "torch.float32", (24,), rows=3, expected=4, problem=1)
    base = len(ViTStatus(leaves=(leaf,)).encode())
    lengths = set()
    for extra in range(_DETAIL_BYTES - base - 12, _DETAIL_BYTES - base + 12):
        status = ViTStatus(leaves=(dataclasses.replace(leaf, path="p" * (1 + extra)),))
        data = status.encode()
        lengths.add(len(data))
        assert len(data) <= _DETAIL_BYTES - 4, len(data)
        back = _decode_detail(_encode_detail(status).numpy())
        assert back == ViTStatus.decode(data) and back.flag == 2 and back.leaves[0].rows == 3
    assert max(lengths) == _DETAIL_BYTES - 4  # the sweep reached the limit itself


def test_every_problem_has_one_template_and_named_fields() -> None:
    assert set(PROBLEMS) == {p for p in InputProblem if p is not InputProblem.OK}
    details = problem_details(InputProblem.GRID_VALUE, index=3, t=1, h=0, w=4)
    assert describe_problem(InputProblem.GRID_VALUE, details).startswith("grid_thw[3] = [1, 0, 4]")
    with pytest.raises(ValueError, match="GRID_VALUE takes the fields"):
        problem_details(InputProblem.GRID_VALUE, index=3)
    meta_grid = describe_problem(InputProblem.GRID_DEVICE, (2, 0, 0, 0))
    assert meta_grid.startswith("grid_thw is on a meta device")


def test_route_cache_keeps_exactly_its_bound_of_plans_the_oldest_leaving_first() -> None:
    """A step's calls and their recomputations find their routes made (a route made again costs
    milliseconds of host time on hundreds of ranks); the bound keeps the cache from growing with
    every step's plans, and it is the oldest plan that leaves."""
    first = _plan()
    second, third = dataclasses.replace(first), dataclasses.replace(first)
    cache = RouteCache(plans=2)
    route = cache.route(first, 0)
    cache.route(second, 0)
    with mock.patch.object(ExchangeRoute, "from_plan", side_effect=AssertionError("made again")):
        assert cache.route(first, 0) is route  # two plans: both kept
    cache.route(third, 0)  # found last, the first is the oldest still
    assert cache.route(first, 0) is not route  # a third: the first made anew


def test_route_cache_keeps_its_bound_of_output_signatures_the_oldest_leaving_first() -> None:
    """Outputs whose trailing shape changes between calls make a return layout each: the newest
    ones are found, the oldest is made again, and the cache does not grow with every shape."""
    from lightning_vit_balance.routes import RETURN_SIGNATURES

    plan, cache = _plan(), RouteCache()
    signatures = [(("patch", "merged"), 2, (5, width)) for width in range(1, RETURN_SIGNATURES + 2)]
    layouts = [cache.layout(plan, 0, signature) for signature in signatures]
    with mock.patch.object(ReturnLayout, "from_route", side_effect=AssertionError("made again")):
        for signature, layout in zip(signatures[1:], layouts[1:]):
            assert cache.layout(plan, 0, signature) is layout
    again = cache.layout(plan, 0, signatures[0])
    assert again is not layouts[0] and again == layouts[0]


def test_warming_a_plan_that_moves_nothing_makes_nothing() -> None:
    """A step the plan skips costs nothing at all: no route, trip or layout is made for it."""
    cache = RouteCache()
    cache.layout(_plan(), 0, (("patch",), 2, (5,)))  # a last signature to make a layout for
    skipped = dataclasses.replace(_plan(), applied=False)
    with mock.patch.object(ExchangeRoute, "from_plan", side_effect=AssertionError("made for a skipped step")):
        cache.warm(skipped, 0, homes=(True, False))


def _one_rank_layout(rows: list[int]) -> ReturnLayout:
    """Every output's ``rows`` sent to and received from the one rank itself, in order."""
    return ReturnLayout((tuple((0, n) for n in rows),), (0,), (tuple(rows),), (0,), None)


def test_a_real_output_carried_next_to_a_complex_one_comes_back_without_a_warning() -> None:
    """A float64 output next to a complex128 one travels as complex values with a zero imaginary
    part: read back as its real part, it is exact and silent, where torch's cast would warn at
    every call (and fail a run that turns warnings into errors) that it discards the imaginary part."""
    generator = torch.Generator().manual_seed(0)
    real = torch.randn(3, 2, dtype=torch.float64, generator=generator)
    leaves = [torch.complex(real, -real).requires_grad_(True), (real * 7).requires_grad_(True)]
    transit = transit_dtype([leaf.dtype for leaf in leaves])
    assert transit == torch.complex128
    layout = _one_rank_layout([3, 3])
    elements = [elements_per_row(leaf, transit) for leaf in leaves]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pyproject ignores UserWarning otherwise
        returned = unpack_return(pack_return(leaves, layout, transit), leaves, layout, elements)
        assert [out.dtype for out in returned] == [torch.complex128, torch.float64]
        assert all(torch.equal(out, leaf) for out, leaf in zip(returned, leaves))
        (returned[0].real.sum() + (returned[1] * 2).sum()).backward()
    assert leaves[1].grad is not None
    assert torch.equal(leaves[1].grad, torch.full((3, 2), 2.0, dtype=torch.float64))


def test_a_real_output_of_one_value_carried_as_complex_takes_an_in_place_change() -> None:
    """The real part of a ``[1, 1]`` complex buffer is contiguous already, so its cast is a view
    of the buffer: handed back as it is, autograd would refuse the direct call's in-place changes
    (``image_embeds *= scale``) of the custom Function's output. It is a copy, whose gradient
    reaches the ViT's output."""
    leaves = [
        torch.ones(1, 1, dtype=torch.complex128, requires_grad=True),
        torch.ones(1, 1, dtype=torch.float64, requires_grad=True),
    ]
    layout = _one_rank_layout([1, 1])
    out = unpack_return(pack_return(leaves, layout, torch.complex128), leaves, layout, [1, 1])
    out[1].mul_(3)
    out[1].sum().backward()
    assert leaves[1].grad is not None and leaves[1].grad.tolist() == [[3.0]]
