"""Images alike (frames of one video): the searches try the first of each, exactly.

A video split by temporal step gives a rank hundreds of images of one size. The refinement step,
the repair's single exchanges and bring-home's swaps score candidates by cost, patches and pixel
rows only, keep the first found on ties and replace it only by a strictly better one, so they try
only the first of the candidates alike; shed-and-fit places a run of alike images on one rank
while it holds them. These tests hold each to a plain scan of every candidate (few sizes, so most
have twins) and count the work on frames.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_vit_balance import CostModel, ViTBalanceConfig, plan_rebalance
from lightning_vit_balance.planning import _validate_patch_counts
from lightning_vit_balance.solvers import Batch, tuning
from lightning_vit_balance.solvers import locality as locality_module
from lightning_vit_balance.solvers import repair as repair_module
from lightning_vit_balance.solvers.batch import first_of_alike, rank_loads
from lightning_vit_balance.solvers.locality import _best_swap, bring_home, shed_and_fit, shed_by_cost_per_row
from lightning_vit_balance.solvers.lpt import _best_step, _Pair

FORCED = ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0)
LINEAR = CostModel(quadratic=0.0, linear=1.0)
SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
#: Rank batches drawn from few sizes: most images have twins.
alike_batches = st.lists(st.lists(st.sampled_from([4, 6, 9, 10, 20]), max_size=9), min_size=2, max_size=5)


def _batch(counts: list[list[int]]) -> Batch:
    return Batch.build(_validate_patch_counts(counts), LINEAR)


def test_first_of_alike() -> None:
    assert first_of_alike([]) == []
    assert first_of_alike([(3.0, 1), (2.0, 1), (3.0, 1), (3.0, 2), (2.0, 1)]) == [0, 1, 3]


def _best_step_by_scan(
    batch: Batch, heavy_ids: list[int], light_ids: list[int], pair: _Pair
) -> tuple[int, int]:
    """Every move and swap in scan order (each heavy image: the move, then swaps with each light
    image), kept when it scores below the bar, which then drops to its score less the minimum step."""
    cost, patches = batch.cost, batch.patches
    best, bar = (-1, -1), pair.high - tuning.REFINE_MIN_STEP
    for a, ka in enumerate(heavy_ids):
        ca = cost[ka]
        move_fits = pair.cap is None or pair.held_light + patches[ka] <= pair.cap
        steps = [(-1, 0.0, move_fits)]
        for b, kb in enumerate(light_ids):
            if cost[kb] < ca:
                steps.append((b, cost[kb], pair.cap is None or pair.fits(patches[ka] - patches[kb])))
        for b, cb, fits in steps:
            peak = max(pair.high - ca + cb, pair.low + ca - cb)
            if fits and peak < bar:
                best, bar = (a, b), peak - tuning.REFINE_MIN_STEP
    return best


@SETTINGS
@given(
    counts=alike_batches,
    seed=st.integers(0, 2**16),
    cap=st.sampled_from([None, 12.0, 25.0]),
    both_sides=st.booleans(),
)
def test_refinement_step_equals_a_scan(
    counts: list[list[int]], seed: int, cap: float | None, both_sides: bool
) -> None:
    batch = _batch(counts)
    rng = np.random.default_rng(seed)
    images = rng.permutation(batch.size).tolist()
    cut = int(rng.integers(0, batch.size + 1))
    heavy_ids, light_ids = images[:cut], images[cut:]
    high = sum(batch.cost[k] for k in heavy_ids)
    low = sum(batch.cost[k] for k in light_ids)
    held = [int(x) for x in rng.integers(0, 30, 2)]
    pair = _Pair(high, low, held[0], held[1], cap, both_sides)
    assert _best_step(batch, heavy_ids, light_ids, pair) == _best_step_by_scan(
        batch, heavy_ids, light_ids, pair
    )


def _bring_home_by_scan(batch: Batch, dest: list[int], limit: float, must_hold: list[bool]) -> list[int]:
    """Bring-home with a swap search for every image away (none skipped for an alike one)."""
    dest, load = list(dest), rank_loads(batch, dest)
    members: list[list[int]] = [[] for _ in range(batch.num_ranks)]
    for k, d in enumerate(dest):
        members[d].append(k)
    for _ in range(tuning.BRING_HOME_PASSES):
        away = sorted(
            (k for k in range(batch.size) if dest[k] != batch.home[k]), key=lambda k: -batch.patches[k]
        )
        moves = 0
        for k in away:
            h, d = batch.home[k], dest[k]
            alone_ok = len(members[d]) > 1 or not must_hold[d]
            if d == h:
                continue
            partner = -1
            if not (load[h] + batch.cost[k] <= limit and alone_ok):
                partner = _best_swap(batch, k, members[h], dest, load, limit)
                if partner < 0:
                    continue
            for j, src, dst in [(k, d, h)] + ([(partner, h, d)] if partner >= 0 else []):
                members[src].remove(j)
                members[dst].append(j)
                dest[j], load[dst], load[src] = dst, load[dst] + batch.cost[j], load[src] - batch.cost[j]
            moves += 1
        if not moves:
            break
    return dest


@SETTINGS
@given(counts=alike_batches, seed=st.integers(0, 2**16), slack=st.sampled_from([1.0, 1.1, 1.3]))
def test_bring_home_equals_a_plain_pass(counts: list[list[int]], seed: int, slack: float) -> None:
    batch = _batch(counts)
    rng = np.random.default_rng(seed)
    dest = rng.integers(0, batch.num_ranks, batch.size).tolist()
    limit = max(rank_loads(batch, dest)) * slack
    must_hold = [bool(x) for x in rng.integers(0, 2, batch.num_ranks)]
    assert bring_home(batch, dest, limit, must_hold) == _bring_home_by_scan(batch, dest, limit, must_hold)


def test_frames_of_one_size_are_searched_once_each_kind(monkeypatch) -> None:
    # Two ranks: 400 frames of 64 patches and three images of 256 on one, a quarter as many frames
    # and the same images on the other. Trying every frame, bring-home ran its swap search 104
    # times and the repair scored 490 exchanges (at 100 frames) per plan, 3-4 ms each.
    calls = {"swap": 0, "scored": 0}
    swap, better = locality_module._best_swap, repair_module._better

    def counted(name, search):
        def call(*args):
            calls[name] += 1
            return search(*args)

        return call

    monkeypatch.setattr(locality_module, "_best_swap", counted("swap", swap))
    monkeypatch.setattr(repair_module, "_better", counted("scored", better))
    for frames in (100, 400):
        plan = plan_rebalance([[64] * frames + [256] * 3, [64] * (frames // 4) + [256] * 3], FORCED)
        assert plan.applied and plan.makespan_after <= plan.lower_bound * 1.01
    assert calls["swap"] <= 8 and calls["scored"] <= 20


def test_bring_home_searches_again_once_a_rank_changed() -> None:
    # Images 4 and 8 are alike (6 patches, home rank 3, on rank 1) and 4 finds no swap. Image 7
    # (6 patches too, home 3, on rank 0) comes between them in the pass and swaps home with image
    # 2: rank 3 has changed, so 8 is searched again, and swaps home with image 1. Found in a
    # search of 200,000 random batches for one where skipping 8 gave another plan.
    batch = _batch([[], [], [9, 4, 10], [4, 6, 10, 9, 6, 6, 20]])
    dest, must_hold = [3, 3, 3, 1, 1, 0, 1, 0, 1, 2], [False, True, False, True]
    assert bring_home(batch, dest, 25.0, must_hold) == _bring_home_by_scan(batch, dest, 25.0, must_hold)


def _shed_and_fit_one_by_one(
    batch: Batch, target: float, limit: float, give_up_above: float
) -> list[int] | None:
    """Shed-and-fit placing every shed image alone: the least room that holds it, else the most."""
    shed = shed_by_cost_per_row(batch, target)
    dest = list(batch.home)
    left = [
        load - sum(batch.cost[k] for k in range(batch.size) if shed[k] and batch.home[k] == r)
        for r, load in enumerate(batch.loads)
    ]
    rooms = sorted((limit - load, r) for r, load in enumerate(left))
    for k in sorted(np.flatnonzero(shed).tolist(), key=lambda k: (-batch.cost[k], k)):
        fitting = [entry for entry in rooms if entry[0] >= batch.cost[k]]
        room, r = fitting[0] if fitting else rooms[-1]
        if room - batch.cost[k] < limit - give_up_above:
            return None
        rooms.remove((room, r))
        rooms = sorted([*rooms, (room - batch.cost[k], r)])
        dest[k] = r
    return dest


@SETTINGS
@given(
    counts=st.lists(st.lists(st.sampled_from([4, 8, 12]), min_size=0, max_size=40), min_size=2, max_size=5),
    aim=st.sampled_from([0.0, 0.001, 0.05]),
    slack=st.sampled_from([0.0, 0.004, 0.1]),
    give_up=st.sampled_from([1.002, 1.05, math.inf]),
)
def test_fit_places_alike_images_as_one_by_one(
    counts: list[list[int]], aim: float, slack: float, give_up: float
) -> None:
    # Shed-and-fit puts a run of images of one cost on the rank it chose for the first while that
    # rank holds them: placed alone, each would pick it again (its room was the least that held
    # one and only shrinks).
    batch = _batch(counts)
    if not batch.size:
        return
    target, limit = batch.lower_bound * (1.0 + aim), batch.tight_bound * (1.0 + slack)
    got = shed_and_fit(batch, target, limit, give_up_above=batch.lower_bound * give_up)
    want = _shed_and_fit_one_by_one(batch, target, limit, batch.lower_bound * give_up)
    assert (got is None and want is None) or (got is not None and got.tolist() == want)
