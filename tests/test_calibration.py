"""``calibrate_cost=True``: the cost model fitted online to measured ViT times, the same on every rank."""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import towers
from multirank import caught, subgroup
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from lightning_vit_balance import ViTBalanceConfig, ViTBalancer, plan_rebalance
from lightning_vit_balance.outputs import unwrap_module

POOL = 4
RANKS = 3
STEPS = 16


def _calibrating(trigger_threshold: float = 0.0) -> tuple[int, towers.TensorTower, ViTBalancer] | None:
    """In a worker: this rank, the tensor tower and a balancer over ranks 0-2 that calibrates and
    applies every plan (or those above ``trigger_threshold``); None on the other ranks."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    torch.manual_seed(0)
    config = ViTBalanceConfig(calibrate_cost=True, trigger_threshold=trigger_threshold, min_gain=0.0)
    return rank, towers.TensorTower(), ViTBalancer(config, group)


def _calibrating_run() -> dict[str, Any] | None:
    setup = _calibrating()
    if setup is None:
        return None
    rank, tower, balancer = setup
    draw = random.Random(1234 + rank)
    models, fit_figures = [], []
    for step in range(STEPS):
        sides = [2 * draw.randint(1, 6) for _ in range(draw.randint(1, 3))]
        grids = [(1, side, 2 * draw.randint(1, 6)) for side in sides]
        pixels, grid = towers.make_batch(grids, seed=100 * step + rank)
        out = balancer(tower, pixels, grid)
        # Same ops on the same rows in another batch: fp32 agrees to a few ulps.
        torch.testing.assert_close(out, tower(pixels, grid), rtol=1e-4, atol=1e-5)
        assert balancer._calibrator is not None
        models.append(balancer._calibrator.fingerprint())
        stats = balancer.last_stats
        assert stats is not None and stats.cost_model == balancer._calibrator.model
        # NaN != NaN once pickled across ranks: None stands for it.
        errors = (stats.cost_error, balancer._calibrator.last_error)
        error, last = (None if math.isnan(e) else e for e in errors)
        fit_figures.append((stats.cost_fits, error, last))
        # What the next call sends: the settings and the fit's state so far, as the config's own
        # fingerprint with the state as an extra setting says (the ranks compare it), and no batch
        # of a plan made ahead (this call gathered its own).
        expected = balancer.config.fingerprint(cost_fit=balancer._calibrator.state_fingerprint())
        assert balancer._settings_fingerprint() == (*expected, ("previous_call_plan", 0))
    stats = balancer.last_stats
    assert stats is not None
    fits = balancer._calibrator.fits
    return {"models": models, "fits": fits, "vit_ms": stats.vit_ms, "fit_figures": fit_figures}


def test_every_rank_fits_the_same_cost_model(multirank: Any) -> None:
    with multirank(POOL) as w:
        results = w.run(_calibrating_run)[:RANKS]
    assert all(r["models"] == results[0]["models"] for r in results), "ranks fitted different models"
    assert results[0]["fits"] > 0, "no fit after 16 steps of varied image sizes"
    assert results[0]["models"][-1] != results[0]["models"][0], "the model never left its initial value"
    assert len(results[0]["vit_ms"]) == RANKS and all(v >= 0 for v in results[0]["vit_ms"])
    # Each call's stats tell the fit's progress and error, the same on every rank: fits counted
    # up from 0, an error known once a fit has met a call's times.
    figures = results[0]["fit_figures"]
    assert all(r["fit_figures"] == figures for r in results), "ranks reported different fits"
    fits = [count for count, _, _ in figures]
    assert fits == sorted(fits) and fits[0] == 0 and fits[-1] == results[0]["fits"]
    assert all(error is None for count, error, _ in figures if count == 0)
    known = [error for _, error, _ in figures if error is not None]
    assert known and all(error >= 0 for error in known)
    assert all(error == last for _, error, last in figures)


class _FailsOnRankOne(towers.TensorTower):
    """Raises on rank 1 while ``failing``: a caught error the loop goes on from."""

    failing = False

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        if self.failing and dist.get_rank() == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return super().forward(pixel_values, grid_thw)


def _figures_after_a_failure(skipped: bool) -> dict[str, Any] | None:
    """The ViT times the calls after a failed call, and after a plan made ahead but never used,
    carry into their gathers (the cost fit's input)."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    torch.manual_seed(0)
    tower = _FailsOnRankOne()
    fields = {"trigger_threshold": 100.0, "check_skipped_calls": True} if skipped else {}
    config = ViTBalanceConfig(calibrate_cost=True, **{"trigger_threshold": 0.0, "min_gain": 0.0, **fields})
    balancer = ViTBalancer(config, group)
    grids = [[(1, 8, 8), (1, 8, 8)], [(1, 2, 2)], [(1, 4, 4)]][rank]
    pixels, grid = towers.make_batch(grids, seed=rank)
    balancer(tower, pixels, grid)
    tower.failing = True
    with pytest.raises(RuntimeError, match="rank 1: the ViT raised OutOfMemoryError"):
        balancer(tower, pixels, grid)
    tower.failing = False
    balancer(tower, pixels, grid)
    assert balancer.last_stats is not None
    after_failure = balancer.last_stats.vit_ms
    timed = balancer.prepare(pixels, grid, tower)  # a ticket never used...
    assert timed is not None and all(m.vit_us >= 0 for m in timed.metadata)  # ...carrying a good call's
    unused = balancer.prepare(pixels, grid, tower)
    assert unused is not None
    return {"after_failure": after_failure, "after_unused_plan": [m.vit_us for m in unused.metadata]}


@pytest.mark.parametrize("skipped", [False, True])
def test_no_figure_of_a_failed_call_reaches_the_fit(multirank: Any, skipped: bool) -> None:
    """A failed call's time is unknown on every rank (the failing rank's time up to its error, or
    an earlier call's, fitted a quadratic term 700x too small), and so is the time of a plan never
    used (no forward ran for its images)."""
    with multirank(POOL) as w:
        results = w.run(_figures_after_a_failure, skipped)[:RANKS]
    assert all(r["after_failure"] == (-1.0,) * RANKS for r in results), results
    assert all(r["after_unused_plan"] == [-1] * RANKS for r in results), results


def _loops_measured_apart() -> dict[str, Any] | None:
    """Training calls, then evaluation calls whose ViT takes 200 ms more (``measure_as("eval")``),
    then training again, then evaluation again after ``forget_loop("eval")`` (and after it again,
    in the loop): the ViT times each call reports, and the cost fits the ranks made."""
    import time

    setup = _calibrating()
    if setup is None:
        return None
    rank, tower, balancer = setup
    pixels, grid = towers.make_batch([[(1, 8, 8), (1, 8, 8)], [(1, 2, 2)], [(1, 4, 4)]][rank], seed=rank)
    loops = (
        ("train", 2),
        ("eval", 2),
        ("train again", 2),
        ("eval forgotten", 2),
        ("eval forgotten in it", 1),
    )
    reported: dict[str, list[tuple[float, ...]]] = {loop: [] for loop, _ in loops}
    for loop, calls in loops:
        if loop.startswith("eval forgotten"):
            balancer.forget_loop("eval")  # another loop's first, then the loop's own
        balancer.measure_as(loop.split()[0])
        slow = (
            tower.register_forward_pre_hook(lambda module, args: time.sleep(0.2))
            if loop.startswith("eval")
            else None
        )
        for _ in range(calls):
            balancer(tower, pixels, grid)
            assert balancer.last_stats is not None
            reported[loop].append(balancer.last_stats.vit_ms)
        if slow is not None:
            slow.remove()
    assert balancer._calibrator is not None
    return {"reported": reported, "fit": balancer._calibrator.state_fingerprint()}


def test_each_loop_reports_its_own_measured_times(multirank: Any) -> None:
    """A call reports the previous call's ViT time: the first training call after an evaluation
    reported the evaluation's (200 ms here, against a training call's fraction of one). Each loop
    now keeps its own figures: a loop's first call reports none, or its own last call's; the online
    fit, fed from the gathered figures, stays the same on every rank."""
    with multirank(POOL) as w:
        results = w.run(_loops_measured_apart)[:RANKS]
    assert len({r["fit"] for r in results}) == 1, results
    for r in results:
        train, evaluation, again = r["reported"]["train"], r["reported"]["eval"], r["reported"]["train again"]
        assert train[0] == evaluation[0] == (-1.0,) * RANKS, r  # the loops' first calls: none yet
        assert all(ms >= 200.0 for ms in evaluation[1]), r  # the first evaluation call's
        # The last training call's before the evaluation, then the first one's after it: a wall
        # clock, so with room for a loaded machine.
        assert all(0.0 <= ms < 100.0 for ms in again[0] + again[1]), r
        # Forgotten, the evaluation's clocks go: its next first call reports none of the last
        # evaluation's 200 ms (then its own), and so does a call after forgetting mid-loop.
        forgotten = r["reported"]["eval forgotten"]
        assert forgotten[0] == (-1.0,) * RANKS and all(ms >= 200.0 for ms in forgotten[1]), r
        assert r["reported"]["eval forgotten in it"] == [(-1.0,) * RANKS], r


def _observed_with_plans_made_a_batch_ahead(checkpointed: bool) -> dict[str, Any] | None:
    """Plans made one batch ahead (``prepare`` of batch n + 1 before the call of batch n, as early as
    the batches are known): the patch counts each measured time is fitted with. ``checkpointed``:
    each call under non-reentrant activation checkpointing, recomputed in its backward pass."""
    setup = _calibrating()
    if setup is None:
        return None
    rank, tower, balancer = setup
    assert balancer._calibrator is not None
    observed: list[tuple[int, ...]] = []
    observe = balancer._calibrator.observe

    def recording(counts: Any, milliseconds: list[float], frames: Any = None) -> None:
        if all(m >= 0 for m in milliseconds):  # a time measured on every rank
            observed.append(tuple(sum(rank_counts) for rank_counts in counts))
        observe(counts, milliseconds, frames)

    balancer._calibrator.observe = recording  # type: ignore[method-assign]
    sides = [8, 2, 6, 4, 10]
    batches = [towers.make_batch([(1, side, 2 + 2 * rank)] * (1 + rank), seed=rank) for side in sides]
    tickets = [balancer.prepare(*batches[0])]
    encoded = []
    for n in range(len(batches) - 1):
        tickets.append(balancer.prepare(*batches[n + 1]))
        pixels, grid = batches[n]
        if checkpointed:
            call = functools.partial(balancer, tower, grid_thw=grid, prepared=tickets[n])
            checkpoint(call, pixels, use_reentrant=False).pow(2).sum().backward()
        else:
            balancer(tower, pixels, grid, prepared=tickets[n])
        plan = tickets[n].plan
        arrivals = (
            plan.arrivals_of_every_rank()
            if plan.applied
            else [[(r, i) for i in range(len(c))] for r, c in enumerate(plan.patch_counts)]
        )
        encoded.append(tuple(sum(plan.patch_counts[src][i] for src, i in images) for images in arrivals))
    return {"observed": observed, "encoded": encoded}


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_measured_time_is_fitted_with_the_images_its_call_encoded(
    multirank: Any, checkpointed: bool
) -> None:
    """A plan made ahead of the call before it took the place of that call's patch counts: the fit
    paired call n's time with the images of call n + 1 (the last one planned). Under non-reentrant
    checkpointing no time reached the fit: each recomputation, ended early by an error the call saw
    as a failure, made the clock forget its forward's time."""
    with multirank(POOL) as w:
        results = w.run(_observed_with_plans_made_a_batch_ahead, checkpointed)[:RANKS]
    observed, encoded = results[0]["observed"], results[0]["encoded"]
    assert all(r == results[0] for r in results), results
    # Each prepare n + 1 (n >= 1) carries the time of call n - 1: the calls before the last one.
    assert observed == encoded[: len(observed)] and len(observed) == len(encoded) - 1, results[0]


def _teacher_planned_ahead_then_checkpointed_student() -> list[tuple[bool, bool]] | None:
    """Two calls of one calibrating balancer on the same images each step: a frozen teacher's under
    ``no_grad`` on a plan made ahead, then a student's under non-reentrant checkpointing. The
    teacher's plans are made to differ from the student's (skipped; the student's applied), as the
    cost fit refitted between the two calls can make them. Per step: whether the teacher's plan and
    the student's were applied."""
    setup = _calibrating()
    if setup is None:
        return None
    rank, tower, balancer = setup
    student = towers.TensorTower(dim=8)
    planned, skipping = balancer._planned, [False]

    def planned_for(metadata: Any, frames: Any, cost_model: Any) -> Any:
        if skipping[0]:
            return plan_rebalance([m.patch_counts for m in metadata], ViTBalanceConfig(trigger_threshold=5.0))
        return planned(metadata, frames, cost_model)

    balancer._planned = planned_for  # type: ignore[method-assign]
    applied = []
    for step in range(3):
        pixels, grid = towers.make_batch([(1, 4, 2 + 2 * rank)] * (1 + 2 * rank), seed=step)
        skipping[0] = True
        ticket = balancer.prepare(pixels, grid, tower)
        skipping[0] = False
        assert ticket is not None
        with torch.no_grad():
            balancer(tower, pixels, grid, prepared=ticket)
        rows = pixels.clone().requires_grad_(True)
        out = checkpoint(functools.partial(balancer, student, grid_thw=grid), rows, use_reentrant=False)
        out.pow(2).sum().backward()  # the recomputation recalls the student's plan
        stats = balancer.last_stats
        assert stats is not None
        applied.append((ticket.plan.applied, stats.applied))
        reference = pixels.clone().requires_grad_(True)
        student(reference, grid).pow(2).sum().backward()
        # Same ops on the same rows in batches of other sizes: fp32 agrees to a few ulps.
        torch.testing.assert_close(rows.grad, reference.grad, rtol=1e-4, atol=1e-5)
    return applied


def test_a_recomputation_recalls_its_calls_plan_past_a_frozen_call_planned_ahead(multirank: Any) -> None:
    """A plan made ahead was remembered for recomputation in the grad mode of ``prepare``: a frozen
    teacher's call under ``no_grad`` then counted as one that built a graph, and the student's
    recomputation of the same images, planned otherwise, raised on every rank that it could not
    tell which plan was its own. A plan made ahead is remembered when its call runs."""
    with multirank(POOL) as w:
        results = w.run(_teacher_planned_ahead_then_checkpointed_student)[:RANKS]
    assert all(r == [(False, True)] * 3 for r in results), results


def _towers_told_apart() -> list[int] | None:
    """Fit warnings group rank 0 records: two towers through one calibrating balancer (one, however
    often they alternate), a tower rebuilt in place of a dead one (none), a balancer that does not
    calibrate (none)."""
    setup = _calibrating()
    if setup is None:
        return None
    rank, tower, balancer = setup
    pixels, grid = towers.make_batch([(1, 4, 2 + 2 * rank)] * (1 + 2 * rank), seed=rank)

    def told(target: ViTBalancer, *vits: Any) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for vit in vits:
                target(vit() if callable(vit) and not isinstance(vit, torch.nn.Module) else vit, pixels, grid)
        told = [w for w in caught if "fitted together" in str(w.message)]
        assert all(w.filename == __file__ for w in told), [w.filename for w in told]  # the caller's line
        return len(told)

    other = towers.TensorTower(dim=8)
    two = told(ViTBalancer(balancer.config, balancer.group), tower, tower, other, other, tower)
    # Each call's tower is made for it and dies after it: the next one takes the fit over.
    rebuilt = told(ViTBalancer(balancer.config, balancer.group), *[lambda: towers.TensorTower(dim=8)] * 3)
    plain = ViTBalancer(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0), balancer.group)
    # One tower, wrapped for some calls only (activation checkpointing's wrapper; torch.compile's
    # keeps it in _orig_mod too).
    assert unwrap_module(torch.compile(checkpoint_wrapper(tower))) is tower
    wrapped = told(ViTBalancer(balancer.config, balancer.group), tower, checkpoint_wrapper(tower), tower)
    return [two, rebuilt, told(plain, tower, other), wrapped]


def test_a_second_tower_through_one_calibrating_balancer_warns_once(multirank: Any) -> None:
    with multirank(POOL) as w:
        told = w.run(_towers_told_apart)
    assert told[0] == [1, 0, 0, 0] and told[1:RANKS] == [[0, 0, 0, 0]] * (RANKS - 1), told


def _state_loaded_on_one_rank() -> list[str]:
    """A fit's state saved after the first steps, loaded again on rank 0 alone: its window and
    counters then differ from the others', so it would fit on other calls (plans apart)."""
    group = subgroup(RANKS)
    if dist.get_rank() >= RANKS:
        return []
    torch.manual_seed(0)
    tower = towers.TensorTower()
    balancer = ViTBalancer(ViTBalanceConfig(calibrate_cost=True, trigger_threshold=0.0, min_gain=0.0), group)
    errors = []
    for step in range(6):
        if step == 3:
            saved = balancer.state_dict()
        if step == 5 and dist.get_rank() == 0:
            balancer.load_state_dict(saved)
        grids = [(1, 2 * (1 + (step + dist.get_rank()) % 4), 4)] * (1 + dist.get_rank())
        try:
            balancer(tower, *towers.make_batch(grids, seed=step))
        except ValueError as error:
            errors.append(f"step {step}: {str(error).splitlines()[0]}")
    return errors


def test_a_cost_fit_state_loaded_on_some_ranks_only_fails_on_every_rank(multirank: Any) -> None:
    with multirank(POOL) as w:
        errors = w.run(_state_loaded_on_one_rank)[:RANKS]
    assert len({tuple(e) for e in errors}) == 1 and len(errors[0]) == 1, errors
    assert errors[0][0].startswith("step 5: ") and "settings differ between ranks: cost_fit" in errors[0][0]
    # Named as what it is: no config field differs, a checkpoint was loaded apart.
    assert "cost fit's state, its model, counters and measured steps: a checkpoint loaded" in errors[0][0]


def _stale_plan_that_moved_nothing() -> list[str] | None:
    """Rank 1 passes the previous batch's plan made ahead, where its own rows are the same in both
    and neither plan moves an image: the call's outputs are right, but its measured time would be
    fitted with other ranks' figures than the others', so the fits (and plans) would part."""
    setup = _calibrating(trigger_threshold=50.0)
    if setup is None:
        return None
    rank, tower, balancer = setup
    mine = [(1, 4, 4), (1, 8, 8)]

    def batch(theirs: list[tuple[int, int, int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return towers.make_batch(mine if rank == 1 else theirs, seed=seed)

    for step in range(4):
        balancer(tower, *batch([(1, 2 * (step + 1), 4)], step))
    earlier = balancer.prepare(*batch([(1, 2, 2)], 10), tower)
    pixels, grid = batch([(1, 10, 10), (1, 8, 8)], 11)
    current = balancer.prepare(pixels, grid, tower)
    assert earlier is not None and current is not None and not current.plan.applied
    out = balancer(tower, pixels, grid, prepared=earlier if rank == 1 else current)
    # Same ops on the same rows in another batch: fp32 agrees to a few ulps.
    torch.testing.assert_close(out, tower(pixels, grid), rtol=1e-4, atol=1e-5)
    outcomes = []
    for step in range(2):  # the next call fails on every rank; the one after goes on
        try:
            balancer(tower, *batch([(1, 6, 6)], 20 + step))
            outcomes.append("ok")
        except ValueError as error:
            outcomes.append(str(error).splitlines()[0])
    return outcomes


def _stale_plan_that_moved_images() -> list[str] | None:
    """Rank 1 passes the plan of another batch that moves the same rows (rank 0's last image
    transposed): the call fails on every rank (the plans' batches differ), and the next call, a
    correct one, must not fail again for the figures the failed call left apart."""
    setup = _calibrating()
    if setup is None:
        return None
    rank, tower, balancer = setup

    def batch(last: tuple[int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return towers.make_batch([(1, 8, 8), (1, 8, 8), last] if rank == 0 else [(1, 2, 2)], seed=seed)

    for step in range(2):
        balancer(tower, *batch((1, 4, 8), step))
    earlier = balancer.prepare(*batch((1, 4, 8), 5), tower)
    pixels, grid = batch((1, 8, 4), 6)
    current = balancer.prepare(pixels, grid, tower)
    assert earlier is not None and current is not None and earlier.plan.applied and current.plan.applied
    outcomes = []
    given = earlier if rank == 1 else current
    for prepared, inputs in ((given, (pixels, grid)), (None, batch((1, 4, 4), 7))):
        try:
            balancer(tower, *inputs, prepared=prepared)
            outcomes.append("ok")
        except (RuntimeError, ValueError) as error:
            outcomes.append(str(error).splitlines()[0])
    return outcomes


@pytest.mark.parametrize(
    ("moved", "fragment"),
    [
        (False, "previous_call_plan (ranks [1] differ from rank 0; the call before"),
        (True, "plans made before the call for different batches"),
    ],
    ids=["moved_nothing", "moved_images"],
)
def test_a_plan_of_another_batch_fails_one_call_and_the_next_works(
    multirank: Any, moved: bool, fragment: str
) -> None:
    """Where the plan moved nothing, the call after it fails (the figures the fit would be fed
    differ); where it moved images, that call fails. Then no figure is left apart for the next."""
    case = _stale_plan_that_moved_images if moved else _stale_plan_that_moved_nothing
    with multirank(POOL) as w:
        outcomes = w.run(case)[:RANKS]
    assert len({tuple(o) for o in outcomes}) == 1, outcomes
    failed, next_call = outcomes[0]
    assert fragment in failed, failed
    assert next_call == "ok"


def _calibrating_on_one_rank() -> str | None:
    group = subgroup(RANKS)
    if dist.get_rank() >= RANKS:
        return None
    balancer = ViTBalancer(ViTBalanceConfig(calibrate_cost=dist.get_rank() == 1), group)
    with caught(ValueError) as outcome:
        balancer(towers.TensorTower(), *towers.make_batch([(1, 2, 4)], seed=0))
    return outcome.message.splitlines()[0]


def test_calibrate_cost_on_some_ranks_only_fails_on_every_rank(multirank: Any) -> None:
    """The fit's state travels in every rank's gather row, calibrating or not: a rank calibrating
    among ranks that do not differs in named settings, not in the length of its row (which gloo
    aborts on and NCCL would wait for)."""
    with multirank(POOL) as w:
        errors = w.run(_calibrating_on_one_rank)[:RANKS]
    assert len(set(errors)) == 1, errors
    assert "settings differ between ranks: calibrate_cost (ranks [1] differ from rank 0)" in errors[0]


def _config_set_on_one_rank() -> str | None:
    setup = _calibrating()
    if setup is None:
        return None
    rank, tower, balancer = setup
    pixels, grid = towers.make_batch([(1, 4, 2 + 2 * rank)] * (1 + 2 * rank), seed=rank)
    balancer(tower, pixels, grid)
    if rank == 0:  # set between calls on one rank only: its gathers told no rank
        balancer.config = dataclasses.replace(balancer.config, trigger_threshold=100.0)
    with caught(ValueError) as outcome:
        balancer(tower, pixels, grid)
    return outcome.message


def test_a_config_set_on_one_rank_fails_on_every_rank(multirank: Any) -> None:
    with multirank(POOL) as w:
        messages = w.run(_config_set_on_one_rank)[:RANKS]
    assert len(set(messages)) == 1 and "trigger_threshold (ranks [1, 2] differ from rank 0)" in messages[0], (
        messages
    )


def test_a_config_set_on_a_balancer_takes_its_settings_and_cost_fit_with_it() -> None:
    """``balancer.config = ...`` between calls: the settings the gathers compare and the cost fit
    follow (they were made once, at construction: a fit turned on later never ran)."""
    from dataclasses import replace

    balancer = ViTBalancer(ViTBalanceConfig())
    assert (
        balancer.state_dict() == {} and balancer._settings_fingerprint()[:-2] == balancer.config.fingerprint()
    )
    balancer.config = replace(balancer.config, calibrate_cost=True, trigger_threshold=0.5)
    assert (
        balancer._settings_fingerprint()[:-2]
        == ViTBalanceConfig(calibrate_cost=True, trigger_threshold=0.5).fingerprint()
    )
    assert list(balancer.state_dict()) == ["cost_calibrator"]
    assert balancer._calibrator is not None
    fitted = balancer._calibrator
    fitted.observe(((64, 16), (4,)), [2.0, 0.5])
    balancer.config = replace(balancer.config, max_len_ratio=2.0)  # the fit goes on, as it is
    assert balancer._calibrator is fitted
    balancer.config = replace(balancer.config, cost_linear=1.0)  # from another start: a copy
    assert balancer._calibrator is not fitted
    assert balancer.state_dict()["cost_calibrator"]["steps_observed"] == fitted.state_dict()["steps_observed"]
    with pytest.warns(RuntimeWarning, match="the cost fit so far is not used .* starts afresh") as told:
        balancer.config = replace(balancer.config, cost_windowed=1.0, cost_window_patches=4)
    assert [w.filename for w in told] == [__file__]  # the line that set it, not the package's
    assert balancer.state_dict()["cost_calibrator"]["steps_observed"] == 0
    balancer.config = replace(balancer.config, calibrate_cost=False)
    assert balancer.state_dict() == {}
    with pytest.raises(TypeError, match="expected a ViTBalanceConfig"):
        balancer.config = {"enabled": True}  # type: ignore[assignment]


def test_a_balancer_checkpoints_its_cost_fit_only_when_it_calibrates() -> None:
    plain, calibrating = ViTBalancer(ViTBalanceConfig()), ViTBalancer(ViTBalanceConfig(calibrate_cost=True))
    assert plain.state_dict() == {}
    state = calibrating.state_dict()
    assert list(state) == ["cost_calibrator"] and state["cost_calibrator"]["steps_observed"] == 0
    plain.load_state_dict(state)  # calibrate_cost turned off since: nothing to go on with
    assert plain.state_dict() == {}
    calibrating.load_state_dict({})  # turned on since: the fit starts afresh
    assert calibrating.state_dict() == state
    with pytest.raises(ValueError, match=r"ViTBalancer\.load_state_dict: state=.* expected a mapping"):
        calibrating.load_state_dict([("cost_calibrator", {})])  # type: ignore[arg-type]
    # A key misspelled, or a mapping of another level (a whole checkpoint), was taken without a
    # word: the fit lost, and the mapping saved back by state_dict().
    for foreign in ({"cost_calibrater": {}}, {"model": {}, "vit_balance": state}):
        for load in (calibrating.load_state_dict, plain.load_state_dict):
            with pytest.raises(
                ValueError, match=r"state has the keys \[.*\], which no balancer's state_dict"
            ):
                load(foreign)
    windowed = ViTBalancer(ViTBalanceConfig(calibrate_cost=True, cost_windowed=1.0, cost_window_patches=4))
    with pytest.raises(ValueError, match="fits window_patches=4"):
        windowed.load_state_dict(state)
