"""The locality solver: run the heuristics, finish their plans, pick the one that moves least.

It does the least work that finds a good plan, in steps:

0. *Shed and fit*: with many images (numpy variants) and at least
   :data:`~tuning.FIT_FROM_PER_RANK` per rank (long videos split by temporal step), the ranks
   above the bound shed their images with the most cost per row and the shed images are fitted
   into the others' room (:func:`~.locality.shed_and_fit`); a plan within :data:`~tuning.SLACK`
   of the bound is final, and moves about the fewest rows any plan that good must.
1. *At the bound*: shed-and-place aims at the lower bound ``max(total / P, largest image)``
   (or the pigeonhole bound, :attr:`~.batch.Batch.tight_bound`, when higher), refined only until
   it is within :data:`~tuning.SLACK` of it; when it misses the bound by many ranks and the
   largest images are a large share of it, home-first aimed at the bound gets its try. With many
   images (numpy variants) home-first replaces both: in blocks of ``P`` images, or on the exact
   heaps up to :data:`~tuning.HOME_FIRST_HEAPS_UP_TO_RANKS` ranks.
2. *Repair* (no cap): when the closest plan is more than :data:`~tuning.LEAN_SLACK` above the
   bound (images of similar sizes, which whole images cannot spread evenly), it is repaired
   (:func:`~.repair.repair`): ranks above the bound exchange images with ranks below it until
   every rank is within the slack of the bound or, failing that, within
   :data:`~tuning.LEAN_SLACK` of it. With many images (up to :data:`~tuning.REPAIR_UP_TO`
   images and :data:`~tuning.REPAIR_RANKS_UP_TO` ranks) it repairs shed-and-place's placement,
   which moves fewer rows than the numpy variants' plans. Beyond those sizes, up to
   :data:`~tuning.PAIRED_UP_TO` images, paired exchanges (:func:`~.paired.paired_exchanges`,
   numpy rounds over every pair of a loaded and a roomy rank at once) relieve most ranks of the
   numpy plan first, and the repair relieves the few left; below
   :data:`~tuning.PAIRED_FROM_PER_RANK` images per rank both aim at the lean limit alone.
3. *At the LPT*: when the bound is still out of reach, the seed's LPT (bins renamed to home
   ranks) joins the plans and sets the acceptance limit, and home-first is retried against it.
4. *Selection*: every finished plan (a :class:`Candidate`) is scored by its patches above the
   cap, its makespan and the pixel rows it moves. Among the plans that honour the cap best, those
   within the slack of the target; of those, the one that moves the fewest rows (ties: the lower
   makespan), after :func:`~.locality.bring_home` when it may have images to send back (every
   plan, with more than :data:`~tuning.POLISH_ABOVE_PER_RANK` images per rank).

Up to :data:`~tuning.VECTORISE_ABOVE` images the steps run in the lean order
(:func:`_solve_lean`), each only when the one before missed the bound: shed-and-place alone
against the simple bound first, where most batches end at about the cost of one heap LPT. A plan
that reached the bound untouched (no refinement, no fix-up) is final at once. The seed's LPT runs
only when the repair cannot reach the pigeonhole bound, so no plan is kept that is more than the
slack above the seed's makespan.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from lightning_vit_balance.config import ViTBalanceConfig
from lightning_vit_balance.solvers import tuning
from lightning_vit_balance.solvers.batch import Batch, Destinations, rank_loads, score, split_of_two_within
from lightning_vit_balance.solvers.locality import (
    bring_home,
    cap_excess,
    fill_empty_ranks,
    home_first,
    home_first_blocks,
    shed_and_fit,
    shed_and_place,
)
from lightning_vit_balance.solvers.lpt import lpt_reference, refine
from lightning_vit_balance.solvers.paired import paired_exchanges
from lightning_vit_balance.solvers.repair import repair

__all__ = ["Candidate", "solve_locality"]


class Candidate(NamedTuple):
    """A finished plan and its scores."""

    dest: Destinations
    makespan: float
    moved_patches: int
    #: Whether refinement, the empty-rank fix-up or a relabelling moved images after the heuristic
    #: placed them: only then can :func:`bring_home` find images to send back.
    adjusted: bool = True


def solve_locality(batch: Batch, config: ViTBalanceConfig) -> Destinations:
    """The default solver: destinations of the flat images (see the module docstring)."""
    cap = batch.cap(config.max_len_ratio)
    if not _vectorised(batch, cap):
        return _solve_lean(batch, config, cap)
    accept = batch.tight_bound * (1.0 + tuning.SLACK)
    fitted = _shed_and_fitted(batch, accept)
    if fitted is not None:
        return fitted
    closest = _aim_at_the_bound(batch, config, cap, accept)
    candidates = [closest]
    if _worth_repairing(batch, closest, cap):
        start = _repair_start(batch, closest)
        repaired = _repaired(batch, start, accept) if start is not None else None
        if repaired is not None:
            candidates.append(repaired)
            closest = min(closest, repaired, key=lambda c: c.makespan)
    if closest.makespan > accept * (1.0 + tuning.EPS):
        candidates, accept = _aim_at_the_lpt(batch, config, cap, candidates, closest.makespan)
    return _select(batch, candidates, accept, cap)


def _solve_lean(batch: Batch, config: ViTBalanceConfig, cap: float | None) -> Destinations:
    """Up to :data:`~tuning.VECTORISE_ABOVE` images: shed-and-place, refined or repaired when it
    misses the bound, and the seed's LPT only when neither reaches the bound.

    The steps of :func:`solve_locality`, ordered for the least work. Most batches end after
    shed-and-place, which reaches the simple bound, or after its refinement (the seed's pairwise
    moves and swaps) reaches the pigeonhole bound. With large images and many ranks above the bound
    (:func:`_large_images_far_off`) home-first aimed at the bound comes first, and ends the plan
    when it reaches the bound. With more than :data:`~tuning.REFINE_UP_TO_ABOVE` ranks above the
    limit the refinement rarely does, and the repair comes first. When the refined plan is still
    more than :data:`~tuning.LEAN_SLACK` above the bound, the repair brings the placement within the
    slack of the bound, or failing that within :data:`~tuning.LEAN_SLACK` of it; only then does the
    seed's LPT run, as the reference that plan must stay within the slack of. Otherwise the seed's
    plan, the refined plan and home-first retried against it compete.
    """
    accept = batch.lower_bound * (1.0 + tuning.SLACK)
    shed = shed_and_place(batch, batch.lower_bound * (1.0 + tuning.SHED_AIM), cap)
    scored = score(batch, shed)
    if max(scored[0]) > accept * (1.0 + tuning.EPS):
        accept = batch.tight_bound * (1.0 + tuning.SLACK)
    limit = accept * (1.0 + tuning.EPS)
    if max(scored[0]) <= limit:
        return _select(batch, [_finish(batch, shed, cap, config, accept, scored)], accept, cap)
    above = sum(load > limit for load in scored[0])
    if _large_images_far_off(batch, above, cap):
        spread = home_first(batch, batch.tight_bound * (1.0 + tuning.AIM), cap)
        home = _finish(batch, spread, cap, config, None)
        if _within(home, accept):
            # Home-first moved images away from home: selection may bring some back.
            return _select(batch, [home._replace(adjusted=True)], accept, cap)
    repair_first = cap is None and above > tuning.REFINE_UP_TO_ABOVE
    repaired = _repaired(batch, shed, accept) if repair_first else None
    if repaired is not None and _within(repaired, accept):
        return _select(batch, [repaired], accept, cap)
    # The refinement works in place; a repair after it starts from the placement: keep a copy
    # (unless the repair has run already).
    placed = None if repair_first else list(shed)
    finished = _finish(batch, shed, cap, config, accept, scored)
    if _within(finished, accept):
        return _select(batch, [finished], accept, cap)
    if not _worth_repairing(batch, finished, cap):
        repaired = None
    elif placed is not None:
        repaired = _repaired(batch, placed, accept)
    if repaired is not None and _within(repaired, accept):
        return _select(batch, [repaired], accept, cap)
    return _against_the_seed(batch, config, cap, accept, finished, repaired)


def _against_the_seed(
    batch: Batch,
    config: ViTBalanceConfig,
    cap: float | None,
    accept: float,
    finished: Candidate,
    repaired: Candidate | None,
) -> Destinations:
    """The lean order's last step, the pigeonhole bound out of reach: the seed's LPT as the
    reference. The repaired plan when within the slack of it (and of the seed's, when better),
    else the seed's plan, the refined plan and home-first retried against it compete."""
    reference = _seed_reference(batch, config, cap)
    if repaired is not None and _within(repaired, reference.makespan * (1.0 + tuning.SLACK)):
        # Within the slack of the best plan found: the repaired one when it beats the seed's.
        limit = min(reference.makespan, repaired.makespan) * (1.0 + tuning.SLACK)
        return _select(batch, [repaired], limit, cap)
    accept = max(accept, min(reference.makespan, finished.makespan) * (1.0 + tuning.SLACK))
    candidates = [finished, reference]
    if not _within(finished, accept):
        retry = home_first(batch, accept / (1.0 + tuning.SLACK) * (1.0 + tuning.AIM), cap)
        candidates.append(_finish(batch, retry, cap, config, accept))
    return _select(batch, candidates, accept, cap)


def _large_images_far_off(batch: Batch, above: int, cap: float | None) -> bool:
    """Whether home-first aimed at the bound comes next in the lean order: no cap, the costliest
    image at least :data:`~tuning.HOME_FIRST_FROM` of the pigeonhole bound, and more than
    :data:`~tuning.REFINE_UP_TO_ABOVE` ranks (or half the ranks or more) ``above`` it after
    shed-and-place. With fewer above, the refinement or the repair usually reaches the bound and
    moves fewer rows (at P = 8 with 1-8 mixed images per rank, home-first there too raised the
    median rows moved from 0.38 to 0.63 of the seed's)."""
    if cap is not None or max(batch.cost) < tuning.HOME_FIRST_FROM * batch.tight_bound:
        return False
    return above > tuning.REFINE_UP_TO_ABOVE or 2 * above >= batch.num_ranks


def _worth_repairing(batch: Batch, closest: Candidate, cap: float | None) -> bool:
    """Whether to repair the closest plan: it is more than :data:`~tuning.LEAN_SLACK` above the
    pigeonhole bound, there is no cap (the exchanges do not check one) and the batch is within
    the repair's sizes (:data:`~tuning.PAIRED_UP_TO` images). Closer plans keep the order without
    it: the seed's LPT as reference, whose looser limit lets plans that move fewer rows qualify."""
    if cap is not None or batch.size > tuning.PAIRED_UP_TO:
        return False
    return closest.makespan > batch.tight_bound * (1.0 + tuning.LEAN_SLACK) * (1.0 + tuning.EPS)


def _repair_start(batch: Batch, closest: Candidate) -> Destinations | None:
    """Where the repair of a numpy variant's plan starts: shed-and-place's placement, as in the
    lean order (the numpy plans move more rows), up to the Python repair's sizes
    (:func:`_paired_first`); beyond them the closest plan. ``None`` when that placement is more
    than :data:`~tuning.REPAIR_FROM_WITHIN` above the bound."""
    if _paired_first(batch):
        return closest.dest
    start = shed_and_place(batch, batch.lower_bound * (1.0 + tuning.SHED_AIM), None)
    within = max(rank_loads(batch, start)) <= batch.tight_bound * (1.0 + tuning.REPAIR_FROM_WITHIN)
    return start if within else None


def _pairs_follow(batch: Batch, cap: float | None) -> bool:
    """Whether a numpy plan is repaired with paired exchanges first: beyond the Python repair's
    sizes (:func:`_paired_first`), up to :data:`~tuning.PAIRED_UP_TO` images, and no cap."""
    return cap is None and _paired_first(batch) and batch.size <= tuning.PAIRED_UP_TO


def _paired_first(batch: Batch) -> bool:
    """Beyond :data:`~tuning.REPAIR_UP_TO` images or :data:`~tuning.REPAIR_RANKS_UP_TO` ranks the
    repair starts with :func:`~.paired.paired_exchanges`."""
    return batch.size > tuning.REPAIR_UP_TO or batch.num_ranks > tuning.REPAIR_RANKS_UP_TO


def _repaired(batch: Batch, dest: Destinations, accept: float) -> Candidate | None:
    """A copy of ``dest`` repaired (no cap) to ``accept``, or else to the lean limit
    (:data:`~tuning.LEAN_SLACK` above the pigeonhole bound); ``None`` when it reaches neither.
    Selection brings it home like any adjusted plan; with more images than selection brings home
    (:data:`~tuning.BRING_HOME_UP_TO`), it is brought home here. Beyond the Python repair's sizes
    paired exchanges come first (:func:`_paired_and_repaired`)."""
    if _paired_first(batch):
        return _paired_and_repaired(batch, dest, accept)
    targets = _repair_targets(batch, accept)
    if _out_of_reach(batch, targets[-1]):
        return None
    dest = _filled(batch, list(dest), None)
    reached = repair(batch, dest, rank_loads(batch, dest), targets)
    if reached is None:
        return None
    if batch.size > tuning.BRING_HOME_UP_TO:
        # Selection brings home the Python paths' plans only; bring this one home within the
        # target it reached (measured: 0.6-2.3 points fewer rows moved at P = 128-224).
        dest = bring_home(batch, dest, reached * (1.0 + tuning.EPS), batch.must_hold)
    return _measure(batch, dest)


def _out_of_reach(batch: Batch, target: float) -> bool:
    """Two ranks, at most :data:`~tuning.SPLIT_SEARCH_UP_TO` images, the costliest at least
    :data:`~tuning.SPLIT_SEARCH_FROM` of ``target``: whether no split of them keeps both ranks
    within ``target``. Then no repair reaches it, and it would search in vain (at P = 2 the
    repair's futile searches made the slowest plans). The search of every split is exact up to
    float rounding, which a margin of two :data:`~tuning.EPS` covers many times over, so skipping
    the repair changes no plan."""
    if batch.num_ranks != 2 or batch.size > tuning.SPLIT_SEARCH_UP_TO:
        return False
    if max(batch.cost) < tuning.SPLIT_SEARCH_FROM * target:
        return False
    return not split_of_two_within(batch.cost, target * (1.0 + tuning.EPS) ** 2)


def _paired_and_repaired(batch: Batch, dest: Destinations, accept: float) -> Candidate | None:
    """:func:`_repaired` beyond the Python repair's sizes: paired exchanges relieve most ranks,
    and the repair runs only when at most :data:`~tuning.REPAIR_LEFT_UP_TO` are left above the
    target. With fewer than :data:`~tuning.PAIRED_FROM_PER_RANK` images per rank on average both
    aim at the lean limit alone (:data:`~tuning.PAIRED_ROUNDS_FEW` rounds): whole images that
    coarse rarely reach ``accept``. Not brought home: a Python pass over 8,000 images took 23 ms,
    three times the rest of the plan."""
    targets = _repair_targets(batch, accept)
    rounds = tuning.PAIRED_ROUNDS
    if batch.size < tuning.PAIRED_FROM_PER_RANK * batch.num_ranks:
        targets, rounds = targets[1:], tuning.PAIRED_ROUNDS_FEW
    paired = paired_exchanges(batch, np.asarray(dest), targets[0], rounds)
    loads = rank_loads(batch, paired)
    left = sum(load > targets[0] * (1.0 + tuning.EPS) for load in loads)
    if left == 0:
        return _measure(batch, paired)
    if left > tuning.REPAIR_LEFT_UP_TO:
        return None
    repaired = paired.tolist()
    if repair(batch, repaired, loads, targets) is None:
        return None
    return _measure(batch, np.array(repaired, dtype=np.int64))


def _repair_targets(batch: Batch, accept: float) -> tuple[float, float]:
    """The repair's targets: ``accept``, else the lean limit above the pigeonhole bound."""
    return accept, max(accept, batch.tight_bound * (1.0 + tuning.LEAN_SLACK))


def _shed_and_fitted(batch: Batch, accept: float) -> np.ndarray | None:
    """Many images per rank (:data:`~tuning.FIT_FROM_PER_RANK` or more on average; the numpy
    variants, so no cap): the first plan of :func:`~.locality.shed_and_fit` within ``accept``,
    aimed as :data:`~tuning.FIT_TRIES` says (a tight fit first, for the lower makespan), each given
    up as soon as a rank would end above ``accept``; ``None`` when neither is. Such a plan moves
    about the fewest rows any plan that good must move, so nothing is brought home."""
    if batch.size < tuning.FIT_FROM_PER_RANK * batch.num_ranks:
        return None
    for shed_aim, fit_slack in tuning.FIT_TRIES:
        target, limit = batch.lower_bound * (1.0 + shed_aim), batch.tight_bound * (1.0 + fit_slack)
        dest = shed_and_fit(batch, target, limit, give_up_above=accept * (1.0 + tuning.EPS))
        if dest is None:
            continue
        fill_empty_ranks(batch, dest, None)
        if max(rank_loads(batch, dest)) <= accept * (1.0 + tuning.EPS):
            return dest
    return None


def _aim_at_the_bound(batch: Batch, config: ViTBalanceConfig, cap: float | None, accept: float) -> Candidate:
    """The numpy variants' plan aimed at the lower bound (step 1): home-first
    (:func:`_home_first_many`), refined towards ``accept``."""
    lower = batch.tight_bound
    placed = _home_first_many(batch, lower)
    scored = score(batch, placed)
    # Far above the bound (images of similar sizes) the seed's refinement, one rank at a time,
    # rarely reaches it: the paired exchanges take the plan as placed (tuning.PAIRED_ABOVE).
    far = _pairs_follow(batch, cap) and max(scored[0]) > lower * (1.0 + tuning.PAIRED_ABOVE)
    return _finish(batch, placed, cap, config, None if far else accept, scored)


def _aim_at_the_lpt(
    batch: Batch, config: ViTBalanceConfig, cap: float | None, candidates: list[Candidate], closest: float
) -> tuple[list[Candidate], float]:
    """The lower bound is out of reach (step 2): the seed's LPT, its bins renamed to home ranks,
    joins the candidates and sets the acceptance limit; home-first is retried against the
    reachable target when the plans came close. Returns the candidates and the new limit."""
    reference = _seed_reference(batch, config, cap)
    best = min(reference.makespan, closest)
    accept = best * (1.0 + tuning.SLACK)
    candidates = [*candidates, reference]
    if closest <= accept * (1.0 + tuning.RELAX_WITHIN):
        retry = _home_first_many(batch, best * (1.0 + tuning.AIM))
        candidates.append(_finish(batch, retry, cap, config, accept))
    return candidates, accept


def _home_first_many(batch: Batch, target: float) -> np.ndarray:
    """Home-first for the numpy variants: in blocks of ``P`` images, or with the exact heaps up to
    :data:`~tuning.HOME_FIRST_HEAPS_UP_TO_RANKS` ranks, where blocks that small cost more than
    they save."""
    if batch.num_ranks <= tuning.HOME_FIRST_HEAPS_UP_TO_RANKS:
        return np.array(home_first(batch, target, None), dtype=np.int64)
    return home_first_blocks(batch, target)


def _seed_reference(batch: Batch, config: ViTBalanceConfig, cap: float | None) -> Candidate:
    """The seed's plan, its bins renamed to home ranks and every rank that must hold an image
    holding one, scored."""
    return _measure(batch, _filled(batch, lpt_reference(batch, config, cap), cap))


def _polish(batch: Batch, cap: float | None) -> bool:
    """Ranks hold many images (and fit the Python paths): selection brings every plan home."""
    many = tuning.POLISH_ABOVE_PER_RANK * batch.num_ranks < batch.size
    return cap is None and many and batch.size <= tuning.BRING_HOME_UP_TO


def _vectorised(batch: Batch, cap: float | None) -> bool:
    """Numpy blocks for many images; the cap needs the exact heaps."""
    return batch.size > tuning.VECTORISE_ABOVE and cap is None


def _within(candidate: Candidate, accept: float) -> bool:
    return candidate.makespan <= accept * (1.0 + tuning.EPS)


def _select(batch: Batch, candidates: list[Candidate], accept: float, cap: float | None) -> Destinations:
    """Plans that honour the cap best first; among them, the fewest rows moved within the limit.
    The best few (every plan, with many images per rank) get :func:`bring_home` first when they may
    have images to bring back."""
    polish = _polish(batch, cap)
    if len(candidates) == 1 and not (candidates[0].adjusted or polish):
        return candidates[0].dest
    excess = [cap_excess(batch, c.dest, cap) for c in candidates]
    pool = [c for c, e in zip(candidates, excess) if e == min(excess)]
    limit = max(accept, min(c.makespan for c in pool)) * (1.0 + tuning.EPS)
    feasible = sorted((c for c in pool if c.makespan <= limit), key=_rows_then_makespan)
    if cap is None and batch.size <= tuning.BRING_HOME_UP_TO:
        feasible = [
            _measure(batch, bring_home(batch, c.dest, limit, batch.must_hold)) if polish or c.adjusted else c
            for c in (feasible if polish else feasible[: tuning.BRING_HOME_CANDIDATES_LEAN])
        ]
    return min(feasible, key=_rows_then_makespan).dest


def _rows_then_makespan(candidate: Candidate) -> tuple[int, float]:
    return candidate.moved_patches, candidate.makespan


def _finish(
    batch: Batch,
    dest: Destinations,
    cap: float | None,
    config: ViTBalanceConfig,
    accept: float | None,
    scored: tuple[list[float], int] | None = None,
) -> Candidate:
    """Refine a heuristic's plan until it is within ``accept`` (``None``: leave it as placed), give
    empty ranks an image, and score it (``scored``: :func:`score` of ``dest``, when at hand).
    Refining an acceptable plan further would only move rows for nothing: every plan within
    ``accept`` is as good as the next, and the fewest rows win."""
    loads, moved = scored if scored is not None else score(batch, dest)
    steps = 0
    if accept is not None and max(loads) > accept * (1.0 + tuning.EPS):
        good_enough = accept * (1.0 + tuning.EPS)
        steps = refine(batch, dest, loads, cap, config, seed_rules=False, good_enough=good_enough)
    if fill_empty_ranks(batch, dest, cap) or steps:
        return _measure(batch, dest)
    return Candidate(dest, max(loads), moved, adjusted=False)


def _filled(batch: Batch, dest: Destinations, cap: float | None) -> Destinations:
    fill_empty_ranks(batch, dest, cap)
    return dest


def _measure(batch: Batch, dest: Destinations) -> Candidate:
    """Score a plan whose images were moved after their heuristic placed them."""
    loads, moved = score(batch, dest)
    return Candidate(dest, max(loads), moved)
