"""Planning: which rank encodes which image. Pure Python and numpy, no torch.distributed.

Every rank calls :func:`plan_rebalance` on the same gathered patch counts and gets the same
:class:`RebalancePlan` (no broadcast needed): the solvers are deterministic, with ties broken by
rank and image index, never by hash or dict order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
        loads_after: Cost per rank under ``destinations``.

    A destination rank receives its images ordered by (source rank, image index): that is the
    order of the balanced batch it encodes, see :meth:`arrivals`.
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

    @property
    def lower_bound(self) -> float:
        """No plan's makespan is below ``max(total / P, largest image cost)``."""
        if not self.loads_before:
            return 0.0
        largest = max((max(c) for c in self.image_costs if c), default=0.0)
        return max(sum(self.loads_before) / len(self.loads_before), largest)

    @property
    def moved_images(self) -> int:
        """Images encoded away from their own rank."""
        return sum(d != r for r, dests in enumerate(self.destinations) for d in dests)

    @property
    def moved_patches(self) -> int:
        """Patches (pixel rows) sent to another rank."""
        return sum(
            n
            for r, (dests, counts) in enumerate(zip(self.destinations, self.patch_counts))
            for d, n in zip(dests, counts)
            if d != r
        )

    @property
    def total_patches(self) -> int:
        """Patches over all ranks."""
        return sum(sum(c) for c in self.patch_counts)

    def arrivals(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(source_rank, image_index)`` of every image ``rank`` encodes, in balanced-batch order."""
        return tuple(
            (src, i)
            for src, dests in enumerate(self.destinations)
            for i, d in enumerate(dests)
            if d == rank
        )

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


def _validate_patch_counts(patch_counts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    if isinstance(patch_counts, (str, bytes)) or not isinstance(patch_counts, Sequence):
        raise ValueError(
            f"patch_counts must be a sequence (one entry per rank) of sequences of ints, "
            f"got {type(patch_counts).__name__}."
        )
    if len(patch_counts) == 0:
        raise ValueError("patch_counts must have one entry per rank, got an empty sequence (0 ranks).")
    rows: list[tuple[int, ...]] = []
    for r, counts in enumerate(patch_counts):
        row: list[int] = []
        for i, n in enumerate(counts):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
                raise ValueError(
                    f"patch_counts[{r}][{i}]={n!r} is invalid: expected a positive int (T*H*W)."
                )
            row.append(int(n))
        rows.append(tuple(row))
    return tuple(rows)


def _home_plan(
    reason: str,
    solver: str,
    counts: tuple[tuple[int, ...], ...],
    costs: tuple[tuple[float, ...], ...],
    loads: tuple[float, ...],
) -> RebalancePlan:
    return RebalancePlan(
        applied=False,
        reason=reason,
        solver=solver,
        patch_counts=counts,
        destinations=tuple((r,) * len(c) for r, c in enumerate(counts)),
        image_costs=costs,
        loads_before=loads,
        loads_after=loads,
    )


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
        The plan. Skipped plans (``applied=False``) keep every image at home.

    Raises:
        ValueError: ``patch_counts`` is not a non-empty sequence of sequences of positive ints.
    """
    config = config if config is not None else ViTBalanceConfig()
    counts = _validate_patch_counts(patch_counts)
    model = cost_model if cost_model is not None else CostModel.from_config(config)
    flat = np.fromiter((n for row in counts for n in row), dtype=np.float64)
    flat_costs = np.asarray(model(flat), dtype=np.float64).reshape(-1) if flat.size else flat
    costs_list: list[tuple[float, ...]] = []
    start = 0
    for row in counts:
        costs_list.append(tuple(float(c) for c in flat_costs[start : start + len(row)]))
        start += len(row)
    costs = tuple(costs_list)
    loads = tuple(float(sum(c)) for c in costs)

    def skip(reason: str) -> RebalancePlan:
        return _home_plan(reason, config.solver, counts, costs, loads)

    if not config.enabled:
        return skip("disabled")
    if len(counts) == 1:
        return skip("single-rank")
    if flat.size == 0:
        return skip("no-images")
    if _imbalance(loads) < config.trigger_threshold:
        return skip("below-threshold")
    solve = _solve_seed if config.solver == "seed" else _solve_locality
    outcome = solve(counts, costs, loads, config)
    if isinstance(outcome, str):
        return skip(outcome)
    new_loads = [0.0] * len(counts)
    for r, dests in enumerate(outcome):
        for d, c in zip(dests, costs[r]):
            new_loads[d] += c
    return RebalancePlan(
        applied=True,
        reason="applied",
        solver=config.solver,
        patch_counts=counts,
        destinations=outcome,
        image_costs=costs,
        loads_before=loads,
        loads_after=tuple(new_loads),
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
    lightest rank that most lowers the larger of the two loads is made.
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
        ca, ra, ia = members[heavy].pop(a)
        members[light].append((ca, ra, ia))
        dest[ra][ia] = light
        rank_load[heavy] -= ca
        rank_load[light] += ca
        rank_patches[heavy] -= counts[ra][ia]
        rank_patches[light] += counts[ra][ia]
        if b >= 0:
            cb, rb, ib = members[light].pop(b)
            members[heavy].append((cb, rb, ib))
            dest[rb][ib] = heavy
            rank_load[light] -= cb
            rank_load[heavy] += cb
            rank_patches[light] -= counts[rb][ib]
            rank_patches[heavy] += counts[rb][ib]
    return tuple(tuple(row) for row in dest)


def _patch_cap(counts: tuple[tuple[int, ...], ...], config: ViTBalanceConfig) -> float | None:
    if config.max_len_ratio is None:
        return None
    return sum(sum(row) for row in counts) / len(counts) * config.max_len_ratio


def _fits(cap: float | None, patches: float) -> bool:
    return cap is None or patches <= cap


def _solve_locality(
    counts: tuple[tuple[int, ...], ...],
    costs: tuple[tuple[float, ...], ...],
    loads: tuple[float, ...],
    config: ViTBalanceConfig,
) -> Assignment | str:
    """Interim: the seed's LPT without its single-image skip (being replaced by the fast solver)."""
    return _solve_seed(counts, costs, loads, config)
