"""The communication layer: autograd all_to_all, metadata gather, routes, problem messages."""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import towers
from multirank import caught, subgroup
from test_faults import _vit_case as vit_case
from test_many_ranks import _suite as many_ranks_suite

from lightning_vit_balance import ViTBalanceConfig, ViTBalancer, exchange
from lightning_vit_balance.encoding import TripClock, validate_input
from lightning_vit_balance.exchange import (
    ExchangeRoute,
    RankMetadata,
    _DoublingRows,
    all_to_all,
    collective_device,
    gather_metadata,
    grid_steps,
    sharded_grads_all_zero,
)
from lightning_vit_balance.planning import RebalancePlan
from lightning_vit_balance.problems import (
    DTYPES,
    INPUT_KINDS,
    LAYOUTS,
    InputProblem,
    describe_problem,
    layout_code,
)

POOL = 4


def _splits(n: int) -> list[list[int]]:
    """rows[src][dst] sent from src to dst, zeros included."""
    return [[(2 * src + 3 * dst) % 4 for dst in range(n)] for src in range(n)]


def _all_to_all_checks(n: int) -> bool | None:
    group = subgroup(n)
    rank = dist.get_rank()
    if rank >= n:
        return None
    rows = _splits(n)
    send = rows[rank]
    receive = [rows[src][rank] for src in range(n)]
    # Row j sent to dst is [rank, dst, j, 0.5]; trailing dims exercise non-1-D exchanges.
    pieces = [torch.tensor([[rank, dst, j, 0.5]] * 1) for dst in range(n) for j in range(send[dst])]
    data = torch.cat(pieces).reshape(-1, 2, 2) if pieces else torch.zeros(0, 2, 2)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = data.to(dtype).clone().requires_grad_(True)
        y = all_to_all(x, send, receive, group, differentiable=True)
        expected = [[src, rank, j, 0.5] for src in range(n) for j in range(receive[src])]
        assert y.dtype == dtype and y.shape == (sum(receive), 2, 2)
        assert y.reshape(-1, 4).tolist() == expected
        # Backward is the inverse exchange: the gradient of each row comes back to its sender.
        weights = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape).to(dtype) + rank * 100
        (y * weights).sum().backward()
        grad_rows = weights.reshape(-1, 4)
        back = all_to_all(grad_rows, receive, send, group, differentiable=False)
        assert x.grad is not None and torch.equal(x.grad.reshape(-1, 4), back)
    # Not differentiable: no graph. A tensor that does not require grad made differentiable: the
    # result requires grad and its backward still runs the inverse exchange on every rank.
    ints = (data.reshape(-1, 4)[:, :3] * 1000 + 3).to(torch.int64)
    plain = all_to_all(ints, send, receive, group, differentiable=False)
    assert plain.grad_fn is None and plain.dtype == torch.int64
    assert plain.tolist() == [
        [src * 1000 + 3, rank * 1000 + 3, j * 1000 + 3] for src in range(n) for j in range(receive[src])
    ]
    forced = all_to_all(data.clone(), send, receive, group, differentiable=True)
    assert forced.requires_grad
    forced.sum().backward()
    return True


@pytest.mark.parametrize("n", [2, 3, 4])
def test_all_to_all_forward_and_backward(multirank: Any, n: int) -> None:
    with multirank(POOL) as w:
        assert w.run(_all_to_all_checks, n)[:n] == [True] * n


class _Brackets:
    """A trip timer that records its brackets: ``("start", device type)`` and ``"stop"``."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def start(self, device: torch.device) -> None:
        self.events.append(("start", device.type))

    def stop(self) -> None:
        self.events.append("stop")


def _timed_backward_checks() -> list[list[Any]]:
    """The brackets of each exchange's timer after its forward, then after its backward."""
    group = subgroup(2)
    rank = dist.get_rank()
    if rank >= 2:
        return []
    seen = []
    x = torch.ones(3, 2, requires_grad=True)
    timer = _Brackets()
    splits = [1, 2] if rank == 0 else [2, 1]  # two rows each way, one kept
    y = all_to_all(x, splits, splits, group, differentiable=True, timer=timer)
    seen.append(list(timer.events))
    y.sum().backward()
    seen.append(list(timer.events))
    timer = _Brackets()
    # Each rank sends its first row to the other and keeps the other two, ahead of the one it gets.
    other = (0, 1) if rank == 0 else (1, 0)
    trip = exchange.PixelTrip(
        rows=3,
        local=((1, 3),),
        local_at=0,
        sent=((0, 1),),
        send_splits=other,
        receive_splits=other,
        received_at=2,
    )
    batch = exchange.start_pixel_trip(x, trip, torch.float32, group, differentiable=True, timer=timer).wait()
    seen.append(list(timer.events))
    batch.sum().backward()
    seen.append(list(timer.events))
    return seen


class _CountedClock(TripClock):
    """The balancer's trip clock, counting its brackets."""

    def __init__(self) -> None:
        super().__init__()
        self.brackets = 0

    def start(self, device: torch.device) -> None:
        self.brackets += 1
        super().start(device)


def _balancer_brackets(overlap: bool) -> list[int]:
    """A balanced call's trip brackets after its forward and after its backward, with pixels
    that need no gradient, then with pixels that do."""
    group = subgroup(2)
    if dist.get_rank() >= 2:
        return []
    torch.manual_seed(0)
    tower = towers.TensorTower()
    grids = [(1, 8, 8), (1, 8, 8), (1, 4, 4)] if dist.get_rank() == 0 else [(1, 2, 2)]
    pixels, grid = towers.make_batch(grids, seed=dist.get_rank())
    balancer = ViTBalancer(ViTBalanceConfig(trigger_threshold=0.0, overlap_pixel_trip=overlap), group)
    counts = []
    for needs_grad in (False, True):
        clock = balancer._trips = _CountedClock()
        out = balancer(tower, pixels.clone().requires_grad_(needs_grad), grid)
        assert balancer.last_stats is not None and balancer.last_stats.applied
        counts.append(clock.brackets)
        out.sum().backward()
        counts.append(clock.brackets)
    return counts


@pytest.mark.parametrize("overlap", [False, True])
def test_the_balancer_times_every_trip_forward_and_backward(multirank: Any, overlap: bool) -> None:
    """Forward: the pixel trip, packing the return buffer, the return trip; backward: the return
    trip's exchange, and the pixel trip's when the pixels need gradients."""
    with multirank(POOL) as w:
        results = w.run(_balancer_brackets, overlap)[:2]
    assert results == [[3, 4, 3, 5]] * 2, results


def test_a_timer_brackets_the_backward_exchanges_only(multirank: Any) -> None:
    """The balancer times its forward trips itself; the timer given to an exchange brackets its
    backward, once (balancer.py gives both trips its TripClock)."""
    with multirank(POOL) as w:
        results = w.run(_timed_backward_checks)[:2]
    for seen in results:
        assert seen == [[], [("start", "cpu"), "stop"]] * 2, seen


def _gather_checks(n: int) -> list[Any] | None:
    group = subgroup(n)
    rank = dist.get_rank()
    if rank >= n:
        return None
    grids = [(1 + rank, 2 * (i + 1), 4) for i in range(rank + 1)]  # rank r has r+1 images
    out = []
    for capacity in (64, 2):
        local = RankMetadata(
            status=InputProblem.PIXEL_ROWS if rank == 1 else InputProblem.OK,
            details=(7, 9) if rank == 1 else (),
            channels=12 + rank,
            dtype_code=DTYPES.index(torch.bfloat16),
            requires_grad=rank == 0,
            grids=() if rank == 1 else tuple(grids),
        )
        metadata, collectives = gather_metadata(
            local,
            capacity=capacity,
            device=collective_device(group, torch.device("cpu")),
            group=group,
        )
        out.append((collectives, metadata))
    return out


def test_a_backward_exchange_that_fails_tells_its_rank_why() -> None:
    """A rank whose backward pass waits in an exchange the others never join (they made another
    balanced call first) got the backend's bare timeout, while the ranks in that call were told
    the cause: it is told too. A size mismatch or closed connection reads alike."""
    trips = []

    def exchanged(tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        trips.append(tensor.shape)
        if len(trips) > 1:  # the backward pass's
            raise RuntimeError("Timed out waiting 20000ms for send operation to complete")
        return tensor.clone()

    with mock.patch.object(exchange, "_exchange", side_effect=exchanged):
        rows = exchange.all_to_all(torch.ones(3, 2), [3], [3], None, differentiable=True)
        with pytest.raises(RuntimeError) as raised:
            rows.sum().backward()
    message = str(raised.value)
    assert message.startswith(
        "ViTBalancer: the backward pass of a balanced call failed on this rank (Timed out waiting "
        "20000ms for send operation to complete): a rank that ran it while the others made another "
        "call, or that skipped it, leaves them waiting; every rank of the group must make the same "
        "balanced calls"
    ), message
    assert type(raised.value) is RuntimeError and len(trips) == 2


def _pixel_trip_backward_failing() -> str | None:
    """A balanced call's backward pass whose second exchange (the pixel trip's, after the return
    trip's) fails on every rank, as a timeout or a closed connection would."""
    group = subgroup(2)
    rank = dist.get_rank()
    if rank >= 2:
        return None
    torch.manual_seed(0)
    tower = towers.TensorTower()
    pixels, grid = towers.make_batch([[(1, 8, 8), (1, 8, 8)], [(1, 2, 2)]][rank], seed=rank)
    balancer = ViTBalancer(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0), group)
    out = balancer(tower, pixels.requires_grad_(True), grid)
    assert balancer.last_stats is not None and balancer.last_stats.applied
    real, trips = exchange._exchange, []

    def second_fails(*args: Any) -> torch.Tensor:
        trips.append(args[0].shape)
        if len(trips) == 2:
            raise RuntimeError("Connection closed by peer")
        return real(*args)

    with mock.patch.object(exchange, "_exchange", side_effect=second_fails), caught(RuntimeError) as outcome:
        out.sum().backward()
    return outcome.message


def test_a_pixel_trips_backward_exchange_that_fails_tells_its_rank_why(multirank: Any) -> None:
    with multirank(POOL) as w:
        messages = w.run(_pixel_trip_backward_failing)[:2]
    for message in messages:
        told = "ViTBalancer: the backward pass of a balanced call failed on this rank (Connection closed"
        assert message.startswith(told), message


def test_a_metadata_gather_that_met_another_gathers_row_says_so_before_reading_it() -> None:
    """Rank 1 in the status gather of a call given a plan made ahead while rank 0 starts a call:
    gloo delivered its status word into rank 0's metadata gather, whose output digest read as
    billions of grid runs (a second gather of that size failed with an overflow TypeError)."""
    local = RankMetadata(0, (), 12, 0, False, ((1, 4, 4),), (7, 9))
    own = exchange.metadata_row(local, exchange.grid_runs(local.grids), 4).numpy()
    status_word = np.zeros_like(own)
    status_word[:3] = [0, 3592004472611365212, 1]  # flag, output digest, output count
    negative, unknown = own.copy(), own.copy()
    negative[1], unknown[0] = -1, 99  # runs, input status
    cases = [([own, status_word], 1), ([negative, own], 0), ([unknown, own], 0)]
    for rows, rank in cases:
        gathered = mock.patch.object(exchange, "_gathered_array", return_value=np.stack(rows))
        message = rf"^ranks \[{rank}\] sent rows that are no balanced call's metadata"
        with gathered, pytest.raises(RuntimeError, match=message):
            exchange.gather_metadata(local, capacity=4, device=torch.device("cpu"), group=None)


def test_gather_metadata(multirank: Any) -> None:
    """One all_gather carries headers and grid rows; an extra one only when a rank overflows."""
    n = 4
    with multirank(POOL) as w:
        per_rank = w.run(_gather_checks, n)
    assert all(r == per_rank[0] for r in per_rank)
    (small_collectives, metadata), (big_collectives, metadata_overflow) = per_rank[0]
    assert small_collectives == 1 and big_collectives == 2  # rank 3 has 4 images > capacity 2
    assert metadata == metadata_overflow
    for rank, m in enumerate(metadata):
        assert m.channels == 12 + rank and DTYPES[m.dtype_code] == torch.bfloat16
        assert m.requires_grad == (rank == 0)
        if rank == 1:
            assert (m.status, m.details, m.grids) == (InputProblem.PIXEL_ROWS, (7, 9, 0, 0), ())
        else:
            assert m.status == 0 and m.grids == tuple((1 + rank, 2 * (i + 1), 4) for i in range(rank + 1))
            assert m.patch_counts == tuple((1 + rank) * 2 * (i + 1) * 4 for i in range(rank + 1))


def _device_checks() -> list[str]:
    return [
        str(collective_device(None, torch.device("cpu"))),
        str(collective_device(None, torch.device("meta"))),
        str(collective_device(None, None)),
    ]


def test_collective_device_for_gloo(multirank: Any) -> None:
    with multirank(POOL) as w:
        assert w.run(_device_checks)[0] == ["cpu", "cpu", "cpu"]


def test_describe_problem_messages_are_distinct_and_specific() -> None:
    details = {
        InputProblem.PIXELS_NOT_TENSOR: (INPUT_KINDS.index("a numpy.ndarray"),),
        InputProblem.GRID_SHAPE: (2, 5, 2),
        InputProblem.GRID_DTYPE: (DTYPES.index(torch.float32),),
        InputProblem.GRID_VALUE: (3, 1, 0, 4),
        InputProblem.PIXELS_SHAPE: (3,),
        InputProblem.PIXELS_DTYPE: (DTYPES.index(torch.int64),),
        InputProblem.PIXEL_ROWS: (10, 12),
        InputProblem.NOT_DIVISIBLE: (1, 4, 6, 4),
        InputProblem.DEVICE: (2, 0),
        InputProblem.CHANNELS_MISMATCH: (6, 0, 12),
        InputProblem.DTYPE_MISMATCH: (DTYPES.index(torch.float64), 0, DTYPES.index(torch.float32)),
    }
    fragments = {
        InputProblem.GRID_NOT_TENSOR: "grid_thw is None, not a torch.Tensor",
        InputProblem.GRID_SHAPE: "shape (5, 2)",
        InputProblem.GRID_DTYPE: "torch.float32",
        InputProblem.GRID_VALUE: "grid_thw[3] = [1, 0, 4]",
        InputProblem.PIXELS_NOT_TENSOR: "pixel_values is a numpy.ndarray, not a torch.Tensor",
        InputProblem.PIXELS_SHAPE: "3 dims",
        InputProblem.PIXELS_DTYPE: "torch.int64",
        InputProblem.PIXEL_ROWS: "10 rows: expected sum(T*H*W) over grid_thw = 12",
        InputProblem.NOT_DIVISIBLE: "H=4, W=6: expected both divisible by the ViT's spatial merge size 4",
        InputProblem.DEVICE: "meta device: the process group's backend carries cpu tensors",
        InputProblem.CHANNELS_MISMATCH: "C=6 channels while rank 0 has C=12",
        InputProblem.DTYPE_MISMATCH: "torch.float64 while rank 0 has torch.float32",
        InputProblem.NOT_COMBINED: "its images and videos could not be encoded together (that rank's own",
    }
    messages = {code: describe_problem(code, details.get(code, ())) for code in InputProblem if code}
    assert len(set(messages.values())) == len(messages)
    wrong_gpu = describe_problem(InputProblem.DEVICE, (1, 1, 1, 0))
    assert "pixel_values is on cuda:1: expected the current device cuda:0" in wrong_gpu
    # Told by the device types (the indices alike here), a grid's extra dimensions, a CSR layout.
    on_cpu = describe_problem(InputProblem.DEVICE, (0, 1, 0, 0))
    assert "pixel_values is on a cpu device: the process group's backend carries cuda tensors" in on_cpu
    assert "grid_thw has shape () (4 dims)" in describe_problem(InputProblem.GRID_SHAPE, (4, 2, 3, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CSR support is in beta
        assert layout_code(torch.eye(2).to_sparse_csr()) == LAYOUTS.index("sparse")
    for code, fragment in fragments.items():
        assert fragment in messages[code], (code, messages[code])


def test_an_input_that_is_not_a_tensor_is_named_by_what_it_is() -> None:
    import numpy as np

    grid = torch.tensor([[1, 2, 2]])
    given = {None: "None", True: "a bool", 3: "an int", "x": "a str", (1,): "a tuple", object: "an object of"}
    for value, says in [*given.items(), ([[1, 2, 2]], "a list"), (np.zeros((1, 3)), "a numpy.ndarray")]:
        found = validate_input(torch.zeros(4, 3), value, 2, None, check_device=False)
        assert f"grid_thw is {says}" in describe_problem(found.status, found.details), value
        found = validate_input(value, grid, 2, None, check_device=False)
        assert f"pixel_values is {says}" in describe_problem(found.status, found.details), value


def test_pixels_no_backend_carries_and_grids_whose_products_wrap_are_input_problems() -> None:
    """float8 rows passed as floating; grids whose T*H*W wrapped int64 passed with 4 pixel rows."""
    grid = torch.tensor([[1, 2, 2]])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int64):
        found = validate_input(torch.zeros(4, 3).to(dtype), grid, 2, None, check_device=False)
        assert found.status == InputProblem.PIXELS_DTYPE
        message = describe_problem(found.status, found.details)
        assert "expected float32, float16, bfloat16 or float64" in message
        assert f"pixel_values has dtype {dtype}:" in message
    for wraps in ([[2**32, 2, 2**31], [1, 2, 2]], [[1, 2**32, 2**32]], [[2**60, 2, 1], [2**60, 2, 1]]):
        found = validate_input(torch.zeros(4, 3), torch.tensor(wraps), 2, None, check_device=False)
        assert found.status == InputProblem.GRID_VALUE, wraps
        assert "below 2**62" in describe_problem(found.status, found.details)


def test_route_from_plan() -> None:
    counts = ((4, 16, 9), (), (1, 1))
    destinations = ((2, 0, 2), (), (0, 2))
    plan = RebalancePlan(
        applied=True,
        reason="applied",
        solver="seed",
        patch_counts=counts,
        destinations=destinations,
        image_costs=tuple(tuple(float(n * n) for n in row) for row in counts),
        loads_before=(353.0, 0.0, 2.0),
        loads_after=(257.0, 0.0, 98.0),
    )
    route = ExchangeRoute.from_plan(plan, 0)
    assert route.send_order == (1, 0, 2)  # by destination, then index
    assert route.send_patches == (16, 0, 13) and route.receive_patches == (16, 0, 1)
    assert route.arrivals == ((0, 1), (2, 0))
    empty = ExchangeRoute.from_plan(plan, 1)
    assert empty.send_order == () and empty.arrivals == () and empty.send_patches == (0, 0, 0)
    last = ExchangeRoute.from_plan(plan, 2)
    assert last.arrivals == ((0, 0), (0, 2), (2, 1)) and last.receive_patches == (13, 0, 1)


def test_grid_steps_gives_each_temporal_step_a_row_like_frames_as_items() -> None:
    grid = torch.tensor([[2, 4, 6], [1, 2, 2], [3, 8, 4]])
    steps = grid_steps(grid)
    assert steps.tolist() == [[1, 4, 6], [1, 4, 6], [1, 2, 2], [1, 8, 4], [1, 8, 4], [1, 8, 4]]
    assert grid.tolist() == [[2, 4, 6], [1, 2, 2], [3, 8, 4]]  # the caller's grid is left alone
    metadata = RankMetadata(0, (), 12, 0, False, tuple(map(tuple, grid.tolist())))
    assert metadata.frames_as_items().grids == tuple(map(tuple, steps.tolist()))
    # A grid the input checks reject comes back unchanged, so the error names the caller's rows.
    bad = torch.tensor([[0, 4, 4], [2, 2, 2]])
    assert grid_steps(bad) is bad


#: Groups of the 8-rank pool for the doubling gather: 1, 2, 3, 5, 6, 7 and 8 ranks (powers of two
#: and not), and the odd ranks, whose group ranks differ from their global ranks.
_GATHER_GROUPS: dict[str, list[int]] = {
    **{f"first {k}": list(range(k)) for k in (1, 2, 3, 5, 6, 7, 8)},
    "odd": [1, 3, 5, 7],
}
_MADE_GROUPS: dict[str, Any] = {}


def _doubling_checks() -> list[tuple[str, bool]]:
    """Every group of :data:`_GATHER_GROUPS`: rows gathered in doubling rounds equal
    ``dist.all_gather``'s, in rank order, for int64 rows and uint8 rows of another shape, the first
    round posted before the row's owner waits (as the status gather does)."""
    for name, ranks in _GATHER_GROUPS.items():  # created on every rank, in one order
        if name not in _MADE_GROUPS:
            _MADE_GROUPS[name] = dist.new_group(ranks)
    rank = dist.get_rank()
    checked = []
    for name, ranks in _GATHER_GROUPS.items():
        if rank not in ranks:
            continue
        group = _MADE_GROUPS[name]
        for row in (
            torch.arange(5, dtype=torch.int64) + 100 * rank,
            torch.full((2, 3), rank, dtype=torch.uint8),
        ):
            expected = [torch.empty_like(row) for _ in ranks]
            dist.all_gather(expected, row, group=group)
            pending = _DoublingRows(row, group)
            torch.manual_seed(rank)  # some work of this rank's own while the first round is in flight
            torch.randn(64, 64).sum()
            checked.append((name, torch.equal(pending.wait(), torch.stack(expected))))
    return checked


def test_row_gather_in_doubling_rounds_equals_all_gather(multirank: Any) -> None:
    """Bruck's rounds (``ceil(log2 P)`` of them) give what gloo's ring all_gather gives, on groups of
    1-8 ranks and on a group whose ranks are not the first ones."""
    with multirank(8) as w:
        per_rank = w.run(_doubling_checks)
    for rank, checked in enumerate(per_rank):
        names = {name for name, ranks in _GATHER_GROUPS.items() if rank in ranks}
        assert {name for name, _ in checked} == names
        assert all(ok for _, ok in checked), (rank, checked)


def _with_doubling_from(ranks: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a worker with host row gathers taking doubling rounds from ``ranks`` ranks."""
    saved = exchange.DOUBLING_FROM_RANKS
    exchange.DOUBLING_FROM_RANKS = ranks
    try:
        return fn(*args)
    finally:
        exchange.DOUBLING_FROM_RANKS = saved


def _gather_kinds() -> list[str]:
    row = torch.tensor([dist.get_rank()])
    kinds = []
    for group in (None, subgroup(7)):
        if group is None or dist.get_rank() < 7:
            pending = exchange.start_row_gather(row, group)
            kinds.append(type(pending).__name__)
            assert pending.wait().flatten().tolist() == list(range(dist.get_world_size(group)))
            # Kept past its wait, works and buffers: gloo's worker thread, which lets go of a work a
            # moment later, must not free the last references as the interpreter exits (an abort).
            assert exchange._RECENT_GATHERS[-1] is pending
    return kinds


def _kept_gathers_hold_no_hooked_tensor() -> list[bool]:
    """Whether a tensor that saved-tensor hooks hold (as non-reentrant activation checkpointing's
    hold a checkpointed call's inputs) outlives a row gather started under them, ring and doubling."""
    alive = []
    for kind in ("ring", "doubling"):
        held = torch.randn(64)
        kept = weakref.ref(held)

        def pack(value: torch.Tensor, held: torch.Tensor = held) -> torch.Tensor:
            return value

        with torch.autograd.graph.saved_tensors_hooks(pack, pack):
            pending = exchange.start_row_gather(torch.tensor([dist.get_rank()]), None)
            assert type(pending).__name__ == ("_RingRows" if kind == "ring" else "_DoublingRows")
            pending.wait()
            # The hooks are back in place for the rest of the call.
            assert exchange._top_saved_tensor_hooks()[0] is pack
        assert exchange._RECENT_GATHERS[-1] is pending  # kept past the call, as before
        del held, pack, pending
        gc.collect()
        alive.append(kept() is not None)
        exchange.DOUBLING_FROM_RANKS = 1  # the next round: doubling
    return alive


def test_kept_gathers_do_not_hold_a_checkpointed_calls_inputs(multirank: Any) -> None:
    """A gather's work captures the thread's autograd state; kept past the call, it held the saved-
    tensor hooks' tensors (a skipped checkpointed call's pixel rows) into the next step."""
    try:
        exchange._top_saved_tensor_hooks()
        torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    except (AttributeError, TypeError, RuntimeError):  # the package starts the works as they are
        pytest.skip("this torch's saved-tensor hook stack is not one the package can set aside")
    with multirank(8) as w:
        per_rank = w.run(_with_doubling_from, sys.maxsize, _kept_gathers_hold_no_hooked_tensor)
    assert per_rank == [[False, False]] * 8, per_rank


def test_row_gather_takes_doubling_rounds_from_its_threshold(multirank: Any) -> None:
    """Host rows: one ring all_gather below :data:`DOUBLING_FROM_RANKS` ranks, doubling rounds from it."""
    with multirank(8) as w:
        per_rank = w.run(_with_doubling_from, 8, _gather_kinds)
    assert per_rank == [["_DoublingRows", "_RingRows"]] * 7 + [["_DoublingRows"]]
    # Below it the ring's C++ hops (10-30 us each) cost less than Python rounds (20-40 us more each).
    assert exchange.DOUBLING_FROM_RANKS >= 8


def test_balanced_calls_with_doubling_gathers_equal_the_direct_call(multirank: Any) -> None:
    """The metadata and status gathers in doubling rounds (as from 16 ranks on): outputs and
    gradients as the direct call on 8 ranks, plans made in the forward and ahead."""
    with multirank(8) as w:
        for tower, config, prepared in (
            ("window", {"trigger_threshold": 0.0}, False),
            ("qwen2_5_vl", {}, True),
        ):
            per_rank = w.run(_with_doubling_from, 2, many_ranks_suite, tower, config, prepared)
            assert all(any(r["applied"] for r in results) for results in per_rank)
            assert len({tuple(r["applied"] for r in results) for results in per_rank}) == 1


def test_vit_exception_with_doubling_gathers(multirank: Any) -> None:
    """A ViT that raises on one rank: the status details gathered in doubling rounds name it on
    every rank, as with the ring."""
    with multirank(POOL) as w:
        results = w.run(_with_doubling_from, 2, vit_case, "raise", 1)[:3]
    assert results[1]["kind"] == "OutOfMemoryError", results[1]
    assert {r["kind"] for r in (results[0], results[2])} == {"OutOfMemoryError"}
    assert results[0]["message"] == results[2]["message"] and "rank 1" in results[0]["message"]


def _sharded_zero_checks() -> list[bool]:
    """Gradients of ``DTensor`` parameters sharded over every rank (rows split by rank): all zero;
    one row off zero on the last rank only; NaN on the last rank only (a max all-reduce of gloo's
    dropped it); no gradient; and an empty shard on the last rank (fewer rows than ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    size, last = dist.get_world_size(), dist.get_rank() == dist.get_world_size() - 1
    mesh = init_device_mesh("cpu", (size,))
    params = [
        torch.nn.Parameter(distribute_tensor(torch.ones(rows, 2), mesh, [Shard(0)]))
        for rows in (size, size, size, size, size - 1)
    ]
    shards = [torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), None, torch.zeros(int(not last), 2)]
    if last:
        shards[1][0, 1] = 1e-30
        shards[2][0, 0] = float("nan")
    for param, shard in zip(params, shards):
        if shard is not None:
            param.grad = DTensor.from_local(shard, mesh, [Shard(0)], shape=param.shape, stride=param.stride())
    return sharded_grads_all_zero(params)


def test_sharded_gradients_are_zero_only_where_every_rank_says_so(multirank: Any) -> None:
    with multirank(POOL) as w:
        results = w.run(_sharded_zero_checks)
    assert results == [[True, False, False, True, True]] * POOL, results


def test_ranks_that_fail_alike_are_named_once() -> None:
    """On 512 ranks out of memory alike, the message held the same text 512 times."""
    from lightning_vit_balance.encoding import by_ranks

    texts = [
        (0, "the ViT raised A"),
        (1, "the ViT raised B"),
        (2, "the ViT raised A"),
        (3, "the ViT raised A"),
    ]
    assert by_ranks(texts) == ["ranks [0, 2, 3]: the ViT raised A", "rank 1: the ViT raised B"]
    assert by_ranks([]) == []
