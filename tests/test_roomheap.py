"""The lightest rank with room (:mod:`lightning_vit_balance.solvers.roomheap`), and the capped
heuristics that use it, against plain scans."""

from __future__ import annotations

import heapq

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_vit_balance import CostModel
from lightning_vit_balance.planning import _validate_patch_counts
from lightning_vit_balance.solvers import Batch, tuning
from lightning_vit_balance.solvers.locality import _place_once, home_first, shed_and_place
from lightning_vit_balance.solvers.roomheap import RoomHeap

SETTINGS = settings(
    max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@SETTINGS
@given(
    start=st.lists(
        st.tuples(st.sampled_from([0.0, 1.0, 2.0, 5.0]), st.integers(0, 12)), min_size=1, max_size=9
    ),
    steps=st.lists(
        st.tuples(
            st.integers(0, 14), st.sampled_from([0.0, 1.0, 3.0]), st.integers(-3, 3), st.integers(0, 8)
        ),
        max_size=40,
    ),
)
def test_lightest_is_the_lowest_load_and_rank_among_ranks_with_room(
    start: list[tuple[float, int]], steps: list[tuple[int, float, int, int]]
) -> None:
    # As the heuristics use it: ask for the lightest rank with room, grow its load (or another
    # rank's, when none has room), change its room and another rank's; equal loads included.
    load = [float(value) for value, _ in start]
    room = [float(value) for _, value in start]
    ranks = RoomHeap(load, room)
    for need, grow, change, other in steps:
        with_room = [r for r in range(len(load)) if room[r] >= need]
        expected = min(with_room, key=lambda r: (load[r], r)) if with_room else None
        assert ranks.lightest(need) == expected
        r = expected if expected is not None else other % len(load)
        if expected is None:
            assert ranks.lightest_of_all() == min(range(len(load)), key=lambda j: (load[j], j))
        load[r] += grow
        room[r] -= need
        ranks.room_changed(r)
        other %= len(load)
        room[other] += change
        ranks.room_changed(other)


def _home_first_by_popping(batch: Batch, target: float, cap: float) -> list[int]:
    """:func:`home_first` under a cap as it was: every full rank popped off the heap and pushed
    back for every image."""
    cost, patches, home = batch.cost, batch.patches, batch.home
    limit = target * (1.0 + tuning.EPS)
    load, dest, pinned = [0.0] * batch.num_ranks, list(home), batch.pinned(cap)
    room = [cap - n for n in batch.rank_patches]
    for k in range(batch.size):
        if pinned[k]:
            load[home[k]] += cost[k]
    heap = [(load[r], r) for r in range(batch.num_ranks)]
    heapq.heapify(heap)
    for k in batch.order:
        if pinned[k]:
            continue
        c, h = cost[k], home[k]
        if load[h] + c <= limit:
            load[h] += c
            continue
        room[h] += patches[k]
        full = []
        while heap:
            top_load, top = heap[0]
            if top_load != load[top]:
                heapq.heapreplace(heap, (load[top], top))
            elif room[top] < patches[k]:
                full.append(heapq.heappop(heap))
            else:
                break
        r = heap[0][1] if heap else h
        load[r] += c
        if heap:
            heapq.heapreplace(heap, (load[r], r))
        for item in full:
            heapq.heappush(heap, item)
        dest[k] = r
        room[r] -= patches[k]
    return dest


counts_strategy = st.lists(st.lists(st.integers(1, 40), max_size=6), min_size=2, max_size=10)


@SETTINGS
@given(
    counts=counts_strategy, ratio=st.sampled_from([0.6, 1.0, 1.3, 2.0]), aim=st.sampled_from([0.9, 1.0, 1.1])
)
def test_capped_home_first_places_as_the_popping_heap_did(
    counts: list[list[int]], ratio: float, aim: float
) -> None:
    batch = Batch.build(_validate_patch_counts(counts), CostModel())
    if not batch.size:
        return
    cap = batch.cap(ratio)
    target = batch.lower_bound * aim
    assert home_first(batch, target, cap) == _home_first_by_popping(batch, target, cap)


@SETTINGS
@given(counts=counts_strategy, ratio=st.sampled_from([0.6, 1.0, 1.3, 2.0]))
def test_capped_shed_and_place_keeps_every_receiver_within_the_cap(
    counts: list[list[int]], ratio: float
) -> None:
    # Its placement under the cap now looks at the ranks with room only: a rank that receives an
    # image still never ends above the cap, and an image with no room anywhere stays home.
    batch = Batch.build(_validate_patch_counts(counts), CostModel())
    if not batch.size:
        return
    cap = batch.cap(ratio)
    dest = shed_and_place(batch, batch.lower_bound, cap)
    held = [0] * batch.num_ranks
    for k, d in enumerate(dest):
        held[d] += batch.patches[k]
    receivers = {d for k, d in enumerate(dest) if d != batch.home[k]}
    assert all(held[r] <= cap * (1.0 + 1e-9) for r in receivers)


def _place_once_by_popping(batch: Batch, shed: list[int], dest: list[int], cap: float) -> list[int]:
    """:func:`~lightning_vit_balance.solvers.locality._place_once` under a cap as it was."""
    cost, patches, home = batch.cost, batch.patches, batch.home
    shed_cost = [0.0] * batch.num_ranks
    for k in shed:
        shed_cost[home[k]] += cost[k]
    heap = [(load - taken, r) for r, (load, taken) in enumerate(zip(batch.loads, shed_cost))]
    heapq.heapify(heap)
    held = list(batch.rank_patches)
    for k in shed:
        held[home[k]] -= patches[k]
    room = [cap - n for n in held]
    stayed = []
    for k in shed:
        full = []
        while heap and room[heap[0][1]] < patches[k]:
            full.append(heapq.heappop(heap))
        if heap:
            top, r = heapq.heappop(heap)
            heapq.heappush(heap, (top + cost[k], r))
            dest[k] = r
        else:
            r = dest[k]
            stayed.append(k)
            full = [(top + cost[k] if rr == r else top, rr) for top, rr in full]
        room[r] -= patches[k]
        for item in full:
            heapq.heappush(heap, item)
    return stayed


@SETTINGS
@given(counts=counts_strategy, ratio=st.sampled_from([0.6, 1.0, 1.3]), pick=st.integers(0, 2**16))
def test_capped_placement_places_as_the_popping_heap_did(
    counts: list[list[int]], ratio: float, pick: int
) -> None:
    batch = Batch.build(_validate_patch_counts(counts), CostModel())
    shed = [k for k in batch.order if (pick >> (k % 16)) & 1]  # some images, largest first
    cap = batch.cap(ratio)
    dest, expected = list(batch.home), list(batch.home)
    assert _place_once(batch, shed, dest, cap) == _place_once_by_popping(batch, shed, expected, cap)
    assert dest == expected
