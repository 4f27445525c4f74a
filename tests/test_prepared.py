"""Plans made before the forward (``ViTBalancer.prepare``) on real gloo ranks."""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import towers
from equivalence import run_cases
from multirank import caught, groups_taken_for_nccl, skip_without_fsdp2, subgroup
from test_balancer import THRESHOLD_0, standard_cases

from lightning_vit_balance import ViTBalanceConfig, ViTBalancer, make_host_group, plan_rebalance
from lightning_vit_balance import prepared as prepared_module
from lightning_vit_balance.exchange import RankMetadata
from lightning_vit_balance.host_group import _twin_ranks
from lightning_vit_balance.prepared import PreparedPlan, batch_digest, grid_gcd

POOL = 4
#: In the forward of a prepared applied call: the pixel trip, the status gather, the return trip.
PREPARED_APPLIED = 3


def _prepared_suite(n: int, checked: bool) -> dict[str, Any] | None:
    cases = standard_cases(n)
    config = {**THRESHOLD_0, "check_skipped_calls": checked}
    results = {
        name: run_cases(n, name, cases, "float32", config, prepared=True) for name in ("tensor", "window")
    }
    return None if results["tensor"] is None else results


@pytest.mark.parametrize(("n", "checked"), [(2, False), (3, False), (3, True)])
def test_prepared_calls_equal_the_direct_call(multirank: Any, n: int, checked: bool) -> None:
    """Outputs and summed gradients as the direct call; no gather and no plan in the forward, and
    in a skipped call nothing at all, or only the status gather with ``check_skipped_calls`` (and
    in a step without images anywhere, where each rank encodes a dummy of its own rows). The stats
    give the preparation's time apart from the call's (``prepare_seconds``)."""
    with multirank(POOL) as w:
        per_rank = w.run(_prepared_suite, n, checked)[:n]
    for rank_results in per_rank:
        for results in rank_results.values():
            assert results[0]["applied"] and not all(r["applied"] for r in results)
            for r in results:
                expected = PREPARED_APPLIED if r["applied"] else int(checked or r["reason"] == "no-images")
                assert r["counted"] == r["collectives"] == expected, r
                assert r["plan_seconds"] == 0.0 and r["prepare_seconds"] > 0.0, r
            # Routes, trips and return layouts are made in prepare(), except the first applied
            # call's layout, made before the ViT's outputs were ever seen.
            assert results[0]["made_in_forward"] == 1
            assert all(r["made_in_forward"] == 0 for r in results[1:]), results


def _check_skipped_calls_set_after_prepare(first: bool) -> list[str] | None:
    """``check_skipped_calls`` set on rank 0 alone between ``prepare()`` and its skipped call (on
    or off): the call follows the plan's settings, which every rank's gather compared, so no rank
    gathers the status word alone (it met the others' next gather: garbled rows, a gloo abort)."""
    group = subgroup(3)
    rank = dist.get_rank()
    if rank >= 3:
        return None
    torch.manual_seed(0)
    tower = towers.TensorTower()
    pixels, grid = towers.make_batch([(1, 4, 4)], seed=rank)  # equal loads: every plan skips
    balancer = ViTBalancer(ViTBalanceConfig(check_skipped_calls=first), group)
    outcomes = []
    for step in range(3):
        prepared = balancer.prepare(pixels, grid, tower)
        if rank == 0 and step == 0:
            balancer.config = dataclasses.replace(balancer.config, check_skipped_calls=not first)
        out = balancer(tower, pixels, grid, prepared=prepared)
        torch.testing.assert_close(out, tower(pixels, grid), rtol=0, atol=0)  # encoded at home
        assert balancer.last_stats is not None
        outcomes.append(f"{balancer.last_stats.reason}: {balancer.last_stats.collectives}")
        if rank == 0 and step == 0:
            balancer.config = dataclasses.replace(balancer.config, check_skipped_calls=first)
    return outcomes


def _dense_copy_planned(kind: str) -> str | None:
    """A plan that moves nothing, unchecked, made from a dense copy of the batch; rank 1's call
    passes a sparse grid or mkldnn pixels, which its ViT cannot take: it raises alone (no
    collective follows), saying why (it raised torch's own error from the ViT), and every rank's
    next call goes on."""
    setup = _on_three_ranks([[(1, 4, 4)], [(1, 4, 4)], [(1, 4, 4)]], {"trigger_threshold": 100.0})
    if setup is None:
        return None
    rank, tower, pixels, grid, balancer = setup
    ticket = balancer.prepare(pixels, grid, tower)
    given_pixels, given_grid = pixels, grid
    if rank == 1 and kind == "grid":
        given_grid = grid.to_sparse()
    if rank == 1 and kind == "pixels":
        given_pixels = pixels.to_mkldnn()
    try:
        balancer(tower, given_pixels, given_grid, prepared=ticket)
        outcome = "ok"
    except ValueError as error:
        outcome = str(error)
    balancer(tower, pixels, grid)  # in step
    return outcome


@pytest.mark.parametrize(("kind", "fragment"), [("grid", "grid_thw is a sparse"), ("pixels", "is a mkldnn")])
def test_a_skipped_unchecked_call_says_why_it_cannot_take_input_that_is_not_dense(
    multirank: Any, kind: str, fragment: str
) -> None:
    with multirank(POOL) as w:
        outcomes = w.run(_dense_copy_planned, kind)[:3]
    assert outcomes[0] == outcomes[2] == "ok", outcomes
    assert outcomes[1].startswith("Invalid prepared balanced ViT call on rank 1: "), outcomes
    assert fragment in outcomes[1], outcomes


@pytest.mark.parametrize("first", [False, True])
def test_a_prepared_call_checks_as_its_plans_settings_said(multirank: Any, first: bool) -> None:
    with multirank(POOL) as w:
        outcomes = w.run(_check_skipped_calls_set_after_prepare, first)[:3]
    # The prepared call's own collectives: the status gather where the plan's settings check.
    assert outcomes == [[f"below-threshold: {int(first)}"] * 3] * 3, outcomes


#: Every plan of :func:`_mismatch`'s batches skips, and skipped calls are checked.
SKIPPED_CHECKED = {"trigger_threshold": 100.0, "check_skipped_calls": True}


class _Setup(NamedTuple):
    rank: int
    tower: Any
    pixels: torch.Tensor
    grid: torch.Tensor
    balancer: ViTBalancer


def _on_three_ranks(grids: list[list[tuple[int, int, int]]], config: dict[str, Any]) -> _Setup | None:
    """In a worker: the tensor tower, this rank's batch of ``grids[rank]`` and a balancer over
    ranks 0-2; None on the other ranks."""
    group = subgroup(3)
    rank = dist.get_rank()
    if rank >= 3:
        return None
    torch.manual_seed(0)
    pixels, grid = towers.make_batch(grids[rank], seed=rank)
    return _Setup(rank, towers.TensorTower(), pixels, grid, ViTBalancer(ViTBalanceConfig(**config), group))


def _mismatch(kind: str, skipped: bool, sharded: bool = False) -> tuple[str, str, float] | None:
    grids = [
        [(1, 8, 8), (1, 8, 8)],
        [(2, 2, 2), (1, 2, 2)] if kind == "temporal" else [(1, 2, 2)],
        [(1, 4, 4)],
    ]
    setup = _on_three_ranks(grids, SKIPPED_CHECKED if skipped else THRESHOLD_0)
    if setup is None:
        return None
    rank, tower, pixels, grid, balancer = setup
    if sharded:  # the tower an FSDP2 unit: each of its calls gathers its parameters
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(tower, mesh=DeviceMesh.from_group(balancer.group, "cpu"))
    ticket = balancer.prepare(pixels, grid, tower)
    assert ticket is not None and ticket.plan.applied is not skipped
    if rank == 1 and kind == "rows":
        pixels, grid = towers.make_batch([(1, 2, 4)], seed=rank)  # another batch than prepared
    if rank == 1 and kind == "values":
        grid = torch.tensor([[1, 1, 4]])  # same patches, other grid values
    if rank == 1 and kind == "temporal":
        grid = grid.flip(0)  # the same heights and widths and rows in all, other temporal sizes
    if rank == 1 and kind == "grad":
        pixels = pixels.clone().requires_grad_(True)  # its gradient would not come back
    if rank == 1 and kind == "dtype":
        pixels = pixels.double()  # wider than the dtype the plan sends
    if rank == 1 and kind == "narrow":
        # Narrower: the plan's float32 holds it, but rank 1 would encode others' rows in float16.
        pixels = pixels.half()
    if rank == 1 and kind == "grid_dtype":
        grid = grid.to(torch.int16)  # too narrow to hold every rank's grid rows
    if rank == 1 and kind == "no_grid":
        grid = None  # what the drop-in passes for images and videos it could not combine
    if rank == 1 and kind == "no_pixels":
        pixels = None  # a text-only batch's pixel_values, where the plan was made for rows
    if rank == 1 and kind == "device":
        pixels = pixels.to("meta")  # a device the group cannot carry: the trip would fail here alone
    if rank == 1 and kind == "sparse":
        pixels = pixels.to_sparse()  # planned from a dense copy: the trip would fail here alone
    if rank == 1 and kind == "sparse_grid":
        grid = grid.to_sparse()  # comparing its values with the plan's would fail here alone
    started = time.perf_counter()
    try:
        balancer(tower, pixels, grid, prepared=ticket)
        outcome = ("ok", "", time.perf_counter() - started)
    except ValueError as error:
        outcome = ("ValueError", str(error), time.perf_counter() - started)
    # Still in step: an unprepared call works everywhere.
    pixels, grid = towers.make_batch(grids[rank], seed=rank)
    torch.testing.assert_close(balancer(tower, pixels, grid), tower(pixels, grid), rtol=1e-4, atol=1e-5)
    return outcome


def _prepared_on_some_ranks(checked: bool) -> tuple[str, str] | None:
    """Ranks 0 and 2 prepare their step's plan, rank 1 calls without one (``checked``: every rank
    prepared and called, rank 1 then checks its pending calls while the others call again)."""
    setup = _on_three_ranks([[(1, 8, 8), (1, 8, 8)], [(1, 2, 2)], [(1, 4, 4)]], THRESHOLD_0)
    if setup is None:
        return None
    rank, tower, pixels, grid, balancer = setup
    try:
        if checked:
            balancer(tower, pixels, grid, prepared=balancer.prepare(pixels, grid, tower))
            if rank == 1:
                balancer.check_pending()
        ticket = balancer.prepare(pixels, grid, tower) if rank != 1 else None
        balancer(tower, pixels, grid, prepared=ticket)
        outcome = ("ok", "")
    except ValueError as error:
        outcome = ("ValueError", str(error))
    # Still in step: an unprepared call works everywhere.
    torch.testing.assert_close(balancer(tower, pixels, grid), tower(pixels, grid), rtol=1e-4, atol=1e-5)
    return outcome


@pytest.mark.parametrize("checked", [False, True], ids=["prepare", "check_pending"])
def test_gathers_of_different_steps_fail_everywhere(multirank: Any, checked: bool) -> None:
    """A rank's gather that met another kind on the others (a plan prepared on some ranks only,
    check_pending on one) paired up: the step ran, and check_pending at the loop's end waited on
    the ranks that had prepared. Every rank now raises at that gather, naming what each made."""
    with multirank(POOL) as w:
        outcomes = w.run(_prepared_on_some_ranks, checked)[:3]
    assert len(set(outcomes)) == 1 and outcomes[0][0] == "ValueError", outcomes
    made = "check_pending on ranks [1]" if checked else "a balanced call without a prepared plan on ranks [1]"
    assert "the ranks gathered for different steps" in outcomes[0][1] and made in outcomes[0][1], outcomes


def _plan_ahead_on_some_ranks() -> tuple[str, str] | None:
    """``plan_ahead`` set on ranks 0 and 2 only, which prepare their step's plan; rank 1 does not."""
    rank = dist.get_rank()
    setup = _on_three_ranks(
        [[(1, 8, 8), (1, 8, 8)], [(1, 2, 2)], [(1, 4, 4)]], {**THRESHOLD_0, "plan_ahead": rank != 1}
    )
    if setup is None:
        return None
    _, tower, pixels, grid, balancer = setup
    try:
        ticket = balancer.prepare(pixels, grid) if rank != 1 else None
        balancer(tower, pixels, grid, prepared=ticket)
        return ("ok", "")
    except ValueError as error:
        return ("ValueError", str(error))


def test_gathers_of_different_steps_name_the_settings_that_differ_too(multirank: Any) -> None:
    """Ranks that gathered for different steps because a setting differs (``plan_ahead`` on some
    ranks) are told which: the error named only the gathers' kinds. Not the merge size, which a
    ``prepare`` without the ViT sends as 1 where a call sends its ViT's."""
    with multirank(POOL) as w:
        outcomes = w.run(_plan_ahead_on_some_ranks)[:3]
    assert len(set(outcomes)) == 1 and outcomes[0][0] == "ValueError", outcomes
    message = outcomes[0][1]
    assert "the ranks gathered for different steps" in message, message
    assert "the settings differ too: plan_ahead (ranks [1] differ from rank 0)." in message, message


@pytest.mark.parametrize(
    ("kind", "fragment", "skipped"),
    [
        ("rows", "shape", False),
        ("values", "other values", False),
        ("temporal", "other values", False),
        ("grad", "pixel_values requires grad, but did not when the plan was prepared", False),
        ("dtype", "float64", False),
        ("narrow", "float16", False),
        ("no_grid", "must be tensors", False),
        ("no_pixels", "must be tensors", False),
        ("grid_dtype", "torch.int16: expected int32 or int64", False),
        ("device", "is on a meta device", False),
        ("sparse", "pixel_values is a sparse tensor: expected a dense (strided) tensor", False),
        ("sparse_grid", "grid_thw is a sparse tensor", False),
        ("rows", "shape", True),
        ("device", "is on a meta device", True),
        ("sparse", "pixel_values is a sparse tensor", True),
    ],
)
def test_a_call_that_does_not_match_its_plan_fails_everywhere(
    multirank: Any, kind: str, fragment: str, skipped: bool
) -> None:
    """Also in a skipped call, with ``check_skipped_calls`` (which the status gather reports)."""
    with multirank(POOL) as w:
        outcomes = w.run(_mismatch, kind, skipped)[:3]
    assert {o[0] for o in outcomes} == {"ValueError"}, outcomes
    assert len({o[1] for o in outcomes}) == 1, outcomes
    assert "rank 1" in outcomes[0][1] and fragment in outcomes[0][1], outcomes[0][1]
    assert all(o[2] < 10.0 for o in outcomes), outcomes


@pytest.mark.parametrize("skipped", [False, True], ids=["moved", "skipped_checked"])
def test_a_sharded_tower_fails_everywhere_on_a_call_that_does_not_match_its_plan(
    multirank: Any, skipped: bool
) -> None:
    """The tower an FSDP2 unit: the rank at fault skipped it, so its status gather met the other
    ranks' parameter gathers in their tower calls (gloo aborted; NCCL would hang). It now calls the
    tower on a dummy image first, and every rank raises the error."""
    skip_without_fsdp2()
    with multirank(POOL) as w:
        outcomes = w.run(_mismatch, "rows", skipped, True)[:3]
    assert {o[0] for o in outcomes} == {"ValueError"}, outcomes
    assert len({o[1] for o in outcomes}) == 1, outcomes
    assert "rank 1" in outcomes[0][1] and "shape" in outcomes[0][1], outcomes[0][1]


def _another_calls_plan(order: tuple[int, int]) -> dict[str, Any] | None:
    """Every rank prepares two steps' plans; rank 1 takes them in ``order``, the others in turn.
    Rank 0's images change orientation between the steps (the same patch counts, so both plans move
    the same images), ranks 1 and 2 keep theirs: rank 1's input matches either plan."""
    steps = [
        [[(1, 4, 8), (1, 4, 8)], [(1, 2, 2)], [(1, 4, 4)]],
        [[(1, 8, 4), (1, 8, 4)], [(1, 2, 2)], [(1, 4, 4)]],
    ]
    setup = _on_three_ranks(steps[0], THRESHOLD_0)
    if setup is None:
        return None
    rank, tower, _, _, balancer = setup
    batches = [towers.make_batch(step[rank], seed=rank) for step in steps]
    tickets = [balancer.prepare(pixels, grid, tower) for pixels, grid in batches]
    assert all(t is not None and t.plan.applied for t in tickets)
    assert tickets[0].plan.digest == tickets[1].plan.digest  # the same destinations
    taken = order if rank == 1 else (0, 1)
    outcomes = []
    for step, (pixels, grid) in enumerate(batches):
        try:
            out = balancer(tower, pixels, grid, prepared=tickets[taken[step]])
            outcomes.append(("ok", float((out - tower(pixels, grid)).abs().max())))
        except RuntimeError as error:
            outcomes.append(("RuntimeError", str(error)))
    # Still in step: an unprepared call works everywhere.
    pixels, grid = batches[1]
    torch.testing.assert_close(balancer(tower, pixels, grid), tower(pixels, grid), rtol=1e-4, atol=1e-5)
    return {"outcomes": outcomes}


@pytest.mark.parametrize("order", [(1, 0), (0, 0)], ids=["swapped", "taken_twice"])
def test_a_rank_given_another_calls_plan_fails_everywhere(multirank: Any, order: tuple[int, int]) -> None:
    """Plans that move the same images but were made from other grids: rank 1 built its batch from
    its plan's copy of rank 0's grids and encoded rank 0's rows as the other orientation, and rank 0
    took those outputs, 0.7-0.8 off, with no error. The status gather compares a digest of the
    batch each plan was made from too: every rank raises before the return trip."""
    with multirank(POOL) as w:
        results = w.run(_another_calls_plan, order)[:3]
    for step in range(2):
        outcomes = {r["outcomes"][step] for r in results}
        if order[step] == step:  # rank 1 took this step's own plan
            assert {kind for kind, _ in outcomes} == {"ok"}, outcomes
            # Same ops on the same rows in another batch: fp32 agrees to a few ulps.
            assert max(error for _, error in outcomes) < 1e-5, outcomes
            continue
        assert len(outcomes) == 1, outcomes
        ((kind, message),) = outcomes
        assert kind == "RuntimeError", message
        assert "were given plans made before the call for different batches" in message, message
        assert "ranks [0, 2]: " in message and "ranks [1]: " in message, message  # grouped by plan


def _skipped_mismatch(kind: str) -> dict[str, Any] | None:
    """A skipped, unchecked prepared call whose input on rank 1 is not the prepared batch."""
    grids = [[(1, 8, 8), (1, 8, 8)], [(1, 2, 2)], [(1, 4, 4)]]
    setup = _on_three_ranks(grids, {"trigger_threshold": 100.0})
    if setup is None:
        return None
    rank, tower, pixels, grid, balancer = setup
    ticket = balancer.prepare(pixels, grid, tower)
    assert ticket is not None and not ticket.plan.applied
    if rank == 1 and kind == "rows":
        pixels, grid = towers.make_batch([(1, 2, 4)], seed=rank)  # another batch than prepared
    if rank == 1 and kind == "empty":
        pixels, grid = torch.empty((0, pixels.shape[1])), torch.empty((0, 3), dtype=torch.long)
    if rank == 1 and kind == "no_grid":
        grid = None
    result: dict[str, Any] = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            output = balancer(tower, pixels, grid, prepared=ticket)
            if grid is not None and len(grid):
                torch.testing.assert_close(output, tower(pixels, grid), rtol=0, atol=0)  # the direct call
            result["rows"] = int(output.shape[0])
        except ValueError as error:
            result["raised"] = str(error)
    result["warned"] = [str(w.message) for w in caught if "Invalid prepared" in str(w.message)]
    # The next gather: every rank raises together, or goes on where no rank raised.
    pixels, grid = towers.make_batch(grids[rank], seed=rank)
    try:
        balancer.prepare(pixels, grid, tower)
    except ValueError as error:
        result["next"] = str(error)
    torch.testing.assert_close(balancer(tower, pixels, grid), tower(pixels, grid), rtol=1e-4, atol=1e-5)
    return result


@pytest.mark.parametrize("kind", ["rows", "empty"])
def test_a_skipped_call_that_does_not_match_its_plan_encodes_directly_and_every_rank_raises_next(
    multirank: Any, kind: str
) -> None:
    """Unchecked, a skipped call makes no collective: raising there alone would leave the other ranks
    waiting at their next collective. Rank 1 warns and encodes its own input as the direct call does;
    at the next gather every rank raises the same error, then all go on."""
    with multirank(POOL) as w:
        results = w.run(_skipped_mismatch, kind)[:3]
    assert all("raised" not in r for r in results), results
    assert [bool(r["warned"]) for r in results] == [False, True, False], results
    assert "rank 1" in results[1]["warned"][0] and "encodes its own batch directly" in results[1]["warned"][0]
    assert results[1]["rows"] == (2 if kind == "rows" else 0)
    assert len({r["next"] for r in results}) == 1, results
    assert "rank 1: an earlier call given a prepared plan that moved no image" in results[0]["next"]


def test_a_skipped_call_without_tensors_still_raises_on_its_rank(multirank: Any) -> None:
    with multirank(POOL) as w:
        results = w.run(_skipped_mismatch, "no_grid")[:3]
    assert "must be tensors" in results[1]["raised"] and "next" not in results[1], results
    assert all("raised" not in r and "next" not in r for r in (results[0], results[2])), results


def _values_compared_on_the_device() -> dict[str, Any] | None:
    """Grids read as if on a device (no host read in the forward): a prepared call whose grid values
    differ is found a call later, at the next gather, on every rank; a matching one raises nothing."""
    setup = _on_three_ranks([[(1, 8, 8), (1, 8, 8)], [(1, 4, 8)], [(1, 4, 4)]], THRESHOLD_0)
    if setup is None:
        return None
    rank, tower, pixels, grid, balancer = setup
    with mock.patch.object(prepared_module, "_read_on_host", lambda tensor: False):
        ticket = balancer.prepare(pixels, grid, tower)
        balancer(tower, pixels, grid, prepared=ticket)  # matching: nothing to report
        ticket = balancer.prepare(pixels, grid, tower)
        assert ticket is not None and ticket.plan.applied
        swapped = torch.tensor([[1, 8, 4]]) if rank == 1 else grid  # same rows, other values
        balancer(tower, pixels, swapped, prepared=ticket)  # not readable here: it goes through
        with caught(ValueError) as outcome:
            balancer.prepare(pixels, grid, tower)
        found = outcome.message
        # Read once and forgotten: the next call works.
        torch.testing.assert_close(balancer(tower, pixels, grid), tower(pixels, grid), rtol=1e-4, atol=1e-5)
        # A loop's last call: no next gather reads it, check_pending does.
        balancer(tower, pixels, swapped, prepared=balancer.prepare(pixels, grid, tower))
        with caught(ValueError) as outcome:
            balancer.check_pending()
        last = outcome.message
        balancer.check_pending()  # nothing left
        # A balancer replaced (another configuration) hands its pending checks to the new one.
        balancer(tower, pixels, swapped, prepared=balancer.prepare(pixels, grid, tower))
        replacement = ViTBalancer(dataclasses.replace(balancer.config, min_gain=0.5), balancer.group)
        replacement._take_pending(balancer)
        balancer.check_pending()  # nothing left there: no gather
        with caught(ValueError) as outcome:
            replacement.check_pending()
        moved = outcome.message
    return {"found": found, "last": last, "moved": moved}


def test_grid_values_compared_on_the_device_fail_every_rank_at_the_next_gather(multirank: Any) -> None:
    """...and, after a loop's last call, at :meth:`ViTBalancer.check_pending` (no next gather reads
    them: the last batch of a test run returned other outputs silently), also where the balancer
    was replaced since (the mixin's, for another configuration)."""
    with multirank(POOL) as w:
        results = w.run(_values_compared_on_the_device)[:3]
    messages = {r[key] for r in results for key in ("found", "last", "moved")}
    assert len(messages) == 1, results
    message = messages.pop()
    assert "rank 1: an earlier call given a prepared plan" in message and "rank 0" not in message, message


def _text_only_step() -> dict[str, Any] | None:
    """A step without images on any rank, prepared from batches without pixel keys (rows of width 1,
    float32) and called with the ``[0, C]`` bf16 rows a model makes for its empty call."""
    group = subgroup(2)
    if dist.get_rank() >= 2:
        return None
    torch.manual_seed(0)
    tower = towers.TensorTower().to(torch.bfloat16)
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), group)
    empty_grid = torch.empty((0, 3), dtype=torch.long)
    ticket = balancer.prepare(torch.empty((0, 1), device="meta"), empty_grid)
    assert ticket is not None and not ticket.holds_images
    pixels = torch.empty((0, towers.CHANNELS), dtype=torch.bfloat16)
    out = balancer(tower, pixels, empty_grid, prepared=ticket)
    unprepared = balancer(tower, pixels, empty_grid)
    return {"shape": tuple(out.shape), "dtype": str(out.dtype), "unprepared": tuple(unprepared.shape)}


def test_a_text_only_step_needs_no_pixel_width_in_its_plan(multirank: Any) -> None:
    """No rank has images: the prepared plan does not hold the rows' width or dtype to the batch's
    (it had no pixels), and each rank's empty call encodes its dummy image from its own rows."""
    with multirank(POOL) as w:
        results = w.run(_text_only_step)[:2]
    assert results == [{"shape": (0, 24), "dtype": "torch.bfloat16", "unprepared": (0, 24)}] * 2, results


def _text_only_step_with_rows_the_vit_cannot_take() -> str | None:
    """No rank has images and rank 1's empty rows are bf16 for a float32 ViT: its dummy forward
    raises, and the status gather that follows a prepared step without images fails every rank."""
    group = subgroup(3)
    if dist.get_rank() >= 3:
        return None
    torch.manual_seed(0)
    tower = towers.TensorTower()
    dtype = torch.bfloat16 if dist.get_rank() == 1 else torch.float32
    pixels, grid = torch.empty((0, towers.CHANNELS), dtype=dtype), torch.empty((0, 3), dtype=torch.long)
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), group)
    ticket = balancer.prepare(pixels, grid)
    assert ticket is not None and not ticket.holds_images
    with caught(RuntimeError) as outcome:
        balancer(tower, pixels, grid, prepared=ticket)
    return outcome.message


def test_a_prepared_text_only_step_fails_every_rank_when_one_cannot_encode(multirank: Any) -> None:
    with multirank(POOL) as w:
        errors = w.run(_text_only_step_with_rows_the_vit_cannot_take)[:3]
    assert all("same dtype" in error for error in errors), errors
    assert "rank 1: the ViT raised" in errors[0] and "rank 1: the ViT raised" in errors[2], errors


def _text_only_rank_of_its_own_rows() -> dict[str, Any] | None:
    """Rank 1 has no images and passes empty float16 rows of 3 values, the others float32 rows of
    12: it sends no row, so its prepared call takes them, as a call not prepared does."""
    group = subgroup(3)
    if dist.get_rank() >= 3:
        return None
    torch.manual_seed(0)
    tower = towers.TensorTower()
    rank = dist.get_rank()
    grids = [[(1, 8, 8), (1, 6, 6)], [], [(1, 2, 2)]][rank]
    pixels, grid = towers.make_batch(grids, seed=rank)
    if not grids:
        pixels = torch.empty((0, 3), dtype=torch.float16)
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), group)
    ticket = balancer.prepare(pixels, grid)
    assert ticket is not None
    prepared = balancer(tower, pixels, grid, prepared=ticket)
    # Same ops on the same rows in batches of other sizes: fp32 agrees to a few ulps.
    torch.testing.assert_close(prepared, balancer(tower, pixels, grid), rtol=1e-5, atol=1e-5)
    return {"applied": balancer.last_stats.applied, "shape": tuple(prepared.shape)}


def test_a_prepared_rank_without_images_takes_empty_rows_of_any_width_and_dtype(multirank: Any) -> None:
    with multirank(POOL) as w:
        results = w.run(_text_only_rank_of_its_own_rows)[:3]
    assert [r["shape"] for r in results] == [(25, 24), (0, 24), (1, 24)], results
    assert all(r["applied"] for r in results), results


def _bad_prepare() -> str | None:
    group = subgroup(3)
    rank = dist.get_rank()
    if rank >= 3:
        return None
    pixels, grid = towers.make_batch([(1, 4, 4)], seed=rank)
    if rank == 2:
        pixels = pixels[:-1]
    with caught(ValueError) as outcome:
        ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), group).prepare(pixels, grid)
    return outcome.message


def test_bad_input_fails_in_prepare_on_every_rank(multirank: Any) -> None:
    with multirank(POOL) as w:
        messages = w.run(_bad_prepare)[:3]
    assert len(set(messages)) == 1 and "rank 2: pixel_values has 15 rows" in messages[0], messages


def _grid_the_vit_cannot_merge(
    config: dict[str, Any], split_videos: bool, bad: tuple[int, int, int] = (2, 3, 3)
) -> list[str] | None:
    """Plans made ahead without the ViT (as the Lightning mixin makes them), of rank 1's rows that
    a 2x2 merge cannot take (``bad``): in the first call, before the balancer knew the merge size,
    and in a later one, after it did; then the same rows for a tower without merging (one that a
    step calls after the other), which takes them."""
    grids = [[(1, 8, 8), (2, 8, 8)], [(1, 4, 4), bad], [(1, 2, 2)]]
    setup = _on_three_ranks(grids, {**config, "split_videos": split_videos})
    if setup is None:
        return None
    unmerged = towers.TensorTower(merge=1)
    messages = []
    for tower in (setup.tower, setup.tower, unmerged):
        with caught(ValueError) as outcome:
            ticket = setup.balancer.prepare(setup.pixels, setup.grid)
            output = setup.balancer(tower, setup.pixels, setup.grid, prepared=ticket)
            # The call planned in the forward (with split_videos the tower attends within each
            # temporal step, unlike a direct call): the same ops on the same rows, equal.
            planned_in_the_call = setup.balancer(tower, setup.pixels, setup.grid)
            torch.testing.assert_close(output, planned_in_the_call, rtol=0, atol=0)
        messages.append(outcome.message)
    return messages


@pytest.mark.parametrize("config", [THRESHOLD_0, {"trigger_threshold": 100.0}], ids=["applied", "skipped"])
@pytest.mark.parametrize("split_videos", [False, True])
def test_rows_the_vit_cannot_merge_fail_every_rank_without_the_vit_in_prepare(
    multirank: Any, config: dict[str, Any], split_videos: bool
) -> None:
    """The rows are checked against the ViT's merge size at the call when ``prepare`` did not know
    it: unchecked, rank 1 failed alone in its ViT (a reshape), or its rows were merged wrongly
    without a word where their count happened to divide."""
    with multirank(POOL) as w:
        results = w.run(_grid_the_vit_cannot_merge, config, split_videos)[:3]
    first, second, unmerged = zip(*results)
    assert len(set(first)) == 1 and second == first, results
    where = "temporal step 1 of grid_thw's images" if split_videos else "grid_thw[1]"
    text = f"the ViT's spatial merge size 2 does not divide H=3, W=3 of rank 1's {where} (checked at the call"
    assert text in first[0], first[0]
    # Moving images, every rank reports it through the status gather: the text once, for all three;
    # moving nothing (unchecked), every rank raises at once.
    said = (
        f"ranks [0, 1, 2]: {text}"
        if config is THRESHOLD_0
        else f"Invalid balanced ViT input (3 ranks): {text}"
    )
    assert said in first[0], first[0]
    # A plan made without the ViT was checked against the previous call's merge size: the rows of
    # a tower that merges less, valid, failed on every rank.
    assert unmerged == ("no error",) * 3, results


@pytest.mark.parametrize("bad", [(2, 3, 4), (2, 4, 3)], ids=["height", "width"])
def test_rows_of_one_side_the_vit_cannot_merge_fail_every_rank(
    multirank: Any, bad: tuple[int, int, int]
) -> None:
    """The merge size is checked against heights and widths alike (one side each here)."""
    with multirank(POOL) as w:
        results = w.run(_grid_the_vit_cannot_merge, THRESHOLD_0, False, bad)[:3]
    first, second, unmerged = zip(*results)
    text = f"the ViT's spatial merge size 2 does not divide H={bad[1]}, W={bad[2]} of rank 1's grid_thw[1]"
    assert len(set(first)) == 1 and second == first and text in first[0], results
    assert unmerged == ("no error",) * 3, results


def _merge_sizes_apart(divisible: bool, skipped: bool) -> str | None:
    """A plan made ahead without the ViT, then a call of towers whose merge sizes differ between
    the ranks (rank 1's 4, or 8 where its rows do not divide by it; the others' 2); ``skipped``:
    a plan that moves nothing, with ``check_skipped_calls``."""
    grids = [[(1, 12, 12)] * 4, [(1, 12, 12)], [(1, 4, 4)]]
    setup = _on_three_ranks(grids, SKIPPED_CHECKED if skipped else THRESHOLD_0)
    if setup is None:
        return None
    merge = (4 if divisible else 8) if setup.rank == 1 else 2
    tower = towers.TensorTower(merge=merge)
    ticket = setup.balancer.prepare(setup.pixels, setup.grid)
    assert ticket is not None and ticket.plan.applied is not skipped
    with caught(ValueError) as outcome:
        setup.balancer(tower, setup.pixels, setup.grid, prepared=ticket)
    return outcome.message


@pytest.mark.parametrize(("divisible", "skipped"), [(True, False), (False, False), (False, True)])
def test_merge_sizes_that_differ_between_ranks_fail_every_rank_with_a_plan_made_without_the_vit(
    multirank: Any, divisible: bool, skipped: bool
) -> None:
    """No gather compared the ViTs' merge sizes: each rank cut its images' returned rows by its
    own, and an image that moved came back as other rows without a word (NaN or another image's
    tokens); where rank 1's size did not divide the rows, rank 1 raised alone and the others waited
    in the pixel trip (or, where the plan skips with check_skipped_calls, in the status gather).
    The status gather compares them now: every rank raises the same error."""
    with multirank(POOL) as w:
        messages = w.run(_merge_sizes_apart, divisible, skipped)[:3]
    assert len(set(messages)) == 1, messages
    if skipped:  # nothing travels back: rank 1's rows problem, not the sizes, is what fails
        assert "rank 1: the ViT's spatial merge size 8 does not divide H=12, W=12 of rank 0's" in messages[0]
        return
    other = 4 if divisible else 8
    expected = f"spatial merge size differs between ranks (merge 2: ranks [0, 2]; merge {other}: ranks [1])"
    assert expected in messages[0], messages


def test_grid_gcd_divides_every_height_and_width_and_no_temporal_size() -> None:
    def rank(*grids: tuple[int, int, int]) -> RankMetadata:
        return RankMetadata(0, (), 3, 0, False, grids)

    assert grid_gcd([rank(), rank()]) == 0  # no images: every merge size divides
    assert grid_gcd([rank((3, 8, 12)), rank(), rank((1, 4, 28), (5, 16, 16))]) == 4
    assert grid_gcd([rank((1, 6, 6)), rank((1, 4, 10))]) == 2
    assert grid_gcd([rank((1, 3, 3), (1, 8, 8))]) == 1
    # Heights and widths alike: either side alone would give 8 or 6 here.
    assert grid_gcd([rank((1, 8, 16), (1, 16, 6))]) == 2 == grid_gcd([rank((1, 6, 8)), rank((1, 8, 8))])


def _rank(*grids: tuple[int, int, int], channels: int = 3, dtype_code: int = 0) -> RankMetadata:
    return RankMetadata(0, (), channels, dtype_code, False, grids)


def test_the_batch_digest_tells_apart_batches_whose_grids_alone_are_alike() -> None:
    """The digest is what fails every rank when one is given another call's plan: an image moved to
    another rank (the same grid rows, flattened), or pixel rows of another dtype or width, is
    another batch, which the plan's balanced batches would build wrong without an error."""
    batch = [_rank((1, 4, 4), (1, 8, 8)), _rank((1, 2, 2))]
    digest = batch_digest(batch)
    assert batch_digest([_rank((1, 4, 4), (1, 8, 8)), _rank((1, 2, 2))]) == digest  # a value of the batch
    moved = [_rank((1, 4, 4)), _rank((1, 8, 8), (1, 2, 2))]
    assert batch_digest(moved) != digest
    assert batch_digest([batch[0], _rank((1, 2, 2), dtype_code=1)]) != digest
    assert batch_digest([batch[0], _rank((1, 2, 2), channels=6)]) != digest


def test_a_prepared_plans_time_is_its_gather_and_its_plan() -> None:
    """``BalanceStats.prepare_seconds`` reports what making the plan ahead cost on the host: both
    its parts (binary fractions, so the sum is exact)."""
    metadata = (_rank((1, 4, 4)),)
    prepared = PreparedPlan(
        plan=plan_rebalance([[16]], ViTBalanceConfig()),
        metadata=metadata,
        rank=0,
        channels=3,
        dtype=torch.float32,
        pixels_require_grad=False,
        gather_seconds=0.25,
        plan_seconds=0.5,
        collectives=1,
    )
    assert prepared.prepare_seconds == 0.75


def test_prepare_without_a_process_group_returns_none() -> None:
    pixels, grid = towers.make_batch([(1, 4, 4)], seed=0)
    balancer = ViTBalancer()
    assert balancer.prepare(pixels, grid) is None
    assert make_host_group() is None  # nothing to gather over, nothing to twin
    tower = towers.TensorTower()
    torch.testing.assert_close(balancer(tower, pixels, grid, prepared=None), tower(pixels, grid))


def _with_host_group() -> dict[str, Any]:
    """Gathers on a second (gloo) group over the same ranks; a group of other ranks is refused."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    host = dist.new_group(ranks=list(range(world)), backend="gloo")  # every rank of the pool
    pair = dist.new_group(ranks=[0, 1], backend="gloo")
    torch.manual_seed(0)
    tower = towers.TensorTower()
    grids = [[(1, 8, 8), (1, 8, 8)], [(1, 2, 2)], [(1, 4, 4)], []][rank % 4]
    pixels, grid = towers.make_batch(grids, seed=rank)
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), None, host_group=host)
    out = balancer(tower, pixels, grid)
    ticket = balancer.prepare(pixels, grid, tower)
    prepared = balancer(tower, pixels, grid, prepared=ticket)
    direct = tower(pixels, grid) if grids else None
    if direct is not None:
        # Same ops on the same rows in another batch: fp32 agrees to a few ulps.
        torch.testing.assert_close(out, direct, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(prepared, direct, rtol=1e-4, atol=1e-5)
    with caught(ValueError) as outcome:
        # Every rank is refused before any collective (ranks 2 and 3 are not even in the pair).
        ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), None, host_group=pair)(tower, pixels, grid)
    refused = outcome.message
    outside = []  # new_group's placeholder on the ranks it leaves out: refused as it is passed
    if rank >= 2:
        for make in (lambda: ViTBalancer(group=pair), lambda: make_host_group(pair)):
            with caught(ValueError) as outcome:
                make()
            outside.append(outcome.message)
    return {"applied": ticket.plan.applied, "refused": refused, "outside": outside}


def test_arguments_of_another_kind_are_refused_where_they_are_passed() -> None:
    """A group that is no process group failed every rank at its first call (``'str' object has
    no attribute 'size'``); a ``report`` that cannot be called raised after the collectives of the
    first verbose call, on rank 0 alone; a ``prepared`` of another kind raised an AttributeError."""
    import logging

    for make in (lambda: ViTBalancer(group="world"), lambda: ViTBalancer(host_group=3)):
        with pytest.raises(
            TypeError, match=r"(group='world'|host_group=3) is invalid: expected a torch.distributed"
        ):
            make()
    with pytest.raises(TypeError, match=r"report=<Logger train .* is invalid: expected a callable"):
        ViTBalancer(report=logging.getLogger("train"))
    pixels, grid = towers.make_batch([(1, 4, 4)], seed=0)
    with pytest.raises(TypeError, match=r"prepared=\{'plan': 1\} is invalid: expected the PreparedPlan"):
        ViTBalancer()(towers.TensorTower(), pixels, grid, prepared={"plan": 1})


def test_gathers_on_a_host_group(multirank: Any) -> None:
    with multirank(POOL) as w:
        results = w.run(_with_host_group)
    assert all(r["applied"] for r in results), results
    assert "host_group holds ranks [0, 1]" in results[0]["refused"], results[0]
    assert all("host_group" in r["refused"] for r in results), results
    for rank, result in enumerate(results):
        expected = (
            "host_group is a group that does not hold this process" if rank >= 2 else "host_group holds"
        )
        assert expected in result["refused"], (rank, result)
        assert len(result["outside"]) == (2 if rank >= 2 else 0), result
        assert all(
            f"group is a group that does not hold this process (global rank {rank})" in text
            for text in result["outside"]
        ), result


def _with_subgroup_twins() -> dict[str, Any]:
    """The pool as a 2 x 2 (data x tensor parallel) layout: data-parallel pairs [0, 2] and [1, 3],
    taken for NCCL groups. Each gets its gloo twin; a plan made ahead and gathered on it gives the
    direct call's outputs and gradients (made under ``no_grad`` for pixels that require grad: it
    was refused as made for pixels that did not). Overlapping groups get no twin, on every rank."""
    rank = dist.get_rank()
    pairs = [dist.new_group(ranks=[0, 2]), dist.new_group(ranks=[1, 3])]
    overlapping = [dist.new_group(ranks=[0, 1, 2]), dist.new_group(ranks=[1, 3])]
    data_parallel = pairs[rank % 2]
    unpatched = make_host_group(data_parallel)  # gloo carries host values itself: nothing to make
    with groups_taken_for_nccl():
        twin = make_host_group(data_parallel)
        none_for_overlap = make_host_group(overlapping[rank == 3])
    torch.manual_seed(0)
    tower = towers.TensorTower()
    # Tensor-parallel peers (0 and 1, 2 and 3) hold the same batch; the pairs balance [0, 2], [1, 3].
    grids = [[(1, 8, 8), (1, 8, 8), (1, 4, 4)], [(1, 2, 2)]][rank // 2]
    pixels, grid = towers.make_batch(grids, seed=rank // 2)
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), data_parallel, host_group=twin)
    balanced_pixels = pixels.clone().requires_grad_(True)
    with torch.no_grad():  # as a collator's thread plans: the pixels' own flag counts, not this mode
        ticket = balancer.prepare(balanced_pixels, grid, tower)
    out = balancer(tower, balanced_pixels, grid, prepared=ticket)
    out.square().sum().backward()
    direct_pixels = pixels.clone().requires_grad_(True)
    direct = tower(direct_pixels, grid)
    direct.square().sum().backward()
    # Same ops on the same rows in another batch: fp32 agrees to a few ulps.
    torch.testing.assert_close(out, direct, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(balanced_pixels.grad, direct_pixels.grad, rtol=1e-4, atol=1e-5)
    return {
        "unpatched": unpatched,
        "twin": dist.get_process_group_ranks(twin),
        "backend": str(dist.get_backend(twin)),
        "gathers_on_twin": balancer._host() is twin,
        "applied": ticket.plan.applied,
        "moved": ticket.plan.moved_images,
        "overlap": none_for_overlap,
    }


def test_data_parallel_subgroups_get_host_twins(multirank: Any) -> None:
    """With tensor or pipeline parallelism the data-parallel group is one of several subgroups:
    each gets its gloo twin, made by every process of the world at the same call, so planning
    ahead and the status words never wait for an NCCL group's device. The pool's earlier tests
    left each rank a member of different groups, which a group-local twin would not survive."""
    with multirank(POOL) as w:
        results = w.run(_with_subgroup_twins)
    for rank, got in enumerate(results):
        assert got["unpatched"] is None and got["overlap"] is None, got
        assert got["twin"] == [[0, 2], [1, 3]][rank % 2] and got["backend"] == "gloo", got
        assert got["gathers_on_twin"] and got["applied"] and got["moved"] > 0, got


def test_twins_are_made_for_disjoint_ascending_groups_in_one_order() -> None:
    """Every rank derives the same list from the same gathered ranks, whatever order they came in."""
    assert _twin_ranks([(1, 3), (0, 2), (1, 3), (0, 2)]) == [(0, 2), (1, 3)]
    assert _twin_ranks([(0, 2), (1, 3), (0, 2), (1, 3)]) == [(0, 2), (1, 3)]
    assert _twin_ranks([(0, 1, 2, 3)] * 4) == [(0, 1, 2, 3)]  # a group spanning the world
    assert _twin_ranks([(0, 1, 2), (0, 1, 2), (0, 1, 2), (1, 3)]) == []  # rank 1 in both: no partition
    assert _twin_ranks([(0,), (1,), (2,)]) == []  # data parallelism of one: no group to twin
    # new_group sorts its ranks: a group in another order could not get a twin in the same order.
    assert _twin_ranks([(2, 0), (1, 3), (2, 0), (1, 3)]) == [(1, 3)]
    assert _twin_ranks([(0, 1), (0, 1), (2,)]) == [(0, 1)]


class _PrepareInCollate:
    """A collate function that plans ahead in the worker: with the engine, the drop-in's handle or
    the mixin (picklable, so that spawned workers run it too)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __call__(self, batch: list[Any]) -> Any:
        pixels, grid = towers.make_batch([(1, 4, 4)], seed=0)
        if self.how == "engine":
            return ViTBalancer().prepare(pixels, grid)
        if self.how == "mixin":
            import lightning as L

            from lightning_vit_balance import ViTBalanceMixin

            class Module(ViTBalanceMixin, L.LightningModule):
                pass

            return Module().prepare_vit_balance({"pixel_values": pixels, "image_grid_thw": grid})
        from hf_models import tiny_model

        from lightning_vit_balance import balance_vision_tower

        handle = balance_vision_tower(tiny_model("qwen2_5_vl"))
        return handle.prepare({"pixel_values": pixels, "image_grid_thw": grid})


@pytest.mark.parametrize(
    ("how", "named"),
    [("engine", "ViTBalancer.prepare"), ("drop-in", "handle.prepare"), ("mixin", "prepare_vit_balance")],
)
def test_prepare_in_a_dataloader_worker_raises_at_once(how: str, named: str) -> None:
    """A forked worker inherits the group without its threads: its gather waited forever (a
    spawned one has none: it planned nothing, silently)."""
    loader = torch.utils.data.DataLoader(
        range(2), batch_size=1, num_workers=1, collate_fn=_PrepareInCollate(how)
    )
    with pytest.raises(RuntimeError, match=rf"{named} ran in DataLoader worker 0 \(of 1\)"):
        next(iter(loader))
