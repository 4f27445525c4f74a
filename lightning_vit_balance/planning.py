"""Planning: which rank encodes which image. Pure Python and numpy, no torch.distributed.

Every rank calls :func:`plan_rebalance` on the same gathered patch counts and gets the same
:class:`RebalancePlan` (no broadcast needed): the solvers are deterministic, with ties broken by
rank and image index, never by hash or dict order.

Two solvers (:mod:`lightning_vit_balance.solvers`):

* ``"locality"`` (default): a few fast heuristics that keep images at home unless moving them
  helps (*home-first LPT*, *shed and place*), each refined, and a *repair* that exchanges images
  between ranks above and below the bound when whole images leave them uneven (images of similar
  sizes); it keeps the plan that moves the fewest pixel rows among those whose makespan is
  within 0.4% of the lower bound ``max(total / P, largest image)`` or, when that is out of
  reach, of the best makespan found (the seed's LPT included). So it balances around a
  dominating image, and does not exceed the seed's makespan by more than 0.4% (empty-rank
  fix-ups aside).
* ``"lpt"`` (alias ``"seed"``): the seed's algorithm, LPT then move/swap refinement between the
  heaviest and the lightest rank; it skips when one image outweighs the mean load.

Patch cap (``config.max_len_ratio``): both solvers give an image to a rank only if the rank's
patches stay within ``cap = mean_patches_per_rank * max_len_ratio``; the locality solver also
sheds from a rank above the cap. When no rank has room the LPT solver gives the image to the
lightest rank and the locality solver keeps it at home. An image larger than the cap on its own
never fits anywhere: the locality solver's heuristics keep it at home (moving it would only move
the overflow), so its rank exceeds the cap by that image alone, and shed every other image of
that rank that fits elsewhere. A rank that encodes a single image is exempt from the cap: that
image may be larger than the cap where the plan chosen gives it to a rank alone (the seed's LPT
plan, one of the locality solver's candidates, may, when its home rank holds several such
images; or a rank that would otherwise be idle). Such a rank then holds no more patches than
the image's home rank held without balancing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import mod
from typing import Any

import numpy as np

from lightning_vit_balance.caching import cached_value
from lightning_vit_balance.config import ViTBalanceConfig, require_config, stable_digest
from lightning_vit_balance.cost import CostModel
from lightning_vit_balance.solvers import Batch, canonical_solver, solve, tuning
from lightning_vit_balance.solvers.batch import add_up, rank_loads

__all__ = ["REASONS", "RebalancePlan", "plan_rebalance", "positive_ints"]

#: Every value :attr:`RebalancePlan.reason` takes, with its meaning. Stable: logged as metrics.
REASONS: dict[str, str] = {
    "applied": "images were redistributed",
    "disabled": "balancing is turned off in the config",
    "single-rank": "only one data-parallel rank",
    "no-images": "no rank has an image",
    "below-threshold": "imbalance max/mean - 1 is below config.trigger_threshold",
    "single-image-dominates": "seed solver: one image costs more than the mean rank load",
    "no-gain": "the best plan lowers the makespan by less than config.min_gain (lpt: does not lower it)",
}


@dataclass(frozen=True)
class RebalancePlan:
    """Where every image of every data-parallel rank is encoded. A value: compare, hash, log it.

    Attributes:
        applied: Whether images move. When ``False`` every image stays on its own rank.
        reason: Why, one of :data:`REASONS`.
        solver: The solver that produced it, by its canonical name: ``"locality"`` or ``"lpt"``
            (also for a config that names ``"lpt"`` by its alias ``"seed"``, so both give equal
            plans).
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

    @cached_value
    def lower_bound(self) -> float:
        """No plan's makespan is below ``max(total / P, largest image cost)``."""
        if not self.loads_before:
            return 0.0
        largest = max((max(c) for c in self.image_costs if c), default=0.0)
        return max(add_up(self.loads_before) / len(self.loads_before), largest)

    @cached_value
    def moved_images(self) -> int:
        """Images encoded away from their own rank."""
        if not self.applied:  # every image at home
            return 0
        dest, src, _ = self._flat_images
        return int(np.count_nonzero(dest != src))

    @cached_value
    def moved_patches(self) -> int:
        """Patches (pixel rows) sent to another rank."""
        if not self.applied:
            return 0
        dest, src, _ = self._flat_images
        counts = np.fromiter(chain.from_iterable(self.patch_counts), dtype=np.int64, count=dest.size)
        return int(counts[dest != src].sum())

    @cached_value
    def num_images(self) -> int:
        """Images over all ranks."""
        return sum(map(len, self.patch_counts))

    @cached_value
    def moved_patches_lower_bound(self) -> float:
        """Fewest patches any plan with a makespan of at most :attr:`makespan_after` must move.

        Each rank whose load exceeds that makespan must send away at least the excess in cost.
        Taking its images in order of cost per patch (largest first for ``l**2``), fractionally,
        until the excess is covered gives the fewest patches that can carry that much cost (a
        fractional knapsack, so a bound, not always attainable). Summed over ranks.
        """
        target = self.makespan_after * (1.0 + tuning.EPS)
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

    @cached_value
    def total_patches(self) -> int:
        """Patches over all ranks."""
        return sum(map(sum, self.patch_counts))

    def warm_figures(self) -> None:
        """Compute the figures a call reports (:class:`BalanceStats`), so that a call given a plan
        made before it only reads them."""
        _ = self.moved_images, self.moved_patches, self.total_patches, self.num_images

    @cached_value
    def digest(self) -> int:
        """A 62-bit integer of whether the plan applies and where every image goes (the ranks'
        image counts included): equal on every process that made this plan, different, but for
        a 1 in 2**62 chance, for any other destinations. The balancer compares it across ranks
        before the return trip, so ranks that planned differently raise instead of returning
        images' outputs to the wrong rows."""
        sizes = np.fromiter(map(len, self.destinations), dtype="<i4", count=self.num_ranks)
        data = bytes([self.applied]) + sizes.tobytes() + self._flat_images[0].astype("<i4").tobytes()
        return stable_digest(data)

    @cached_value
    def _flat_images(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every image's destination, source rank and index there (``[images]`` each), in
        (source rank, index) order."""
        sizes = [len(dests) for dests in self.destinations]
        dest = np.fromiter(chain.from_iterable(self.destinations), dtype=np.int64, count=sum(sizes))
        src = np.repeat(np.arange(len(sizes)), sizes)
        starts = np.cumsum([0, *sizes[:-1]])
        return dest, src, np.arange(dest.size) - np.repeat(starts, sizes)

    @cached_value
    def _arrivals_of(self) -> dict[int, tuple[tuple[int, int], ...]]:
        return {}

    def arrivals(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(source_rank, image_index)`` of every image ``rank`` encodes, in balanced-batch order.

        Only ``rank``'s: a rank's balanced call reads its own, and on 1,024 ranks building every
        rank's tuples took a tenth of its host work (BENCHMARKS.md, "Host work per call on many
        ranks"). :meth:`arrivals_of_every_rank` gives them all at once.
        """
        if rank not in self._arrivals_of:
            self._check_rank(rank)
            dest, src, index = self._flat_images
            here = np.flatnonzero(dest == rank)  # ascending: (source rank, index) order
            self._arrivals_of[rank] = tuple(zip(src[here].tolist(), index[here].tolist()))
        return self._arrivals_of[rank]

    def arrivals_of_every_rank(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """:meth:`arrivals` of every rank, in rank order (one stable sort)."""
        dest, src, index = self._flat_images
        order = np.argsort(dest, kind="stable")
        pairs = list(zip(src[order].tolist(), index[order].tolist()))
        ends = np.cumsum(np.bincount(dest, minlength=self.num_ranks)).tolist()
        return tuple(tuple(pairs[start:end]) for start, end in zip([0, *ends], ends))

    def send_patches(self, rank: int) -> tuple[int, ...]:
        """``send_patches(r)[d]``: patches rank ``r`` sends to rank ``d`` (its own included)."""
        self._check_rank(rank)  # a negative rank would index from the end: another rank's sends
        out = [0] * self.num_ranks
        for d, n in zip(self.destinations[rank], self.patch_counts[rank]):
            out[d] += n
        return tuple(out)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"rank must be in [0, {self.num_ranks}) for this plan, got {rank!r}.")

    def receive_patches(self, rank: int) -> tuple[int, ...]:
        """``receive_patches(r)[s]``: patches rank ``r`` receives from rank ``s``."""
        out = [0] * self.num_ranks
        for src, i in self.arrivals(rank):
            out[src] += self.patch_counts[src][i]
        return tuple(out)


def _imbalance(loads: Sequence[float]) -> float:
    if not loads:
        return 0.0
    mean = add_up(loads) / len(loads)
    return max(loads) / mean - 1.0 if mean > 0 else 0.0


def _int_rows(values: Sequence[Sequence[int]], name: str, row_expected: str) -> list[tuple[Any, ...]]:
    """``values`` as one tuple per rank, each entry checked later by :func:`positive_ints`.

    Raises ``ValueError`` naming ``name`` for anything but a sequence of sequences (a string is not
    a row); ``row_expected`` says what a row should be (``{r}`` is replaced by the rank).
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        got = type(values).__name__
        raise ValueError(f"{name} must be a sequence (one entry per rank) of sequences of ints, got {got}.")
    bad = next((r for r, row in enumerate(values) if isinstance(row, (str, bytes))), None)
    if bad is None:
        try:
            return list(map(tuple, values))
        except TypeError:
            bad = next(r for r, row in enumerate(values) if not hasattr(row, "__iter__"))
    raise ValueError(f"{name}[{bad}]={values[bad]!r} is invalid: expected {row_expected.format(r=bad)}.")


#: Patch counts and frames are planned as int64, and their sums counted so.
_INT64_END = 2**63
_TOTAL_END = 2**62


def positive_ints(
    rows: Sequence[Sequence[Any]], name: str, item_expected: str
) -> tuple[tuple[int, ...], ...]:
    """The rows as plain ints, or a ``ValueError`` naming ``name[r][i]`` for the first bad entry."""
    # Fast path: plain positive Python ints (what the exchange layer hands over). Every entry's
    # type is read: a set of the values would keep the first of 1, 1.0 and True, which are equal.
    flat = [*chain.from_iterable(rows)]
    if set(map(type, flat)) <= {int} and min(flat, default=1) > 0 and max(flat, default=1) < _INT64_END:
        return tuple(rows)
    for r, row in enumerate(rows):
        for i, n in enumerate(row):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 < n < _INT64_END:
                raise ValueError(f"{name}[{r}][{i}]={n!r} is invalid: expected {item_expected} below 2**63.")
    return tuple(tuple(int(n) for n in row) for row in rows)


def _validate_patch_counts(patch_counts: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    if type(patch_counts) in (list, tuple) and patch_counts and set(map(type, patch_counts)) <= {list, tuple}:
        # Lists or tuples of rows, what the exchange layer hands over: the shape needs no more
        # checks (the ABC checks of the general path cost about as much as planning two ranks).
        rows = list(map(tuple, patch_counts))
    else:
        sequence = isinstance(patch_counts, Sequence) and not isinstance(patch_counts, (str, bytes))
        if sequence and not patch_counts:
            raise ValueError("patch_counts must have one entry per rank, got an empty sequence (0 ranks).")
        rows = _int_rows(patch_counts, "patch_counts", "a sequence of positive ints")
    counts = positive_ints(rows, "patch_counts", "a positive int (T*H*W)")
    total = sum(map(sum, counts))
    if total >= _TOTAL_END:  # the plan's figures (moved and total patches) are int64 sums
        raise ValueError(f"patch_counts sum to {total}: expected a total below 2**62.")
    return counts


def _validate_frames(frames: Sequence[Sequence[int]], counts: tuple[tuple[int, ...], ...]) -> list[int]:
    """``frames`` checked against the validated ``counts``, flat (one T per image)."""
    if isinstance(frames, Sequence) and not isinstance(frames, (str, bytes)) and len(frames) != len(counts):
        raise ValueError(
            f"frames has {len(frames)} ranks, patch_counts has {len(counts)}: expected one entry per rank."
        )
    per_image = "a sequence of positive ints (temporal steps T), one per image of patch_counts[{r}]"
    rows = _int_rows(frames, "frames", per_image)
    if list(map(len, rows)) != list(map(len, counts)):
        r = next(r for r, (row, n) in enumerate(zip(rows, counts)) if len(row) != len(n))
        raise ValueError(
            f"frames[{r}] has {len(rows[r])} entries, patch_counts[{r}] has {len(counts[r])}: expected "
            "one T per image."
        )
    flat = [*chain.from_iterable(positive_ints(rows, "frames", "a positive int (temporal steps T)"))]
    if any(map(mod, chain.from_iterable(counts), flat)):  # rare: then find the first to name it
        r, i = next((r, i) for r, row in enumerate(rows) for i, t in enumerate(row) if counts[r][i] % t)
        raise ValueError(
            f"frames[{r}][{i}]={rows[r][i]!r} is invalid for patch_counts[{r}][{i}]={counts[r][i]!r}: "
            "expected a divisor of it (T of T*H*W)."
        )
    return flat


def _check_planning_arguments(config: object, cost_model: object) -> None:
    """Raise a TypeError naming a ``plan_rebalance`` argument of another kind."""
    require_config("plan_rebalance", config)
    if cost_model is not None and not callable(cost_model):
        raise TypeError(
            f"plan_rebalance(cost_model={cost_model!r}) is invalid: expected a callable of the patch "
            "counts (a CostModel) or None."
        )


def plan_rebalance(
    patch_counts: Sequence[Sequence[int]],
    config: ViTBalanceConfig | None = None,
    *,
    cost_model: Callable[..., Any] | None = None,
    frames: Sequence[Sequence[int]] | None = None,
) -> RebalancePlan:
    """Plan which rank encodes each image.

    Args:
        patch_counts: ``patch_counts[r][i]`` is ``T*H*W`` of rank ``r``'s ``i``-th image or video;
            one entry per data-parallel rank, any of them may be empty.
        config: Solver, thresholds and cost model; default ``ViTBalanceConfig()``.
        cost_model: Overrides the config's cost coefficients with any vectorised callable
            mapping an array of patch counts to costs (e.g. a fitted model). With ``frames`` it is
            called as ``cost_model(counts, frames=steps)``, so a callable that is not a
            :class:`~lightning_vit_balance.CostModel` must take that keyword.
        frames: ``frames[r][i]`` is ``T``, the temporal steps of that image or video (1 for an
            image), shaped like ``patch_counts``; ``None``: 1 each. They change the costs only of a
            per-frame cost model (``config.cost_per_frame_attention``), whose attention runs within
            each temporal step.

    Returns:
        The plan. Skipped plans (``applied=False``) keep every image at home; ``reason`` says why
        (see :data:`REASONS`). Skip rules, in order: disabled, one rank, no images, imbalance
        below ``config.trigger_threshold``; then the LPT solver skips when one image costs more
        than the mean load, and the locality solver when its plan lowers the makespan by less
        than ``config.min_gain`` of the unbalanced makespan (without solving when even the lower
        bound would not); the LPT solver when its plan does not lower it at all.

    Raises:
        ValueError: ``patch_counts`` is not a non-empty sequence of sequences of positive ints,
            ``frames`` is not shaped like it with positive ints, or ``cost_model`` does not return
            one finite non-negative cost per image.
        TypeError: ``frames`` are given and ``cost_model`` takes no ``frames`` keyword; ``config``
            is not a ``ViTBalanceConfig`` or ``cost_model`` not a callable.
    """
    _check_planning_arguments(config, cost_model)
    config = config if config is not None else ViTBalanceConfig()
    model = cost_model if cost_model is not None else _cost_model(config)
    counts = _validate_patch_counts(patch_counts)
    steps = _validate_frames(frames, counts) if frames is not None else None
    batch = Batch.build(counts, model, steps)
    solver = canonical_solver(config.solver)
    outcome = _skip_reason(batch, config, solver)
    if outcome is None:
        outcome = solve(batch, config)
    if isinstance(outcome, str):
        return _plan(batch, solver, outcome, batch.home, batch.loads)
    loads = rank_loads(batch, outcome)
    # The seed's LPT applies what it finds, but not a plan that leaves the slowest rank as slow or
    # slower (under a cap, an image with room nowhere goes to the lightest rank, whatever it holds).
    min_gain = config.min_gain if solver == "locality" else 0.0
    if _gain(batch, max(loads)) < min_gain:
        return _plan(batch, solver, "no-gain", batch.home, batch.loads)
    dest = outcome.tolist() if isinstance(outcome, np.ndarray) else outcome
    return _plan(batch, solver, "applied", dest, loads)


#: ``id(config) -> (config, its cost model)``: see :func:`_cost_model`.
_MODELS: dict[int, tuple[ViTBalanceConfig, CostModel]] = {}


def _cost_model(config: ViTBalanceConfig) -> CostModel:
    """The config's cost model, built once per config object.

    Keyed by identity, not by value: hashing a config (two dozen fields) on every plan costs as
    much as a fifth of a plan for two ranks. The entry keeps its config alive, so an id is not
    reused while it is cached; a job uses a config or two, and the cache is emptied past 16.
    """
    entry = _MODELS.get(id(config))
    if entry is None or entry[0] is not config:
        if len(_MODELS) >= 16:
            _MODELS.clear()
        entry = _MODELS[id(config)] = (config, CostModel.from_config(config))
    return entry[1]


def _skip_reason(batch: Batch, config: ViTBalanceConfig, solver: str) -> str | None:
    """Why a step skips before any solver runs, or ``None``."""
    if not config.enabled:
        return "disabled"
    if batch.num_ranks == 1:
        return "single-rank"
    if batch.size == 0:
        return "no-images"
    if _imbalance(batch.loads) < config.trigger_threshold:
        return "below-threshold"
    # No plan's makespan is below the lower bound (the margin covers summation order): when even
    # the bound would not gain min_gain, no plan will.
    if solver == "locality" and _gain(batch, batch.lower_bound * (1.0 - tuning.EPS)) < config.min_gain:
        return "no-gain"
    return None


def _gain(batch: Batch, makespan: float) -> float:
    """The relative drop of the makespan from the unbalanced one; a plan that does not lower it
    gains nothing, whatever min_gain says (so 0 counts as no gain)."""
    before = max(batch.loads)
    gain = (before - makespan) / before if before > 0 else 0.0
    return gain if gain > 0.0 else -1.0


def _plan(
    batch: Batch, solver: str, reason: str, dest: Sequence[int], loads: Sequence[float]
) -> RebalancePlan:
    return RebalancePlan(
        applied=reason == "applied",
        reason=reason,
        solver=solver,
        patch_counts=batch.counts,
        destinations=batch.rows(dest),
        image_costs=batch.rows(batch.cost),
        loads_before=tuple(batch.loads),
        loads_after=tuple(loads),
    )
