"""The seed's solver, written once: LPT, then move/swap refinement between two ranks.

:func:`solve_lpt` is the ``"lpt"`` solver (``"seed"`` is its alias): images, largest cost first
(ties by source rank, then index), each go to the lightest rank (ties: lowest rank) whose patches
stay within the cap, or to the lightest rank when none has room. Then, up to
``config.refine_iterations`` times while ``(max - min) / min >= config.refine_tolerance``, the one
move or swap between the heaviest and the lightest rank (ties: lowest rank) that most lowers the
larger of their two loads is made; the first such in scan order wins (the heaviest rank's images in
the order it received them, each as a move, then as a swap with each cheaper image of the lightest
rank). It skips when one image costs more than the mean rank load.

The locality solver uses the same LPT and refinement as its reference plan, see
:func:`lpt_reference`, and the refinement (:func:`refine`, with two stricter switches) to finish
its own candidates.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import numpy as np

from lightning_vit_balance.config import ViTBalanceConfig
from lightning_vit_balance.solvers import tuning
from lightning_vit_balance.solvers.batch import Batch, Destinations, add_up, first_of_alike, rank_patches
from lightning_vit_balance.solvers.roomheap import RoomHeap

__all__ = ["lpt", "lpt_blocks", "lpt_reference", "refine", "relabel", "solve_lpt"]


def solve_lpt(batch: Batch, config: ViTBalanceConfig) -> Destinations | str:
    """The seed's solver: destinations, or ``"single-image-dominates"`` when it skips."""
    if max(batch.cost) > add_up(batch.loads) / batch.num_ranks:
        return "single-image-dominates"
    cap = batch.cap(config.max_len_ratio)
    dest, loads = lpt(batch, cap)
    refine(batch, dest, loads, cap, config, seed_rules=True)
    return dest


def lpt_reference(batch: Batch, config: ViTBalanceConfig, cap: float | None) -> Destinations:
    """The seed's plan with its bins renamed to the home ranks they overlap most.

    Renaming ranks changes no load, only which rows move; the locality solver measures its own
    candidates against this plan's makespan when the lower bound is out of reach.
    """
    dest, loads = lpt(batch, cap)
    refine(batch, dest, loads, cap, config, seed_rules=True)
    return relabel(batch, dest)


def lpt(batch: Batch, cap: float | None) -> tuple[Destinations, list[float]]:
    """The seed's LPT: destinations and each rank's load, summed in assignment order.

    A heap of ``(load, rank)``; under a cap, ranks without room for the image are set aside for
    it. Without a cap and with many images, :func:`lpt_blocks` gives the same assignment and
    the same floats at a few numpy calls per block of ranks.
    """
    if cap is None and batch.size > tuning.VECTORISE_ABOVE:
        arrays = batch.arrays
        load = np.zeros(batch.num_ranks)
        dest = np.empty(batch.size, dtype=np.int64)
        lpt_blocks(arrays.order, arrays.cost, load, dest)
        return dest, load.tolist()
    if cap is not None:
        return _lpt_capped(batch, math.floor(cap))
    cost = batch.cost
    dest = [0] * batch.size
    heap = [(0.0, r) for r in range(batch.num_ranks)]
    for k in batch.order:
        load, r = heap[0]
        heapq.heapreplace(heap, (load + cost[k], r))
        dest[k] = r
    loads = [0.0] * batch.num_ranks
    for load, r in heap:
        loads[r] = load
    return dest, loads


def _lpt_capped(batch: Batch, cap: int) -> tuple[Destinations, list[float]]:
    """:func:`lpt` under a cap of ``cap`` patches (the cap rounded down: patch counts are whole,
    so ``held + patches > cap`` either way): each image to the lightest rank with room for it,
    else, when no rank has, to the lightest of all."""
    cost, patches = batch.cost, batch.patches
    load = [0.0] * batch.num_ranks
    room = [cap] * batch.num_ranks
    ranks = RoomHeap(load, room)
    dest = [0] * batch.size
    for k in batch.order:
        r = ranks.lightest(patches[k])
        if r is None:
            r = ranks.lightest_of_all()
        load[r] += cost[k]
        room[r] -= patches[k]
        ranks.room_changed(r)
        dest[k] = r
    return dest, load


def lpt_blocks(items: np.ndarray, cost: np.ndarray, load: np.ndarray, dest: np.ndarray) -> None:
    """LPT of ``items`` (largest first) onto ranks holding ``load``, in numpy blocks; in place.

    A block gives its ``i``-th image to the ``i``-th lightest rank (ties: lowest rank), which is
    what the heap does for as long as every rank that received an image in the block stays
    heavier than the next rank in line; the block ends before the first image for which that
    fails. Same assignment and floats as the heap.
    """
    start = 0
    while start < items.size:
        width = min(items.size - start, load.size)
        ranks = np.argsort(load, kind="stable")[:width]
        block = items[start : start + width]
        after = load[ranks] + cost[block]
        # Image i may follow the images before it in the block only if all of their ranks are
        # now strictly heavier than rank i was.
        lowest_after = np.minimum.accumulate(after)
        fails = np.flatnonzero(load[ranks][1:] >= lowest_after[:-1])
        take = int(fails[0]) + 1 if fails.size else width
        dest[block[:take]] = ranks[:take]
        load[ranks[:take]] = after[:take]
        start += take


def refine(
    batch: Batch,
    dest: Destinations,
    loads: list[float],
    cap: float | None,
    config: ViTBalanceConfig,
    seed_rules: bool,
    good_enough: float = 0.0,
) -> int:
    """The seed's move/swap refinement; updates ``dest`` and ``loads`` in place, returns the
    number of steps made.

    Scoring: a move or swap between the heaviest and the lightest rank scores the larger of their
    two loads after it. Selection: the lowest score, the first in scan order, if it beats the
    current makespan by more than :data:`~tuning.REFINE_MIN_STEP`. A rank's images are scanned in
    the order LPT would have placed them (largest first), then those moved in by earlier steps.

    ``seed_rules=True`` is the seed exactly: the cap is checked on the lightest rank only, and
    refinement goes on while steps improve the pair. ``False`` (the locality solver's finish)
    also keeps the heaviest rank within the cap after a swap, and stops once another rank is as
    heavy as the heaviest, since the pairwise steps would then move rows for nothing.
    It also stops once the makespan is at most ``good_enough`` (the seed never does: 0).
    """
    members = _Members(batch, dest)
    held = rank_patches(batch, dest) if cap is not None else [0] * batch.num_ranks
    # With many ranks (the numpy variants) the loads go in an array: the extremes are found in C.
    work = np.array(loads) if isinstance(dest, np.ndarray) else loads
    steps = config.refine_iterations
    for step in range(config.refine_iterations):
        high, low, heavy, light = _extremes(work)
        if high <= good_enough or (low > 0 and (high - low) / low < config.refine_tolerance):
            steps = step
            break
        heavy_ids, light_ids = members.of(heavy), members.of(light)
        pair = _Pair(high, low, held[heavy], held[light], cap, both_sides=not seed_rules)
        a, b = _best_step(batch, heavy_ids, light_ids, pair) if heavy_ids else (-1, -1)
        if a < 0 or (not seed_rules and _ties(work, high)):
            steps = step
            break
        for k, src, dst in _apply_step(heavy_ids, light_ids, a, b, heavy, light):
            dest[k] = dst
            work[src] -= batch.cost[k]
            work[dst] += batch.cost[k]
            held[src] -= batch.patches[k]
            held[dst] += batch.patches[k]
    if work is not loads:
        loads[:] = work.tolist()
    return steps


def _extremes(loads: list[float] | np.ndarray) -> tuple[float, float, int, int]:
    """The largest and smallest load and their ranks (ties: the lowest rank)."""
    if isinstance(loads, np.ndarray):
        heavy, light = int(loads.argmax()), int(loads.argmin())
        return float(loads[heavy]), float(loads[light]), heavy, light
    high, low = max(loads), min(loads)
    return high, low, loads.index(high), loads.index(low)


def _ties(loads: list[float] | np.ndarray, high: float) -> bool:
    """Whether more than one rank carries the load ``high``."""
    if isinstance(loads, np.ndarray):
        return int(np.count_nonzero(loads == high)) > 1
    return loads.count(high) > 1


class _Pair(NamedTuple):
    """The heaviest and the lightest rank of a refinement step, and the cap rule."""

    high: float
    low: float
    held_heavy: int
    held_light: int
    cap: float | None
    both_sides: bool

    def fits(self, grow: int) -> bool:
        """Whether the lightest rank may take ``grow`` more patches (and, with ``both_sides``,
        the heaviest rank ``-grow`` more). Compared as the seed does: ``patches + grow <= cap``."""
        if self.cap is None:
            return True
        if self.held_light + grow > self.cap:
            return False
        return not self.both_sides or self.held_heavy - grow <= self.cap


def _best_step(batch: Batch, heavy_ids: list[int], light_ids: list[int], pair: _Pair) -> tuple[int, int]:
    """The best step: ``(a, b)``, indices into the two member lists; ``b = -1`` for a move,
    ``a = -1`` when no step improves on the makespan."""
    cost, patches = batch.cost, batch.patches
    high, low, cap = pair.high, pair.low, pair.cap
    light_costs = [cost[k] for k in light_ids]
    best_a, best_b = -1, -1
    bar = high - tuning.REFINE_MIN_STEP  # a step must score below this
    # Of the heaviest rank's images alike in cost and patches only the first is tried.
    for a in first_of_alike((cost[k], patches[k]) for k in heavy_ids):
        ka = heavy_ids[a]
        ca = cost[ka]
        # A move only adds to the lightest rank, whatever both_sides says.
        if cap is None or pair.held_light + patches[ka] <= cap:
            peak = max(high - ca, low + ca)
            if peak < bar:
                bar, best_a, best_b = peak - tuning.REFINE_MIN_STEP, a, -1
        for b, cb in enumerate(light_costs):
            if cb >= ca:
                continue
            peak = max(high - ca + cb, low + ca - cb)
            if peak < bar and (cap is None or pair.fits(patches[ka] - patches[light_ids[b]])):
                bar, best_a, best_b = peak - tuning.REFINE_MIN_STEP, a, b
    return best_a, best_b


def _apply_step(
    heavy_ids: list[int], light_ids: list[int], a: int, b: int, heavy: int, light: int
) -> list[tuple[int, int, int]]:
    """Update the member lists for a step: ``(image, from, to)`` of the moved image(s)."""
    moved = heavy_ids.pop(a)
    light_ids.append(moved)
    transfers = [(moved, heavy, light)]
    if b >= 0:
        back = light_ids.pop(b)
        heavy_ids.append(back)
        transfers.append((back, light, heavy))
    return transfers


class _Members:
    """Each rank's images in the refinement's scan order, gathered on the first step that reads
    them.

    Steps only touch the two ranks they read, so a rank first read at a later step still holds
    exactly its images of the start, in LPT order.
    """

    def __init__(self, batch: Batch, dest: Destinations) -> None:
        self._batch = batch
        self._dest = dest
        self._lists: dict[int, list[int]] = {}

    def of(self, rank: int) -> list[int]:
        found = self._lists.get(rank)
        if found is None:
            if isinstance(self._dest, np.ndarray):
                # Many images: gather this rank's alone, in C.
                here = np.flatnonzero(self._dest == rank)
                found = self._lists[rank] = here[np.argsort(self._batch.arrays.rank[here])].tolist()
            else:
                self._gather_all()
                found = self._lists[rank]
        return found

    def _gather_all(self) -> None:
        lists: list[list[int]] = [[] for _ in range(self._batch.num_ranks)]
        for k in self._batch.order:
            lists[self._dest[k]].append(k)
        self._lists = dict(enumerate(lists))


def relabel(batch: Batch, dest: Destinations) -> Destinations:
    """Rename bins so each lands on a home rank it shares many patches with.

    Rounds of a greedy matching on (bin, home) pairs, best overlap (patches) first, ties by bin
    then home: every unmatched bin proposes to its best free home, each home takes its best
    proposal; bins left over get the free ranks in order. In Python for few images, in numpy
    (the same rounds, a few calls each) for many.
    """
    if isinstance(dest, np.ndarray):
        return _relabel_arrays(batch, dest)
    if batch.size > tuning.VECTORISE_ABOVE:  # a list from the capped heaps: the numpy rounds too
        return _relabel_arrays(batch, np.array(dest, dtype=np.int64)).tolist()
    num_ranks = batch.num_ranks
    overlap: dict[int, int] = {}
    for d, h, n in zip(dest, batch.home, batch.patches):
        key = d * num_ranks + h
        overlap[key] = overlap.get(key, 0) + n
    pairs = sorted(overlap, key=lambda key: (-overlap[key], key))
    rank_of_bin = [-1] * num_ranks
    taken = [False] * num_ranks
    for _ in range(tuning.RELABEL_ROUNDS):
        proposals: dict[int, int] = {}  # bin -> position of its best free pair
        for at, key in enumerate(pairs):
            b, h = divmod(key, num_ranks)
            if rank_of_bin[b] < 0 and not taken[h] and b not in proposals:
                proposals[b] = at
        if not proposals:
            break
        won: dict[int, int] = {}  # home -> its best proposal
        for at in sorted(proposals.values()):
            won.setdefault(pairs[at] % num_ranks, pairs[at])
        for h, key in won.items():
            rank_of_bin[key // num_ranks] = h
            taken[h] = True
    free = iter([r for r in range(num_ranks) if not taken[r]])
    rank_of_bin = [r if r >= 0 else next(free) for r in rank_of_bin]
    return [rank_of_bin[d] for d in dest]


def _relabel_arrays(batch: Batch, bins_of: np.ndarray) -> np.ndarray:
    """:func:`relabel` for many images: each round is a few numpy calls."""
    arrays, num_ranks = batch.arrays, batch.num_ranks
    keys, inverse = np.unique(bins_of * num_ranks + arrays.home, return_inverse=True)
    overlap = np.bincount(inverse, weights=arrays.patches)
    order = np.lexsort((keys, -overlap))
    bins, homes = np.divmod(keys[order], num_ranks)
    rank_of_bin = np.full(num_ranks, -1, dtype=np.int64)
    taken = np.zeros(num_ranks, dtype=bool)
    for _ in range(tuning.RELABEL_ROUNDS):
        free = np.flatnonzero((rank_of_bin[bins] < 0) & ~taken[homes])
        if free.size == 0:
            break
        _, first = np.unique(bins[free], return_index=True)
        proposals = np.sort(free[first])  # the best free pair of each bin, best first
        _, first = np.unique(homes[proposals], return_index=True)
        won = proposals[first]
        rank_of_bin[bins[won]] = homes[won]
        taken[homes[won]] = True
    unmatched = rank_of_bin < 0
    rank_of_bin[unmatched] = np.flatnonzero(~taken)[: int(unmatched.sum())]
    return rank_of_bin[bins_of]
