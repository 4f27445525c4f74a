"""Planning: which rank encodes which image. Pure Python and numpy, no torch.distributed.

Every rank calls :func:`plan_rebalance` on the same gathered patch counts and gets the same
:class:`RebalancePlan` (no broadcast needed): the solvers are deterministic, with ties broken by
rank and image index, never by hash or dict order.

Two solvers:

* ``"seed"``: the seed's algorithm, straightforwardly (LPT, then move/swap refinement between the
  heaviest and the lightest rank; skips when one image outweighs the mean load). Slow at large
  ``P`` on purpose: it re-sorts every rank for every image, as the seed does; kept for comparison.
* ``"locality"`` (default): builds a few candidate plans and keeps the one that moves the fewest
  pixel rows among those whose makespan is within ``_SLACK`` (0.4%) of the lower bound
  ``max(total / P, largest image)`` or, when that is out of reach, of the best makespan found
  (including the seed's own algorithm), so it does not exceed the seed's makespan by more than
  0.4% (empty-rank fix-ups aside).
  The candidates:

  - *home-first LPT*: images largest first; an image stays on its own rank while that rank stays
    within the target, otherwise it goes to the currently lightest rank. Small images come last
    and fill the gaps, so the makespan stays close to LPT's while most images never move. Exact
    (a heap) up to ``_VECTORISE_ABOVE`` images, in numpy blocks of images above, plus coarser
    blocks for small batches (fewer rows, coarser balance);
  - *shed and place*: every rank above the target sheds its largest images (cost per row grows
    with ``l``, so they shed the most cost per byte), finishing with the smallest image that
    covers the rest of its excess; shed images go, largest first, to the lightest rank;
  - when none of those reaches the lower bound within the slack: the seed's algorithm made fast
    (the same LPT, in numpy blocks, and the same refinement), its bins renamed to the home ranks
    they overlap most, and home-first retried against its makespan.

  Every candidate gets a few move/swap refinements between the heaviest and the lightest rank,
  and then every rank that must hold an image gets one (see :class:`RebalancePlan`).

Patch cap (``config.max_len_ratio``): both solvers give an image to a rank only if the rank's
patches stay within ``cap = mean_patches_per_rank * max_len_ratio``; the locality solver also
sheds from a rank above the cap. When no rank has room the seed gives the image to the lightest
rank and the locality solver keeps it at home. An image larger than the cap on its own never
fits anywhere: the locality solver keeps it at home (moving it would only move the overflow), so
its rank exceeds the cap by that image alone, and sheds every other image of that rank that fits
elsewhere. One exception: a rank that must hold an image and would otherwise be idle may be given a
single image larger than the cap when no other image is left. With a cap the locality solver
always takes its exact (Python) paths.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain
from typing import Any

import numpy as np

from lightning_vit_balance.config import ViTBalanceConfig
from lightning_vit_balance.cost import CostModel

__all__ = ["REASONS", "RebalancePlan", "plan_rebalance"]

#: Every value :attr:`RebalancePlan.reason` takes, with its meaning. Stable: logged as metrics.
REASONS: dict[str, str] = {
    "applied": "images were redistributed",
    "disabled": "balancing is turned off in the config",
    "single-rank": "only one data-parallel rank",
    "no-images": "no rank has an image",
    "below-threshold": "imbalance max/mean - 1 is below config.trigger_threshold",
    "single-image-dominates": "seed solver: one image costs more than the mean rank load",
    "no-gain": "the best plan lowers the makespan by less than config.min_gain",
}

# The locality solver accepts a plan whose makespan is within this fraction of the best makespan
# it found (or of the lower bound) when that plan moves fewer pixel rows: 0.4% keeps it inside
# the "at most 0.5% above the seed" with room for rounding.
_SLACK = 0.004
# Relative tolerance for "a rank is above the target": loads are sums of floats.
_EPS = 1e-9
# Above this many images (and without a patch cap) the locality solver uses its numpy variants.
_VECTORISE_ABOVE = 512
# Home-first is retried against the seed-level target only when it came this close to it.
_RELAX_WITHIN = 0.01
# Up to this many images (no cap) the chosen plan gets a pass that sends moved images home.
_BRING_HOME_UP_TO = 512
_BRING_HOME_PASSES = 3
_BRING_HOME_CANDIDATES = 5
# Proposal rounds when relabelling LPT bins to home ranks.
_RELABEL_ROUNDS = 8


@dataclass(frozen=True)
class RebalancePlan:
    """Where every image of every data-parallel rank is encoded. A value: compare, hash, log it.

    Attributes:
        applied: Whether images move. When ``False`` every image stays on its own rank.
        reason: Why, one of :data:`REASONS`.
        solver: The solver that produced it (``"locality"`` or ``"seed"``).
        patch_counts: ``patch_counts[r][i]``: patches (``T*H*W``) of rank ``r``'s ``i``-th image.
        destinations: ``destinations[r][i]``: the rank that encodes rank ``r``'s ``i``-th image.
        image_costs: ``image_costs[r][i]``: cost of that image under the plan's cost model.
        loads_before: Cost per rank with every image at home.
        loads_after: Cost per rank under ``destinations``, each summed over the rank's arrivals in
            order (so recomputing it the same way gives the same floats).

    A destination rank receives its images ordered by (source rank, image index): that is the
    order of the balanced batch it encodes, see :meth:`arrivals`.

    When an applied plan comes from the locality solver and there are at least as many images as
    ranks, every rank encodes at least one image; with fewer images, every rank that had an image
    still encodes one.
    """

    applied: bool
    reason: str
    solver: str
    patch_counts: tuple[tuple[int, ...], ...]
    destinations: tuple[tuple[int, ...], ...]
    image_costs: tuple[tuple[float, ...], ...]
    loads_before: tuple[float, ...]
    loads_after: tuple[float, ...]

    @property
    def num_ranks(self) -> int:
        """Number of data-parallel ranks."""
        return len(self.patch_counts)

    @property
    def imbalance_before(self) -> float:
        """``max(load) / mean(load) - 1`` with every image at home (0 when there is no load)."""
        return _imbalance(self.loads_before)

    @property
    def imbalance_after(self) -> float:
        """``max(load) / mean(load) - 1`` under the plan."""
        return _imbalance(self.loads_after)

    @property
    def makespan_before(self) -> float:
        """Largest rank cost with every image at home."""
        return max(self.loads_before, default=0.0)

    @property
    def makespan_after(self) -> float:
        """Largest rank cost under the plan."""
        return max(self.loads_after, default=0.0)

    @cached_property
    def lower_bound(self) -> float:
        """No plan's makespan is below ``max(total / P, largest image cost)``."""
        if not self.loads_before:
            return 0.0
        largest = max((max(c) for c in self.image_costs if c), default=0.0)
        return max(sum(self.loads_before) / len(self.loads_before), largest)

    @cached_property
    def moved_images(self) -> int:
        """Images encoded away from their own rank."""
        return sum(d != r for r, dests in enumerate(self.destinations) for d in dests)

    @cached_property
    def moved_patches(self) -> int:
        """Patches (pixel rows) sent to another rank."""
        return sum(
            n
            for r, (dests, counts) in enumerate(zip(self.destinations, self.patch_counts))
            for d, n in zip(dests, counts)
            if d != r
        )

    @cached_property
    def moved_patches_lower_bound(self) -> float:
        """Fewest patches any plan with a makespan of at most :attr:`makespan_after` must move.

        Each rank whose load exceeds that makespan must send away at least the excess in cost.
        Taking its images in order of cost per patch (largest first for ``l**2``), fractionally,
        until the excess is covered gives the fewest patches that can carry that much cost (a
        fractional knapsack, so a bound, not always attainable). Summed over ranks.
        """
        target = self.makespan_after * (1.0 + _EPS)
        bound = 0.0
        for load, costs, counts in zip(self.loads_before, self.image_costs, self.patch_counts):
            excess = load - target
            if excess <= 0:
                continue
            for cost, count in sorted(zip(costs, counts), key=lambda cn: (-cn[0] / cn[1], cn[1])):
                if cost >= excess:
                    bound += count * excess / cost
                    break
                bound += count
                excess -= cost
        return bound

    @cached_property
    def total_patches(self) -> int:
        """Patches over all ranks."""
        return sum(sum(c) for c in self.patch_counts)

    @cached_property
    def _arrivals_by_rank(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        arrivals: list[list[tuple[int, int]]] = [[] for _ in self.patch_counts]
        for src, dests in enumerate(self.destinations):
            for i, d in enumerate(dests):
                arrivals[d].append((src, i))
        return tuple(tuple(a) for a in arrivals)

    def arrivals(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(source_rank, image_index)`` of every image ``rank`` encodes, in balanced-batch order."""
        return self._arrivals_by_rank[rank]

    def send_patches(self, rank: int) -> tuple[int, ...]:
        """``send_patches(r)[d]``: patches rank ``r`` sends to rank ``d`` (its own included)."""
        out = [0] * self.num_ranks
        for d, n in zip(self.destinations[rank], self.patch_counts[rank]):
            out[d] += n
        return tuple(out)

    def receive_patches(self, rank: int) -> tuple[int, ...]:
        """``receive_patches(r)[s]``: patches rank ``r`` receives from rank ``s``."""
        out = [0] * self.num_ranks
        for src, i in self.arrivals(rank):
            out[src] += self.patch_counts[src][i]
        return tuple(out)


def _imbalance(loads: Sequence[float]) -> float:
    if not loads:
        return 0.0
    mean = sum(loads) / len(loads)
    return max(loads) / mean - 1.0 if mean > 0 else 0.0


@dataclass(frozen=True)
class _Batch:
    """The gathered batch, flat: image ``k`` is rank ``home[k]``'s image ``k - starts[home[k]]``."""

    counts: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]  # [P + 1] offset of each rank's first image
    home: np.ndarray  # [n] int64
    patches: np.ndarray  # [n] int64
    cost: np.ndarray  # [n] float64
    loads: np.ndarray  # [P] float64, summed in image order

    @property
    def num_ranks(self) -> int:
        return len(self.counts)

    def rows(self, flat: list[Any]) -> tuple[tuple[Any, ...], ...]:
        """Split a flat per-image list back into one tuple per rank."""
        return tuple(map(tuple, map(flat.__getitem__, map(slice, self.starts, self.starts[1:]))))


def _bad_row(rank: int, row: object) -> None:
    raise ValueError(f"patch_counts[{rank}]={row!r} is invalid: expected a sequence of positive ints.")


def _validate_patch_counts(patch_counts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    if isinstance(patch_counts, (str, bytes)) or not isinstance(patch_counts, Sequence):
        raise ValueError(
            f"patch_counts must be a sequence (one entry per rank) of sequences of ints, "
            f"got {type(patch_counts).__name__}."
        )
    if len(patch_counts) == 0:
        raise ValueError("patch_counts must have one entry per rank, got an empty sequence (0 ranks).")
    if set(map(type, patch_counts)) & {str, bytes}:
        bad = next(r for r, row in enumerate(patch_counts) if isinstance(row, (str, bytes)))
        _bad_row(bad, patch_counts[bad])
    try:
        rows = list(map(tuple, patch_counts))
    except TypeError:
        bad = next(r for r, row in enumerate(patch_counts) if not hasattr(row, "__iter__"))
        _bad_row(bad, patch_counts[bad])
    flat = list(chain.from_iterable(rows))
    # Fast path: plain positive Python ints (what the exchange layer hands over).
    if set(map(type, flat)) <= {int} and min(flat, default=1) > 0:
        return tuple(rows)
    for r, row in enumerate(rows):
        for i, n in enumerate(row):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
                raise ValueError(f"patch_counts[{r}][{i}]={n!r} is invalid: expected a positive int (T*H*W).")
    return tuple(tuple(int(n) for n in row) for row in rows)


def _build_batch(patch_counts: Sequence[Sequence[int]], model: Callable[[Any], Any]) -> _Batch:
    counts = _validate_patch_counts(patch_counts)
    lengths = [len(row) for row in counts]
    starts = (0, *accumulate(lengths))
    patches = np.fromiter(chain.from_iterable(counts), dtype=np.int64, count=starts[-1])
    home = np.repeat(np.arange(len(counts), dtype=np.int64), lengths)
    cost = np.asarray(model(patches.astype(np.float64)), dtype=np.float64).reshape(-1)
    if cost.shape != patches.shape or not np.all(np.isfinite(cost)) or np.any(cost < 0):
        raise ValueError(
            f"cost_model must map an array of {patches.size} patch counts to as many finite costs "
            f">= 0, got {cost.size} values with min {cost.min(initial=0.0)!r}."
        )
    # bincount sums each rank's images in image order, the order ``arrivals`` lists them in.
    loads = np.bincount(home, weights=cost, minlength=len(counts))
    return _Batch(counts, starts, home, patches, cost, loads)


def plan_rebalance(
    patch_counts: Sequence[Sequence[int]],
    config: ViTBalanceConfig | None = None,
    *,
    cost_model: Callable[[Any], Any] | None = None,
) -> RebalancePlan:
    """Plan which rank encodes each image.

    Args:
        patch_counts: ``patch_counts[r][i]`` is ``T*H*W`` of rank ``r``'s ``i``-th image or video;
            one entry per data-parallel rank, any of them may be empty.
        config: Solver, thresholds and cost model; default ``ViTBalanceConfig()``.
        cost_model: Overrides the config's cost coefficients with any vectorised callable
            mapping an array of patch counts to costs (e.g. a fitted model).

    Returns:
        The plan. Skipped plans (``applied=False``) keep every image at home; ``reason`` says why
        (see :data:`REASONS`). Skip rules, in order: disabled, one rank, no images, imbalance
        below ``config.trigger_threshold``; then the seed solver skips when one image costs more
        than the mean load, and the locality solver when its plan lowers the makespan by less
        than ``config.min_gain`` of the unbalanced makespan.

    Raises:
        ValueError: ``patch_counts`` is not a non-empty sequence of sequences of positive ints, or
            ``cost_model`` does not return one finite non-negative cost per image.
    """
    config = config if config is not None else ViTBalanceConfig()
    model = cost_model if cost_model is not None else CostModel.from_config(config)
    batch = _build_batch(patch_counts, model)
    costs = batch.rows(batch.cost.tolist())
    loads = tuple(batch.loads.tolist())

    def skip(reason: str) -> RebalancePlan:
        return RebalancePlan(
            applied=False,
            reason=reason,
            solver=config.solver,
            patch_counts=batch.counts,
            destinations=batch.rows(batch.home.tolist()),
            image_costs=costs,
            loads_before=loads,
            loads_after=loads,
        )

    if not config.enabled:
        return skip("disabled")
    if batch.num_ranks == 1:
        return skip("single-rank")
    if batch.cost.size == 0:
        return skip("no-images")
    if _imbalance(loads) < config.trigger_threshold:
        return skip("below-threshold")
    if config.solver == "seed":
        outcome = _solve_seed(batch.counts, costs, loads, config)
        if isinstance(outcome, str):
            return skip(outcome)
        dest = np.fromiter(chain.from_iterable(outcome), dtype=np.int64, count=batch.cost.size)
    else:
        dest = _solve_locality(batch, config)
    new_loads = np.bincount(dest, weights=batch.cost, minlength=batch.num_ranks)
    if config.solver != "seed":
        before = float(batch.loads.max())
        gain = (before - float(new_loads.max())) / before if before > 0 else 0.0
        # A plan that does not lower the makespan is never worth an exchange, whatever min_gain.
        if gain < config.min_gain or gain <= 0.0:
            return skip("no-gain")
    return RebalancePlan(
        applied=True,
        reason="applied",
        solver=config.solver,
        patch_counts=batch.counts,
        destinations=batch.rows(dest.tolist()),
        image_costs=costs,
        loads_before=loads,
        loads_after=tuple(new_loads.tolist()),
    )


Assignment = tuple[tuple[int, ...], ...]


def _solve_seed(
    counts: tuple[tuple[int, ...], ...],
    costs: tuple[tuple[float, ...], ...],
    loads: tuple[float, ...],
    config: ViTBalanceConfig,
) -> Assignment | str:
    """The seed's solver, straightforwardly: LPT, then move/swap refinement.

    Returns the destinations, or a skip reason. Images are ordered by cost descending, ties by
    (source rank, index); each goes to the lightest rank (ties: lowest rank) that stays within the
    patch cap, or to the lightest rank when none does. Then, up to ``refine_iterations`` times while
    ``(max - min) / min >= refine_tolerance``, the single move or swap between the heaviest and the
    lightest rank (ties: lowest rank) that most lowers the larger of the two loads is made (the
    first such in scan order: heaviest rank's images in order, each as a move then as a swap with
    each cheaper image of the lightest rank).
    """
    num_ranks = len(counts)
    mean_load = sum(loads) / num_ranks
    if max(max(c) for c in costs if c) > mean_load:
        return "single-image-dominates"
    cap = _patch_cap(counts, config)
    images = sorted(
        ((c, r, i) for r, row in enumerate(costs) for i, c in enumerate(row)),
        key=lambda item: (-item[0], item[1], item[2]),
    )
    rank_load = [0.0] * num_ranks
    rank_patches = [0] * num_ranks
    members: list[list[tuple[float, int, int]]] = [[] for _ in range(num_ranks)]
    dest = [[0] * len(row) for row in counts]
    for cost, r, i in images:
        # The seed re-sorts the ranks by load for every image.
        order = sorted(range(num_ranks), key=lambda k: (rank_load[k], k))
        fitting = [k for k in order if cap is None or rank_patches[k] + counts[r][i] <= cap]
        target = fitting[0] if fitting else order[0]
        rank_load[target] += cost
        rank_patches[target] += counts[r][i]
        members[target].append((cost, r, i))
        dest[r][i] = target
    for _ in range(config.refine_iterations):
        heavy = max(range(num_ranks), key=lambda k: (rank_load[k], -k))
        light = min(range(num_ranks), key=lambda k: (rank_load[k], k))
        low, high = rank_load[light], rank_load[heavy]
        if low > 0 and (high - low) / low < config.refine_tolerance:
            break
        best_peak = high
        best_move: tuple[int, int] | None = None  # (index in heavy, index in light or -1)
        for a, (ca, ra, ia) in enumerate(members[heavy]):
            if _fits(cap, rank_patches[light] + counts[ra][ia]):
                peak = max(high - ca, low + ca)
                if peak < best_peak - 1e-12:
                    best_peak, best_move = peak, (a, -1)
            for b, (cb, rb, ib) in enumerate(members[light]):
                if cb >= ca:
                    continue
                moved = counts[ra][ia] - counts[rb][ib]
                if not _fits(cap, rank_patches[light] + moved):
                    continue
                peak = max(high - ca + cb, low + ca - cb)
                if peak < best_peak - 1e-12:
                    best_peak, best_move = peak, (a, b)
        if best_move is None:
            break
        a, b = best_move
        transfers = [(members[heavy].pop(a), heavy, light)]
        if b >= 0:
            transfers.append((members[light].pop(b), light, heavy))
        for (cost, r, i), src, dst in transfers:
            members[dst].append((cost, r, i))
            dest[r][i] = dst
            rank_load[src] -= cost
            rank_load[dst] += cost
            rank_patches[src] -= counts[r][i]
            rank_patches[dst] += counts[r][i]
    return tuple(tuple(row) for row in dest)


def _patch_cap(counts: tuple[tuple[int, ...], ...], config: ViTBalanceConfig) -> float | None:
    if config.max_len_ratio is None:
        return None
    return sum(sum(row) for row in counts) / len(counts) * config.max_len_ratio


def _fits(cap: float | None, patches: float) -> bool:
    return cap is None or patches <= cap


def _block_lpt(items: np.ndarray, cost: np.ndarray, load: np.ndarray, dest: np.ndarray) -> None:
    """LPT (each image, largest first, to the lightest rank; ties: lowest rank) in numpy blocks.

    ``items`` (sorted largest first) go onto ranks with ``load``; ``dest`` and ``load`` are
    updated in place. A block gives its ``i``-th image to the ``i``-th lightest rank, which is
    what LPT does for as long as every rank that received an image in the block stays heavier
    than the next rank in line; the block ends before the first image for which that fails. Same
    assignment as the heap, at a few numpy calls per block.
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


@dataclass
class _Candidate:
    dest: np.ndarray  # [n] destination rank of each image
    makespan: float
    moved_patches: int


class _LocalitySolver:
    """Shared state of the locality solver's candidate plans for one batch."""

    def __init__(self, batch: _Batch, config: ViTBalanceConfig) -> None:
        self.batch = batch
        self.config = config
        self.num_ranks = batch.num_ranks
        self.cap = (
            None
            if config.max_len_ratio is None
            else float(batch.patches.sum()) / self.num_ranks * config.max_len_ratio
        )
        self.rank_patches = np.bincount(batch.home, weights=batch.patches, minlength=self.num_ranks)
        # Images larger than the cap fit nowhere: they stay at home.
        self.pinned = (
            batch.patches > self.cap if self.cap is not None else np.zeros(batch.cost.size, dtype=bool)
        )
        # Images largest first, ties by image index.
        self.cost_order = np.lexsort((np.arange(batch.cost.size), -batch.cost))
        self.cost_rank = np.empty_like(self.cost_order)
        self.cost_rank[self.cost_order] = np.arange(batch.cost.size)
        # Ranks that must encode at least one image in an applied plan.
        has_images = np.diff(np.asarray(batch.starts)) > 0
        self.must_hold = (
            np.ones(self.num_ranks, dtype=bool) if batch.cost.size >= self.num_ranks else has_images
        )

    @cached_property
    def cost_list(self) -> list[float]:
        """Image costs as Python floats, for the loops."""
        return self.batch.cost.tolist()

    @cached_property
    def patch_list(self) -> list[int]:
        """Image patch counts as Python ints, for the loops."""
        return self.batch.patches.tolist()

    def finish(self, dest: np.ndarray) -> _Candidate:
        """Refine ``dest`` in place, give empty ranks an image, and measure it."""
        batch = self.batch
        rank_load = np.bincount(dest, weights=batch.cost, minlength=self.num_ranks)
        rank_patches = np.bincount(dest, weights=batch.patches, minlength=self.num_ranks)
        self.refine(dest, rank_load, rank_patches, self.config.refine_tolerance)
        self.fill_empty_ranks(dest)
        loads = np.bincount(dest, weights=batch.cost, minlength=self.num_ranks)
        moved = int(batch.patches[dest != batch.home].sum())
        return _Candidate(dest, float(loads.max()), moved)

    def cap_excess(self, dest: np.ndarray) -> float:
        """Patches above the cap on ranks that receive images and hold more than one.

        A rank holding a single image is exempt: the image may be larger than the cap, and giving
        an otherwise idle rank one image comes first.
        """
        if self.cap is None:
            return 0.0
        batch = self.batch
        away = dest != batch.home
        rank_patches = np.bincount(dest, weights=batch.patches, minlength=self.num_ranks)
        receiving = np.bincount(dest[away], minlength=self.num_ranks) > 0
        counted = receiving & (np.bincount(dest, minlength=self.num_ranks) > 1)
        return float(np.maximum(rank_patches[counted] - self.cap * (1.0 + _EPS), 0.0).sum())

    def bring_home(self, candidate: _Candidate, limit: float) -> _Candidate:
        """Fewer rows at the same quality: send moved images home, alone or in a swap.

        Up to ``_BRING_HOME_PASSES`` passes over the images away from home, largest first: move
        one home if its home stays within ``limit``; else swap it with the image on its home rank
        that saves the most rows and keeps both ranks within ``limit``. No cap.
        """
        batch = self.batch
        home, cost, patches = batch.home.tolist(), self.cost_list, self.patch_list
        dest = candidate.dest.tolist()
        load = np.bincount(candidate.dest, weights=batch.cost, minlength=self.num_ranks).tolist()
        members: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for k, d in enumerate(dest):
            members[d].append(k)
        must_hold = self.must_hold.tolist()
        changed = False
        for _ in range(_BRING_HOME_PASSES):
            away = sorted((k for k, d in enumerate(dest) if d != home[k]), key=lambda k: (-patches[k], k))
            changed_now = False
            for k in away:
                h, d = home[k], dest[k]
                if d == h:
                    continue
                if load[h] + cost[k] <= limit and (len(members[d]) > 1 or not must_hold[d]):
                    partner = -1
                else:
                    best_saving, partner = 0, -2
                    for j in members[h]:
                        saving = patches[k] - (patches[j] if home[j] == h else 0)
                        saving += patches[j] if home[j] == d else 0
                        if (
                            saving > best_saving
                            and load[h] + cost[k] - cost[j] <= limit
                            and load[d] - cost[k] + cost[j] <= limit
                        ):
                            best_saving, partner = saving, j
                    if partner == -2:
                        continue
                members[d].remove(k)
                members[h].append(k)
                dest[k] = h
                load[h] += cost[k]
                load[d] -= cost[k]
                if partner >= 0:
                    members[h].remove(partner)
                    members[d].append(partner)
                    dest[partner] = d
                    load[h] -= cost[partner]
                    load[d] += cost[partner]
                changed_now = True
            changed |= changed_now
            if not changed_now:
                break
        if not changed:
            return candidate
        out = np.asarray(dest, dtype=np.int64)
        loads = np.bincount(out, weights=batch.cost, minlength=self.num_ranks)
        return _Candidate(out, float(loads.max()), int(batch.patches[out != batch.home].sum()))

    def shed_and_place(self, target: float) -> _Candidate:
        """Shed every rank down to ``target`` (and the cap), place the shed images, finish.

        Each rank above the target sheds by :meth:`_shed_rank` (largest images first: the fewest
        rows for the cost); the shed images then go, largest first, to the lightest rank with
        room (see :meth:`_place`).
        """
        batch = self.batch
        cost, patches, cap = self.cost_list, self.patch_list, self.cap
        limit = target * (1.0 + _EPS)
        dest = batch.home.copy()
        over = batch.loads > limit
        if cap is not None:
            over |= self.rank_patches > cap
        # Each rank's images, largest first (ties by index), as slices of one flat list.
        held = self.cost_order[np.argsort(batch.home[self.cost_order], kind="stable")].tolist()
        shed: list[int] = []
        for r in np.flatnonzero(over).tolist():
            ids = held[batch.starts[r] : batch.starts[r + 1]]
            if cap is not None:
                ids = [k for k in ids if not self.pinned[k]]
            dropped = self._shed_rank(ids, float(batch.loads[r]) - limit, cost, patches)
            if cap is not None:
                excess = float(self.rank_patches[r]) - sum(patches[k] for k in dropped) - cap
                rest = sorted((k for k in ids if k not in dropped), key=lambda k: (-patches[k], k))
                dropped |= self._shed_rank(rest, excess, patches, patches)
            shed.extend(dropped)
        if shed:
            shed_arr = np.asarray(shed, dtype=np.int64)
            shed_arr = shed_arr[np.lexsort((shed_arr, -batch.cost[shed_arr]))]
            rank_load = batch.loads.copy()
            rank_patches = self.rank_patches.copy()
            shed_home = batch.home[shed_arr]
            rank_load -= np.bincount(shed_home, weights=batch.cost[shed_arr], minlength=self.num_ranks)
            rank_patches -= np.bincount(shed_home, weights=batch.patches[shed_arr], minlength=self.num_ranks)
            self._place(shed_arr.tolist(), dest, rank_load, rank_patches)
        return self.finish(dest)

    def home_first_lpt(self, target: float) -> _Candidate:
        """LPT that keeps an image at home while its home rank stays within ``target``.

        Images, largest first, stay on their own rank when it has room below ``target`` (and the
        cap); the others go to the lightest rank with room, as in LPT. Small images come last and
        fill the gaps, so the makespan stays close to LPT's while most images never move.
        """
        batch = self.batch
        cost, patches, cap = self.cost_list, self.patch_list, self.cap
        home = batch.home.tolist()
        limit = target * (1.0 + _EPS)
        load = [0.0] * self.num_ranks
        # Pinned images (over the cap) are at home from the start.
        dest = batch.home.copy()
        # Each rank's room under the cap starts with all of its own images reserved; an image
        # that leaves frees its rows. So a rank that receives never ends above the cap.
        unlimited = [float("inf")] * self.num_ranks
        room = (cap - self.rank_patches).tolist() if cap is not None else unlimited
        for k in np.flatnonzero(self.pinned).tolist():
            load[home[k]] += cost[k]
        heap = [(load[r], r) for r in range(self.num_ranks)]
        heapq.heapify(heap)
        for k in self.cost_order.tolist():
            if self.pinned[k]:
                continue
            c, h = cost[k], home[k]
            if load[h] + c <= limit:
                # Loads only grow, so the heap entry of ``h`` is now too low; it is refreshed
                # when it reaches the top.
                load[h] += c
                continue
            room[h] += patches[k]
            popped = []
            while heap:
                top_load, top = heap[0]
                if top_load != load[top]:
                    heapq.heapreplace(heap, (load[top], top))
                elif room[top] < patches[k]:
                    popped.append(heapq.heappop(heap))
                else:
                    break
            r = heap[0][1] if heap else h
            load[r] += c
            room[r] -= patches[k]
            if heap:
                heapq.heapreplace(heap, (load[r], r))
            for item in popped:
                heapq.heappush(heap, item)
            dest[k] = r
        return self.finish(dest)

    def _place(
        self, shed: list[int], dest: np.ndarray, rank_load: np.ndarray, rank_patches: np.ndarray
    ) -> None:
        """Give each of ``shed`` (largest first), in turn, to the lightest rank with room for it.

        ``rank_load`` and ``rank_patches`` are the loads without the shed images; ``dest`` is
        updated in place.
        """
        cost, patches, cap = self.cost_list, self.patch_list, self.cap
        heap = list(zip(rank_load.tolist(), range(self.num_ranks)))
        heapq.heapify(heap)
        room = (cap - rank_patches).tolist() if cap is not None else None
        for k in shed:
            if room is None:
                load, r = heap[0]
                heapq.heapreplace(heap, (load + cost[k], r))
                dest[k] = r
                continue
            popped = []
            while heap and room[heap[0][1]] < patches[k]:
                popped.append(heapq.heappop(heap))
            if heap:
                load, r = heapq.heappop(heap)
                heapq.heappush(heap, (load + cost[k], r))
                dest[k] = r
            else:
                # No rank has room: the image stays where it was (that rank is over the cap anyway).
                r = int(dest[k])
                popped = [(load + cost[k] if rr == r else load, rr) for load, rr in popped]
            room[r] -= patches[k]
            for item in popped:
                heapq.heappush(heap, item)

    @staticmethod
    def _shed_rank(ids: list[int], excess: float, size: list[Any], rows: list[int]) -> set[int]:
        """Which of ``ids`` (sorted by ``size`` descending) to shed to cover ``excess`` of size.

        Few pixel rows for the size shed (``rows``): at each step either finish with the image
        that covers what is left in the fewest rows, or shed the largest image that does not and
        go on; the cheapest of those endings wins. Large images carry the most cost per row for
        a convex cost, so this stays close to the fractional bound.
        """
        if excess <= 0:
            return set()
        shed: list[int] = []
        shed_rows = 0
        best: tuple[int, list[int]] | None = None
        pool = ids
        while pool:
            covering = 0
            while covering < len(pool) and size[pool[covering]] >= excess:
                covering += 1
            if covering:
                # Fewest rows; ties: the smallest image (the last in the pool order).
                last = min(range(covering), key=lambda j: (rows[pool[j]], -j))
                if best is None or shed_rows + rows[pool[last]] < best[0]:
                    best = (shed_rows + rows[pool[last]], [*shed, pool[last]])
                pool = pool[covering:]
            if not pool or sum(size[k] for k in pool) < excess:
                break
            shed.append(pool[0])
            shed_rows += rows[pool[0]]
            excess -= size[pool[0]]
            pool = pool[1:]
        return set(best[1]) if best is not None else set(ids)

    def home_first_blocks(self, target: float, block_size: int = 0) -> _Candidate:
        """:meth:`home_first_lpt` vectorised in blocks of ``P`` images (no cap; many images).

        Within a block (images largest first) an image stays home when its home rank's load plus
        the block's earlier images bound for the same home stays within ``target``; the rest of
        the block goes to the lightest ranks by :func:`_block_lpt`.
        """
        batch = self.batch
        cost, home = batch.cost, batch.home
        limit = target * (1.0 + _EPS)
        load = np.zeros(self.num_ranks)
        dest = home.copy()
        order = self.cost_order
        size = block_size or self.num_ranks
        for start in range(0, order.size, size):
            block = order[start : start + size]
            by_home = np.argsort(home[block], kind="stable")
            homes = home[block][by_home]
            running = np.cumsum(cost[block][by_home])
            first = np.ones(homes.size, dtype=bool)
            first[1:] = homes[1:] != homes[:-1]
            group_start = np.maximum.accumulate(np.where(first, np.arange(homes.size), 0))
            before = np.where(group_start > 0, running[group_start - 1], 0.0)
            stays = np.empty(block.size, dtype=bool)
            stays[by_home] = load[homes] + (running - before) <= limit
            load += np.bincount(home[block][stays], weights=cost[block][stays], minlength=self.num_ranks)
            leaving = block[~stays]
            if leaving.size:
                _block_lpt(leaving, cost, load, dest)
        return self.finish(dest)

    def seed_equivalent(self) -> _Candidate:
        """The seed's solver, fast: the same LPT and refinement, bins relabelled to homes.

        Without a cap the LPT runs in numpy blocks (:func:`_block_lpt`), with one a heap that skips
        full ranks; both assign exactly as the seed does and sum each rank's load in the same order,
        so the refinement sees the seed's floats and the seed's member order.
        """
        batch = self.batch
        num_ranks, order = self.num_ranks, self.cost_order
        dest = np.empty(batch.cost.size, dtype=np.int64)
        rank_load = np.zeros(num_ranks)
        if self.cap is None:
            _block_lpt(order, batch.cost, rank_load, dest)
        else:
            self._capped_lpt(dest, rank_load)
        rank_patches = np.bincount(dest, weights=batch.patches, minlength=num_ranks)
        self.refine(dest, rank_load, rank_patches, self.config.refine_tolerance, False, False)
        dest = self.relabel(dest)
        self.fill_empty_ranks(dest)
        loads = np.bincount(dest, weights=batch.cost, minlength=num_ranks)
        moved = int(batch.patches[dest != batch.home].sum())
        return _Candidate(dest, float(loads.max()), moved)

    def _capped_lpt(self, dest: np.ndarray, rank_load: np.ndarray) -> None:
        """The seed's LPT under the cap (lightest rank with room, else lightest), by a heap."""
        cost, patches, cap = self.cost_list, self.patch_list, self.cap
        assert cap is not None
        heap = [(0.0, r) for r in range(self.num_ranks)]
        rank_patches = [0] * self.num_ranks
        for k in self.cost_order.tolist():
            popped = []
            while heap and rank_patches[heap[0][1]] + patches[k] > cap:
                popped.append(heapq.heappop(heap))
            load, r = heapq.heappop(heap) if heap else popped.pop(0)
            heapq.heappush(heap, (load + cost[k], r))
            for item in popped:
                heapq.heappush(heap, item)
            rank_patches[r] += patches[k]
            dest[k] = r
        for load, r in heap:
            rank_load[r] = load

    def refine(
        self,
        dest: np.ndarray,
        rank_load: np.ndarray,
        rank_patches: np.ndarray,
        tolerance: float,
        both_sides: bool = True,
        until_flat: bool = True,
    ) -> None:
        """The seed's move/swap refinement, vectorised per step; updates its arguments in place.

        A rank's images are scanned in the seed's order: the order LPT assigned them (largest
        first), then those moved in by earlier steps. ``both_sides=False`` checks the cap on
        the lightest rank only, as the seed does. ``until_flat`` also stops once a step leaves
        the makespan where it was (many ranks near the top: the pairwise steps move bytes for
        nothing); the seed does not stop there.
        """
        batch, cap = self.batch, self.cap
        members: list[list[int] | None] = [None] * self.num_ranks

        def of(rank: int) -> list[int]:
            found = members[rank]
            if found is None:
                on_rank = np.flatnonzero(dest == rank)
                found = on_rank[np.argsort(self.cost_rank[on_rank])].tolist()
                members[rank] = found
            return found

        for _ in range(self.config.refine_iterations):
            heavy = int(np.argmax(rank_load))
            light = int(np.argmin(rank_load))
            low, high = float(rank_load[light]), float(rank_load[heavy])
            if low > 0 and (high - low) / low < tolerance:
                break
            heavy_ids, light_ids = of(heavy), of(light)
            if not heavy_ids:
                break
            ca = batch.cost[heavy_ids]
            la = batch.patches[heavy_ids]
            peaks = np.full((len(heavy_ids), 1 + len(light_ids)), np.inf)
            move = np.maximum(high - ca, low + ca)
            if cap is not None:
                move[rank_patches[light] + la > cap] = np.inf
            peaks[:, 0] = move
            if light_ids:
                cb = batch.cost[light_ids]
                lb = batch.patches[light_ids]
                swap = np.maximum((high - ca[:, None]) + cb[None, :], (low + ca[:, None]) - cb[None, :])
                valid = cb[None, :] < ca[:, None]
                if cap is not None:
                    valid &= rank_patches[light] + (la[:, None] - lb[None, :]) <= cap
                    if both_sides:
                        # The heaviest rank receives too: it must end within the cap.
                        valid &= rank_patches[heavy] - (la[:, None] - lb[None, :]) <= cap
                peaks[:, 1:] = np.where(valid, swap, np.inf)
            flat = peaks.reshape(-1)
            # The seed keeps the first candidate, in scan order, that beats the best by > 1e-12.
            best_peak, best_at = high, -1
            for at in np.flatnonzero(flat < high - 1e-12).tolist():
                if flat[at] < best_peak - 1e-12:
                    best_peak, best_at = float(flat[at]), at
            if best_at < 0:
                break
            if until_flat and float(np.partition(rank_load, -2)[-2]) >= high:
                # Another rank is as heavy: this step would not lower the makespan.
                break
            a, b = divmod(best_at, 1 + len(light_ids))
            b -= 1
            ka = heavy_ids.pop(a)
            light_ids.append(ka)
            dest[ka] = light
            rank_load[heavy] -= self.cost_list[ka]
            rank_load[light] += self.cost_list[ka]
            rank_patches[heavy] -= self.patch_list[ka]
            rank_patches[light] += self.patch_list[ka]
            if b >= 0:
                kb = light_ids.pop(b)
                heavy_ids.append(kb)
                dest[kb] = heavy
                rank_load[light] -= self.cost_list[kb]
                rank_load[heavy] += self.cost_list[kb]
                rank_patches[light] -= self.patch_list[kb]
                rank_patches[heavy] += self.patch_list[kb]

    def relabel(self, dest: np.ndarray) -> np.ndarray:
        """Rename bins so each lands on a home rank it shares many patches with.

        Rounds of a greedy matching on (bin, home) overlaps: every unmatched bin proposes to its
        best free home, each home takes its best proposal; bins left over get the free ranks in
        order. A few numpy calls per round, for the LPT-based candidates.
        """
        batch, num_ranks = self.batch, self.num_ranks
        keys, inverse = np.unique(dest * num_ranks + batch.home, return_inverse=True)
        overlap = np.bincount(inverse, weights=batch.patches)
        order = np.lexsort((keys, -overlap))
        bins, homes = np.divmod(keys[order], num_ranks)
        rank_of_bin = np.full(num_ranks, -1, dtype=np.int64)
        taken = np.zeros(num_ranks, dtype=bool)
        for _ in range(_RELABEL_ROUNDS):
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
        return rank_of_bin[dest]

    def fill_empty_ranks(self, dest: np.ndarray) -> None:
        """Give every rank that must encode an image one, taken where it costs the least.

        Preferred donors: images within the cap, then the empty rank's own images (they go back
        home), then images already away from home (no extra bytes), then the cheapest; never a
        rank's last image unless that rank need not hold one. This rule wins over the cap: an
        empty rank may receive one image larger than the cap when no other image is left.
        """
        batch = self.batch
        held = np.bincount(dest, minlength=self.num_ranks)
        for r in np.flatnonzero(self.must_hold & (held == 0)).tolist():
            donor_ok = (held[dest] >= 2) | ~self.must_hold[dest]
            candidates = np.flatnonzero(donor_ok)
            if candidates.size == 0:
                continue
            keys = (
                candidates,
                batch.cost[candidates],
                dest[candidates] == batch.home[candidates],
                batch.home[candidates] != r,
                self.pinned[candidates],
            )
            k = int(candidates[np.lexsort(keys)[0]])
            held[dest[k]] -= 1
            dest[k] = r
            held[r] += 1


def _solve_locality(batch: _Batch, config: ViTBalanceConfig) -> np.ndarray:
    """The default solver (see the module docstring): destinations of the flat images."""
    solver = _LocalitySolver(batch, config)
    lower = max(float(batch.loads.sum()) / batch.num_ranks, float(batch.cost.max()))
    # Python loops below this many images, numpy blocks above (the cap needs the loops).
    vectorised = batch.cost.size > _VECTORISE_ABOVE and solver.cap is None
    num_ranks = batch.num_ranks
    if vectorised:
        candidates = [solver.home_first_blocks(lower)]
    else:
        candidates = [solver.shed_and_place(lower), solver.home_first_lpt(lower * (1.0 + 0.5 * _SLACK))]
        if solver.cap is None:
            # Home-first in coarser blocks moves fewer rows and balances less finely: try a few.
            sizes = sorted({num_ranks, max(1, num_ranks // 2), max(1, num_ranks // 4)}, reverse=True)
            candidates += [solver.home_first_blocks(lower, size) for size in sizes]
    accept = lower * (1.0 + _SLACK)
    if min(c.makespan for c in candidates) > accept * (1.0 + _EPS):
        # The lower bound is out of reach: measure against the seed's algorithm (LPT) instead.
        reference = solver.seed_equivalent()
        closest = min(c.makespan for c in candidates)
        best = min(reference.makespan, closest)
        accept = best * (1.0 + _SLACK)
        candidates.append(reference)
        if closest <= accept * (1.0 + _RELAX_WITHIN):
            # Home-first came close: retry it against the reachable target.
            relaxed = best * (1.0 + 0.5 * _SLACK)
            candidates.append(
                solver.home_first_blocks(relaxed) if vectorised else solver.home_first_lpt(relaxed)
            )
    # Plans that honour the cap best come first; among them, the fewest rows moved within the limit.
    excess = [solver.cap_excess(c.dest) for c in candidates]
    pool = [c for c, e in zip(candidates, excess) if e == min(excess)]
    limit = max(accept, min(c.makespan for c in pool)) * (1.0 + _EPS)
    feasible = [c for c in pool if c.makespan <= limit]
    if solver.cap is None and batch.cost.size <= _BRING_HOME_UP_TO:
        feasible.sort(key=lambda c: (c.moved_patches, c.makespan))
        feasible = [solver.bring_home(c, limit) for c in feasible[:_BRING_HOME_CANDIDATES]]
    return min(feasible, key=lambda c: (c.moved_patches, c.makespan)).dest
