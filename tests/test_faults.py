"""Never silent, never a hang: what every rank sees when one rank is wrong (real gloo ranks).

Each case runs on 3 ranks of a pool whose collectives time out after 30 s. A case passes when every
rank raised the same clear error within a few seconds (measured on each rank), or finished with
correct outputs; and the group is still in step afterwards (a good call works on every rank).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
import traceback
import weakref
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import towers
from multirank import subgroup
from torch.utils.checkpoint import checkpoint

from lightning_vit_balance import CostModel, ViTBalanceConfig, ViTBalancer
from lightning_vit_balance import balancer as balancer_module
from lightning_vit_balance import config as config_module
from lightning_vit_balance.encoding import PACKING_ERROR, EncodedBatch, raise_for_vit
from lightning_vit_balance.exchange import StatusReport, ViTStatus
from lightning_vit_balance.recompute import in_backward_pass
from lightning_vit_balance.wire import pack_return

POOL = 4
RANKS = 3
#: A failure must arrive well before the pool's 30 s collective timeout.
FAST_S = 10.0
#: Rank 0 holds the heavy images, so every applied plan moves some of them to ranks 1 and 2.
GRIDS = [[(1, 8, 8), (1, 8, 8), (1, 6, 6)], [(1, 2, 2)], [(1, 4, 4)]]
APPLY = {"trigger_threshold": 0.0, "min_gain": 0.0}


def _tower_and_batch(rank: int) -> tuple[towers.TensorTower, torch.Tensor, torch.Tensor]:
    """The tensor tower, seeded alike on every rank, and ``rank``'s batch of :data:`GRIDS`."""
    torch.manual_seed(0)
    tower = towers.TensorTower()
    pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
    return tower, pixels, grid


def _still_in_step(group: Any, rank: int) -> None:
    """A good balanced call after a failure: the group must not be left half-way in a collective."""
    tower, pixels, grid = _tower_and_batch(rank)
    out = ViTBalancer(ViTBalanceConfig(**APPLY), group)(tower, pixels, grid)
    # Same ops on the same rows in another batch: fp32 agrees to a few ulps.
    torch.testing.assert_close(out, tower(pixels, grid), rtol=1e-4, atol=1e-5)


def _outcome(fn: Any) -> tuple[str, str, float]:
    started = time.perf_counter()
    try:
        fn()
        return ("ok", "", time.perf_counter() - started)
    except BaseException as error:  # an interrupt raised on one rank too
        return (type(error).__name__, str(error), time.perf_counter() - started)


def _balance_with(
    config: ViTBalanceConfig, group: Any, rank: int, balancer: ViTBalancer | None = None, merge: int = 2
) -> tuple[str, str, float]:
    """One balanced call of this rank's batch under ``config`` (by ``balancer`` when given) of a
    tower merging ``merge`` x ``merge`` patches; then a good call on every rank."""
    torch.manual_seed(0)
    tower = towers.TensorTower(merge=merge)
    pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
    outcome = _outcome(lambda: (balancer or ViTBalancer(config, group))(tower, pixels, grid))
    _still_in_step(group, rank)
    return outcome


def _config_case(field: str, value: Any) -> tuple[str, str, float] | None:
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    config = ViTBalanceConfig(**APPLY)
    if rank == 1:
        config = dataclasses.replace(config, **{field: value})
    return _balance_with(config, group, rank)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("solver", "seed"),
        ("cost_quadratic", 2.0),
        ("cost_linear", 3.0),
        ("max_len_ratio", 1.5),
        ("trigger_threshold", 0.9),
        ("min_gain", 0.5),
        ("empty_rank_forward", "no_grad"),
        ("check_skipped_calls", True),
    ],
)
def test_settings_that_differ_raise_on_every_rank(multirank: Any, field: str, value: Any) -> None:
    """A setting that differs on one rank raises the same ValueError everywhere, naming it and the rank."""
    with multirank(POOL) as w:
        outcomes = w.run(_config_case, field, value)[:RANKS]
    assert len({(kind, message) for kind, message, _ in outcomes}) == 1, outcomes
    kind, message, _ = outcomes[0]
    assert kind == "ValueError" and field in message and "ranks [1]" in message, message
    assert all(seconds < FAST_S for _, _, seconds in outcomes), outcomes


def _merge_case() -> tuple[str, str, float] | None:
    """Rank 1's ViT merges 1x1 patches where the others merge 2x2: each rank would size the rows
    it returns by its own merge size (silently wrong outputs on the others, without gradients)."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    with torch.no_grad():
        return _balance_with(ViTBalanceConfig(**APPLY), group, rank, merge=1 if rank == 1 else 2)


def test_merge_sizes_that_differ_raise_on_every_rank(multirank: Any) -> None:
    with multirank(POOL) as w:
        outcomes = w.run(_merge_case)[:RANKS]
    assert len({(kind, message) for kind, message, _ in outcomes}) == 1, outcomes
    kind, message, _ = outcomes[0]
    assert kind == "ValueError" and "spatial_merge_size (ranks [1]" in message, message


class _VideoTower(towers.TensorTower):
    """A tower of a class of its own: to the status gather, another ViT than the image tower."""


def _towers_in_another_order(case: str) -> list[tuple[str, str, float]] | None:
    """Two towers, a balancer each, called in another order on rank 1 (videos first): each call
    paired rank 1's video tower with the others' image tower, and every rank got outputs of the
    wrong tower (and its gradients) without a word. ``case``: planned in the call, given plans
    made ahead, skipped with ``check_skipped_calls`` (the status gather follows), or of towers
    whose outputs differ too (the status's details are gathered)."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    torch.manual_seed(0)
    video = _VideoTower(out_dim=32) if case == "other_outputs" else _VideoTower()
    by_name = {"image": towers.TensorTower(), "video": video}
    config = {"trigger_threshold": 100.0, "check_skipped_calls": True} if case == "skipped_checked" else APPLY
    balancers = {name: ViTBalancer(ViTBalanceConfig(**config), group) for name in by_name}
    pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
    outcomes = []
    for name in ("video", "image") if rank == 1 else ("image", "video"):
        balancer, tower = balancers[name], by_name[name]
        ticket = balancer.prepare(pixels, grid, tower) if case == "prepared" else None
        outcomes.append(_outcome(lambda: balancer(tower, pixels, grid, prepared=ticket)))  # noqa: B023
    _still_in_step(group, rank)
    return outcomes


@pytest.mark.parametrize("case", ["planned_in_the_call", "prepared", "skipped_checked", "other_outputs"])
def test_towers_called_in_another_order_on_one_rank_raise_on_every_rank(multirank: Any, case: str) -> None:
    with multirank(POOL) as w:
        per_rank = w.run(_towers_in_another_order, case)[:RANKS]
    for call in range(2):
        outcomes = {(kind, message) for kind, message, _ in (calls[call] for calls in per_rank)}
        assert len(outcomes) == 1, per_rank
        kind, message = outcomes.pop()
        assert kind == "ValueError", per_rank
        assert "the ranks called different ViTs in this call (one each: ranks [0, 2]; rank 1;" in message
    assert all(seconds < FAST_S for calls in per_rank for _, _, seconds in calls), per_rank


class _ComparedByValue(towers.TensorTower):
    """A module class defining ``__eq__`` (so no ``__hash__``): no weak-keyed cache can hold it."""

    def __eq__(self, other: object) -> bool:
        return self is other


def test_a_vit_is_told_by_its_class_name_and_parameter_count() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from lightning_vit_balance.encoding import called_module, vit_identity

    torch.manual_seed(0)
    tower = towers.TensorTower()
    assert vit_identity(tower) == vit_identity(towers.TensorTower(dim=8))  # shapes do not count
    assert vit_identity(tower) != vit_identity(_VideoTower())
    deeper = towers.TensorTower()
    deeper.extra = torch.nn.Linear(2, 2)  # one class, two parameters more
    assert vit_identity(deeper) != vit_identity(tower)
    tied = towers.TensorTower()
    tied.extra = torch.nn.Linear(64, 24, bias=False)
    tied.extra.weight = tied.merger.weight  # a parameter shared by two modules counts once
    assert vit_identity(tied) == vit_identity(tower)
    # Not the class's module, which trust_remote_code names after each node's folder or snapshot.
    renamed = type(
        "TensorTower", (towers.TensorTower,), {"__module__": "snapshot_0a1b2c", "__qualname__": "TensorTower"}
    )
    assert vit_identity(renamed()) == vit_identity(tower)
    # Wrappers inside the tower (renaming its parameters) do not count; those around it are seen
    # through, as are partials and bound methods; a lambda tells no tower (its identity is not sent).
    wrapped = towers.TensorTower()
    wrapped.core = checkpoint_wrapper(wrapped.core)
    assert vit_identity(wrapped) == vit_identity(tower)
    for around in (
        torch.compile(tower),
        functools.partial(tower),
        tower.forward,
        functools.partial(tower.forward),
    ):
        assert called_module(around) is tower
    assert called_module(lambda p, g: tower(p, g)) is None


def test_a_tower_is_sharded_where_a_parameter_is_gathered_per_call() -> None:
    from lightning_vit_balance.encoding import parameters_sharded

    tower = towers.TensorTower()
    assert not parameters_sharded(tower)
    tower.merger.weight.ds_id = 7  # as ZeRO-3 marks a partitioned parameter
    assert parameters_sharded(tower)


def test_a_balancer_reads_each_towers_identity_once_whatever_calls_it() -> None:
    """Read once per module inside a callable made anew for each call (a walk of its parameters in
    every forward before); a module that cannot be a weak key is read at each call, not refused."""
    from lightning_vit_balance.encoding import vit_identity

    balancer = ViTBalancer()
    tower = towers.TensorTower()

    class Around:
        def __init__(self, module: torch.nn.Module) -> None:
            self.module = module

    with mock.patch.object(balancer_module, "vit_identity", side_effect=vit_identity) as read:
        identities = {
            balancer._identity(around) for around in (Around(tower), functools.partial(tower), tower)
        }
        assert identities == {vit_identity(tower)} and read.call_count == 1
        assert balancer._identity(lambda p, g: tower(p, g)) == 0  # not compared
        unhashable = _ComparedByValue()
        assert balancer._identity(unhashable) == balancer._identity(unhashable) == vit_identity(unhashable)
        assert balancer._sharded(unhashable) is False


def test_fitted_cost_models_that_differ_raise(multirank: Any) -> None:
    """Each rank fitting a CostModel to its own timings gives different coefficients: caught."""
    with multirank(POOL) as w:
        outcomes = w.run(_fitted_case)[:RANKS]
    assert len({(kind, message) for kind, message, _ in outcomes}) == 1, outcomes
    assert outcomes[0][0] == "ValueError" and "cost_" in outcomes[0][1]


def _fitted_case() -> tuple[str, str, float] | None:
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    counts = [16, 64, 256, 1024]
    millis = [0.1 + 1e-6 * n * n * (1 + 0.1 * rank) for n in counts]  # a slightly different machine each
    config = CostModel.fit(counts, millis).to_config(ViTBalanceConfig(**APPLY))
    return _balance_with(config, group, rank)


def test_package_sources_that_differ_raise(multirank: Any) -> None:
    """One rank running other code under the same version number (a stale install, a file edited
    on one node) raises on every rank before anything moves, naming the sources."""
    with multirank(POOL) as w:
        outcomes = w.run(_sources_case)[:RANKS]
    assert len({(kind, message) for kind, message, _ in outcomes}) == 1, outcomes
    kind, message, _ = outcomes[0]
    assert (
        kind == "ValueError"
        and "package_sources (ranks [1] differ from rank 0; the package's files differ" in message
    ), message


def _sources_case() -> tuple[str, str, float] | None:
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    config = ViTBalanceConfig(**APPLY)
    edited = "0123456789abcdef" if rank == 1 else config_module._package_sources()
    # A balancer takes its settings' fingerprint when made.
    with mock.patch.object(config_module, "_package_sources", return_value=edited):
        balancer = ViTBalancer(config, group)
    return _balance_with(config, group, rank, balancer)


def test_gather_capacity_may_differ(multirank: Any) -> None:
    """gather_capacity no longer sizes any collective: ranks that differ in it still agree."""
    with multirank(POOL) as w:
        outcomes = w.run(_config_case, "gather_capacity", 2)[:RANKS]
    assert [kind for kind, _, _ in outcomes] == ["ok"] * RANKS, outcomes


class _FailingTower(towers.TensorTower):
    """Raises (like an out-of-memory error) on one rank, or returns unusable outputs there."""

    def __init__(self, bad_rank: int, mode: str) -> None:
        super().__init__()
        self.bad_rank = bad_rank
        self.mode = mode
        self.forwards = 0

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        if self.mode == "recompute" and in_backward_pass() and dist.get_rank() == self.bad_rank:
            # Before the recomputation has what it needs (checkpoint's early stop raises then).
            raise torch.OutOfMemoryError("CUDA out of memory (recomputing the ViT)")
        out = super().forward(pixel_values, grid_thw)
        if dist.get_rank() != self.bad_rank:
            return out
        self.forwards += 1
        if self.mode == "raise" or (self.mode == "interrupt" and self.forwards > 1):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if self.mode == "recompute":
            return out
        if self.mode == "interrupt":
            raise KeyboardInterrupt  # or a preemption handler's SystemExit: no Exception
        if self.mode == "far_rows":
            return torch.cat([out, out, out])
        if self.mode == "width":
            return torch.cat([out, out], dim=1)
        if self.mode == "dtype":
            return out.to(torch.bfloat16)  # autocast on this rank only
        if self.mode == "nan":
            return out * float("nan")
        raise AssertionError(self.mode)


def _vit_case(mode: str, bad_rank: int, overlapped: bool = False) -> dict[str, Any] | None:
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    torch.manual_seed(0)
    tower = _FailingTower(bad_rank, mode)
    pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
    balancer = ViTBalancer(ViTBalanceConfig(**APPLY, overlap_pixel_trip=overlapped), group)
    result: dict[str, Any] = {"forwards": tower.forwards}

    def call() -> None:
        out = balancer(tower, pixels, grid)
        result["nan_rows"] = torch.isnan(out).any(dim=1).tolist()
        out.sum().backward()

    kind, message, seconds = _outcome(call)
    result.update(kind=kind, message=message, seconds=seconds, forwards=tower.forwards)
    if mode == "nan":
        assert balancer.last_stats is not None and balancer.last_stats.applied
    _still_in_step(group, rank)
    return result


def _recomputed_vit_case(bad_rank: int) -> tuple[str, str, float] | None:
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    torch.manual_seed(0)
    tower = _FailingTower(bad_rank, "recompute")
    pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
    balancer = ViTBalancer(ViTBalanceConfig(**APPLY), group)
    # Torch's default early stop: each rank's recomputation ends by raising inside the ViT.
    checkpointed = lambda: checkpoint(balancer, tower, pixels, grid, use_reentrant=False)  # noqa: E731
    outcome = _outcome(lambda: checkpointed().sum().backward())
    _still_in_step(group, rank)
    return outcome


def test_a_vit_failing_in_its_recomputation_on_one_rank_fails_every_rank(multirank: Any) -> None:
    """Non-reentrant checkpointing stops a recomputation early by raising in it: the ranks whose
    recomputation stopped so re-raised that signal, which checkpoint swallows, and went on with
    their backward pass while rank 1's ran out of memory. They raise its error now."""
    with multirank(POOL) as w:
        outcomes = w.run(_recomputed_vit_case, 1)[:RANKS]
    assert [kind for kind, _, _ in outcomes] == ["OutOfMemoryError"] * RANKS, outcomes
    assert outcomes[0][1] == outcomes[2][1] and "rank 1: the ViT raised OutOfMemoryError" in outcomes[0][1]
    assert "_StopRecomputationError" not in outcomes[0][1], outcomes
    assert all(seconds < FAST_S for *_, seconds in outcomes), outcomes


def _failing_on_rank_1() -> tuple[Any, _FailingTower, torch.Tensor, torch.Tensor] | None:
    """On the first :data:`RANKS` ranks (None on the others): their group, a tower that runs out of
    memory on rank 1, and this rank's batch of :data:`GRIDS`."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    torch.manual_seed(0)
    pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
    return group, _FailingTower(1, "raise"), pixels, grid


def _retried_after_a_failed_call() -> tuple[str, str, bool] | None:
    """A checkpointed call that raised on rank 1 (every rank skips the batch), then the same batch
    retried with the cost fit refitted (here: priced per image), its backward recomputing it."""
    if (setup := _failing_on_rank_1()) is None:
        return None
    group, tower, pixels, grid = setup
    balancer = ViTBalancer(ViTBalanceConfig(calibrate_cost=True, **APPLY), group)
    kind, _, _ = _outcome(lambda: checkpoint(balancer, tower, pixels, grid, use_reentrant=False))
    tower.mode = "recompute"  # no failure in the forward; none in the recomputation on rank 1 either
    tower.bad_rank = -1
    refitted = CostModel(quadratic=0.0, constant=1.0)
    with mock.patch.object(balancer, "_calibrated", return_value=refitted):
        out = checkpoint(balancer, tower, pixels, grid, use_reentrant=False)
    retried = _outcome(lambda: out.sum().backward())
    applied = balancer.last_stats is not None and balancer.last_stats.applied
    return kind, retried[0] + retried[1], applied


def test_a_batch_retried_after_its_call_failed_recomputes_with_its_own_plan(multirank: Any) -> None:
    """A loop that skips a batch on ``torch.OutOfMemoryError`` and retries it later: the failed
    call's plan, kept for a recomputation that never comes, stood next to the retry's, and with
    the cost fit refitted in between (planned otherwise) the retry's backward raised that it could
    not tell which plan was its own. A failed call's plan is forgotten now."""
    with multirank(POOL) as w:
        results = w.run(_retried_after_a_failed_call)[:RANKS]
    assert all(kind == "OutOfMemoryError" for kind, _, _ in results), results
    assert all(retried == "ok" and applied for _, retried, applied in results), results


def _remembered_after_a_failure_on_one_rank() -> int | None:
    """A call the plan skips, unchecked (no collective after the ViT), whose ViT runs out of memory
    on rank 1 alone: how many plans each rank still holds for recomputations."""
    if (setup := _failing_on_rank_1()) is None:
        return None
    group, tower, pixels, grid = setup
    balancer = ViTBalancer(ViTBalanceConfig(calibrate_cost=True, trigger_threshold=5.0), group)
    _outcome(lambda: balancer(tower, pixels, grid))
    return balancer._plan_memory.remembered


def test_a_failure_on_one_rank_alone_keeps_the_plan_as_the_others_do(multirank: Any) -> None:
    """Only rank 1 raised, so the others keep the call's plan: rank 1 keeps it too, or a later
    recomputation of the same images would recall differently there (and wait in the exchange)."""
    with multirank(POOL) as w:
        assert w.run(_remembered_after_a_failure_on_one_rank)[:RANKS] == [1] * RANKS


def test_vit_exception_on_one_rank(multirank: Any) -> None:
    """The failing rank re-raises its own error; the others name it and the rank, in seconds."""
    with multirank(POOL) as w:
        results = w.run(_vit_case, "raise", 1)[:RANKS]
    assert results[1]["kind"] == "OutOfMemoryError", results[1]
    others = [results[0], results[2]]
    # Out of memory on rank 1 alone: the others raise the type too (a RuntimeError), so a loop
    # that skips the batch on torch.OutOfMemoryError skips it on every rank.
    assert {r["kind"] for r in others} == {"OutOfMemoryError"}
    assert len({r["message"] for r in others}) == 1
    assert "rank 1" in others[0]["message"] and "OutOfMemoryError" in others[0]["message"]
    assert all(r["seconds"] < FAST_S for r in results), results


@pytest.mark.parametrize("overlapped", [False, True], ids=["applied", "overlapped"])
def test_an_interrupt_in_the_vit_on_one_rank_fails_every_rank(multirank: Any, overlapped: bool) -> None:
    """A ``BaseException`` that is no ``Exception`` (``KeyboardInterrupt``; ``SystemExit`` from a
    preemption handler) goes through the status gather too: the failing rank re-raises it, the
    others raise a RuntimeError naming it. Left out, the others waited in the status gather until
    the failing rank's next gather met theirs, and gloo aborted their processes. With the pixel trip
    overlapped, an interrupt in the forward of the rank's own images ends its encoding: the ViT ran
    again on the arrivals, and the out-of-memory error it raised there was reported instead."""
    with multirank(POOL) as w:
        results = w.run(_vit_case, "interrupt", 1, overlapped)[:RANKS]
    assert results[1]["kind"] == "KeyboardInterrupt" and results[1]["forwards"] == 1, results[1]
    others = [results[0], results[2]]
    assert {r["kind"] for r in others} == {"RuntimeError"} and others[0]["message"] == others[1]["message"]
    assert "rank 1: the ViT raised KeyboardInterrupt" in others[0]["message"], others[0]
    assert all(r["seconds"] < FAST_S for r in results), results


def _users_own_step() -> None:
    activations_to_inspect = torch.ones(4)  # noqa: F841 (what a post-mortem debugger would read)
    raise torch.OutOfMemoryError("CUDA out of memory (the user's own step)")


def test_a_failed_call_keeps_the_frames_of_the_error_its_caller_was_handling() -> None:
    """A balanced call made while its caller handles an error of its own (an out-of-memory error of
    its step, say) raises an error chained to that one: clearing the failed call's frames cleared
    the caller's too (the whole traceback of an out-of-memory error), where a direct call keeps them."""

    def failing_vit(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        raise ValueError("a bug in the tower")

    try:
        _users_own_step()
    except torch.OutOfMemoryError as own:
        with pytest.raises(ValueError, match="a bug in the tower") as raised:
            ViTBalancer()(failing_vit, *towers.make_batch([(1, 2, 2)], seed=0))
        assert raised.value.__context__ is own
        (frame,) = [
            f for f, _ in traceback.walk_tb(own.__traceback__) if f.f_code.co_name == "_users_own_step"
        ]
        assert "activations_to_inspect" in frame.f_locals


class _FailingForwardTower(towers.TensorTower):
    """Raises ``error`` on rank 1 after making an activation it keeps in a local variable."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error
        self.activations: list[weakref.ref[torch.Tensor]] = []

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        activation = torch.ones(1 << 20)  # partial activations of the failed forward, 4 MiB
        self.activations.append(weakref.ref(activation))
        if dist.get_rank() == 1 and self.error == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if dist.get_rank() == 1:
            raise ValueError("a bug in the tower")
        return super().forward(pixel_values, grid_thw)


def _activations_of_a_failed_call(mode: str, error: str) -> dict[str, Any] | None:
    """Whether the failed forward's activations outlive the error the call raised, with no cyclic
    garbage collection (a loop that skips the batch goes on to the next one at once)."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    torch.manual_seed(0)
    tower = _FailingForwardTower(error)
    pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
    config = {
        "applied": APPLY,
        "overlapped": {**APPLY, "overlap_pixel_trip": True},  # two forwards, each failing on rank 1
        "skipped": {"trigger_threshold": 100.0, "check_skipped_calls": True},
    }[mode]
    balancer = ViTBalancer(ViTBalanceConfig(**config), group)
    gc.disable()
    try:
        balancer(tower, pixels, grid)
    except (RuntimeError, ValueError) as raised:
        kind = type(raised).__name__
        # While the loop still holds the error: what torch.cuda.empty_cache() could return here.
        held = sum(ref() is not None for ref in tower.activations)
    finally:
        gc.enable()
    return {"kind": kind, "held": held, "alive": sum(ref() is not None for ref in tower.activations)}


@pytest.mark.parametrize("mode", ["applied", "overlapped", "skipped"])
@pytest.mark.parametrize("error", ["oom", "value"])
def test_a_failed_call_lets_go_of_the_failed_forwards_activations(
    multirank: Any, mode: str, error: str
) -> None:
    """Freed when the error is, as after a direct call. The call's own frames held the error in a
    reference cycle, and with it the ViT's frames (the overlapped trip's other forward's too) until
    the next collection: 8-17 MB a call at this size."""
    with multirank(POOL) as w:
        results = w.run(_activations_of_a_failed_call, mode, error)[:RANKS]
    kinds = ["OutOfMemoryError"] * RANKS if error == "oom" else ["RuntimeError", "ValueError", "RuntimeError"]
    assert [{"kind": r["kind"], "alive": r["alive"]} for r in results] == [
        {"kind": kind, "alive": 0} for kind in kinds
    ], results
    if error == "oom":  # its activations gone already inside the loop's `except`
        assert all(r["held"] == 0 for r in results), results


@pytest.mark.parametrize(
    ("failures", "raised"),
    [
        (["OutOfMemoryError: CUDA out of memory"], torch.OutOfMemoryError),
        (
            ["OutOfMemoryError: CUDA out of memory", f"{PACKING_ERROR}OutOfMemoryError: out of memory"],
            torch.OutOfMemoryError,
        ),
        (["OutOfMemoryError: CUDA out of memory", "ValueError: bad grid"], RuntimeError),
        (["ValueError: OutOfMemoryError: in the message only"], RuntimeError),
    ],
)
def test_the_others_raise_out_of_memory_when_every_failing_rank_did(
    failures: list[str], raised: type
) -> None:
    """A rank whose ViT ran raises what the failing ranks raised when that was running out of
    memory everywhere, in the ViT or packing its outputs; otherwise a RuntimeError (not an
    OutOfMemoryError: a loop would take another rank's bug for memory pressure)."""
    statuses = (ViTStatus(), *(ViTStatus(error=error) for error in failures))
    fine = EncodedBatch([], None, [], None, 0.0)
    with pytest.raises(raised, match=r"The balanced ViT call failed: rank 1: ") as info:
        raise_for_vit(StatusReport(consistent=False, statuses=statuses, collectives=2), fine, merge=2)
    assert type(info.value) is raised


def _packing_case(bad_rank: int) -> tuple[str, str, float] | None:
    """Packing the return buffer runs out of memory on ``bad_rank`` once, after its ViT ran."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    out_of_memory = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    failures = [out_of_memory] if rank == bad_rank else []

    def packing(*args: Any, **kwargs: Any) -> Any:
        if failures:
            raise failures.pop()
        return pack_return(*args, **kwargs)

    with mock.patch.object(balancer_module, "pack_return", packing):
        return _balance_with(ViTBalanceConfig(**APPLY), group, rank)


def test_packing_the_return_trip_out_of_memory_on_one_rank(multirank: Any) -> None:
    """Every rank hears of it in the status gather, before the return trip (packed while the gather
    was in flight, the failing rank left the others waiting in the return trip)."""
    with multirank(POOL) as w:
        results = w.run(_packing_case, 2)[:RANKS]
    assert results[2][0] == "OutOfMemoryError", results[2]
    others = [results[0], results[1]]
    assert {kind for kind, _, _ in others} == {"OutOfMemoryError"} and others[0][1] == others[1][1], others
    expected = "rank 2: packing the ViT's outputs for the return trip raised OutOfMemoryError"
    assert expected in others[0][1], others[0][1]
    assert all(seconds < FAST_S for _, _, seconds in results), results


def _gradients_case(mode: str) -> dict[str, Any] | None:
    """Rank 1 encodes without gradients (its ViT frozen, or under ``torch.no_grad()``) while the
    others encode with them; each rank then backpropagates what it can."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    torch.manual_seed(0)
    tower = towers.TensorTower()
    if mode == "frozen" and rank == 1:
        tower.requires_grad_(False)
    pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
    balancer = ViTBalancer(ViTBalanceConfig(**APPLY), group)

    def call() -> None:
        with torch.set_grad_enabled(not (mode == "no_grad" and rank == 1)):
            out = balancer(tower, pixels, grid)
        if out.requires_grad:
            out.sum().backward()

    kind, message, seconds = _outcome(call)
    _still_in_step(group, rank)
    return {"kind": kind, "message": message, "seconds": seconds}


@pytest.mark.parametrize("mode", ["frozen", "no_grad"])
def test_ranks_that_differ_in_gradients_raise_instead_of_waiting(multirank: Any, mode: str) -> None:
    """A ViT frozen on one rank only, or a call under no_grad there: the others' backward pass
    would wait in the trips for a rank that runs none. Every rank raises, in the forward."""
    with multirank(POOL) as w:
        results = w.run(_gradients_case, mode)[:RANKS]
    assert {r["kind"] for r in results} == {"ValueError"}, results
    assert len({r["message"] for r in results}) == 1
    assert "ranks [0, 2] encode with gradients and ranks [1] without" in results[0]["message"]
    assert all(r["seconds"] < FAST_S for r in results), results


def _skipped_vit_case(prepared: bool) -> dict[str, Any] | None:
    """A call every rank's plan skips, checked; rank 1's ViT raises."""
    if (setup := _failing_on_rank_1()) is None:
        return None
    group, tower, pixels, grid = setup
    balancer = ViTBalancer(ViTBalanceConfig(trigger_threshold=100.0, check_skipped_calls=True), group)

    def call() -> None:
        ticket = balancer.prepare(pixels, grid, tower) if prepared else None
        assert ticket is None or not ticket.plan.applied
        balancer(tower, pixels, grid, prepared=ticket).sum().backward()

    kind, message, seconds = _outcome(call)
    _still_in_step(group, dist.get_rank())
    return {"kind": kind, "message": message, "seconds": seconds}


@pytest.mark.parametrize("prepared", [False, True])
def test_vit_exception_in_a_checked_skipped_call(multirank: Any, prepared: bool) -> None:
    """With ``check_skipped_calls`` a call that moves nothing fails on every rank at once too."""
    with multirank(POOL) as w:
        results = w.run(_skipped_vit_case, prepared)[:RANKS]
    assert results[1]["kind"] == "OutOfMemoryError", results[1]
    others = [results[0], results[2]]
    assert {r["kind"] for r in others} == {"OutOfMemoryError"} and len({r["message"] for r in others}) == 1
    assert "rank 1: the ViT raised OutOfMemoryError" in others[0]["message"], others[0]["message"]
    assert all(r["seconds"] < FAST_S for r in results), results


@pytest.mark.parametrize(
    ("mode", "fragment"),
    [("far_rows", "rows"), ("width", "trailing shape"), ("dtype", "torch.bfloat16")],
)
def test_unusable_vit_outputs_raise_on_every_rank(multirank: Any, mode: str, fragment: str) -> None:
    """Rows far off, another width, or another dtype on one rank: the same ValueError everywhere."""
    with multirank(POOL) as w:
        results = w.run(_vit_case, mode, 2)[:RANKS]
    assert {r["kind"] for r in results} == {"ValueError"}, results
    assert len({r["message"] for r in results}) == 1, results
    assert "rank 2" in results[0]["message"] and fragment in results[0]["message"], results[0]["message"]
    assert all(r["seconds"] < FAST_S for r in results), results


def test_nan_lands_on_the_images_owner(multirank: Any) -> None:
    """NaNs a rank's ViT makes for another rank's images arrive on that rank, as they are."""
    with multirank(POOL) as w:
        results = w.run(_vit_case, "nan", 1)[:RANKS]
    assert [r["kind"] for r in results] == ["ok"] * RANKS, results
    # Rank 1 encodes some of rank 0's images in the plan: those rows come back NaN on rank 0, and
    # rank 1's own image (encoded elsewhere or at home) is NaN only where rank 1 encoded it.
    assert any(results[0]["nan_rows"]), results[0]
    assert not all(results[0]["nan_rows"]), results[0]


def _meta_grid() -> list[tuple[str, str, float]] | None:
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    tower, pixels, grid = _tower_and_batch(rank)
    if rank == 2:
        grid = grid.to("meta")
    balancer = ViTBalancer(ViTBalanceConfig(**APPLY), group)
    outcomes = [
        _outcome(lambda: balancer(tower, pixels, grid)),
        _outcome(lambda: balancer.prepare(pixels, grid)),
    ]
    _still_in_step(group, rank)
    return outcomes


def test_grid_on_the_meta_device_names_grid_thw(multirank: Any) -> None:
    """In a call and in a plan made ahead, which reads the rows too (it raised on that rank alone,
    and the others' plans then paired with its next gather)."""
    with multirank(POOL) as w:
        per_rank = w.run(_meta_grid)[:RANKS]
    for call in range(2):
        outcomes = [rank_outcomes[call] for rank_outcomes in per_rank]
        assert len({(k, m) for k, m, _ in outcomes}) == 1, outcomes
        kind, message, _ = outcomes[0]
        assert kind == "ValueError" and "rank 2: grid_thw is on a meta device" in message, message
        assert "pixel_values" not in message.split("rank 2:")[1], message


#: Rank 0's first image holds the rows of its next two together, so a plan that sends it to rank 1
#: and one that sends those two instead move the same rows between the same ranks: both trips
#: complete, and only the images' grids differ.
TWIN_GRIDS = [[(1, 4, 8), (1, 4, 4), (1, 4, 4)], [(1, 2, 2)], [(1, 2, 4)]]


def _plans_case(mode: str) -> dict[str, Any] | None:
    """One call under a given plan: every rank's alike (``"same"``), or rank 1's sending rank 0's
    two small images in place of its large one (``"rank 1 differs"``; ``"unchecked"``: that, with
    the check of the plans taken out). Then a good call on every rank."""
    group = subgroup(RANKS)
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    plan_rebalance = balancer_module.plan_rebalance
    first = (0, 1, 1) if mode != "same" and rank == 1 else (1, 0, 0)

    def planned(*args: Any, **kwargs: Any) -> Any:
        plan = plan_rebalance(*args, **kwargs)
        return dataclasses.replace(plan, applied=True, reason="applied", destinations=(first, (1,), (2,)))

    torch.manual_seed(0)
    tower = towers.TensorTower()
    pixels, grid = towers.make_batch(TWIN_GRIDS[rank], seed=rank)
    result: dict[str, Any] = {}

    def call() -> None:
        out = ViTBalancer(ViTBalanceConfig(**APPLY), group)(tower, pixels, grid)
        result["max_error"] = float((out - tower(pixels, grid)).abs().max())

    with mock.patch.object(balancer_module, "plan_rebalance", planned):
        if mode == "unchecked":
            with mock.patch.object(balancer_module, "raise_for_plans", lambda report, prepared=False: None):
                result["kind"], result["message"], result["seconds"] = _outcome(call)
        else:
            result["kind"], result["message"], result["seconds"] = _outcome(call)
    _still_in_step(group, rank)
    return result


def test_plans_that_differ_raise_before_the_return_trip(multirank: Any) -> None:
    """Ranks whose plans differ though their rows match raise the same RuntimeError, naming the
    ranks; unchecked, the same call returns wrong outputs on rank 0 without a word."""
    with multirank(POOL) as w:
        same = w.run(_plans_case, "same")[:RANKS]
        differ = w.run(_plans_case, "rank 1 differs")[:RANKS]
        unchecked = w.run(_plans_case, "unchecked")[:RANKS]
    # The plan every rank shares moves rank 0's large image: the direct call's outputs, to fp32's
    # few ulps (the same operations on the same rows, in another batch).
    assert [r["kind"] for r in same] == ["ok"] * RANKS and max(r["max_error"] for r in same) < 1e-5, same
    assert {r["kind"] for r in differ} == {"RuntimeError"}, differ
    assert len({r["message"] for r in differ}) == 1, differ
    message = differ[0]["message"]
    assert "planned it differently" in message and "Ranks [1]" in message and "rank 0" in message, message
    assert all(r["seconds"] < FAST_S for r in differ), differ
    # What the check prevents: rank 1 encoded rank 0's large image as two small ones, and rank 0
    # took the outputs for its own.
    assert [r["kind"] for r in unchecked] == ["ok"] * RANKS, unchecked
    assert unchecked[0]["max_error"] > 1e-2 and unchecked[2]["max_error"] < 1e-5, unchecked


def _skipped_call_case() -> tuple[str, str, float] | None:
    """Rank 1 skips a balanced call the others make (a text-only batch behind an ``if``), on a group
    whose collectives time out after 2 s; then a good call on the pool's group."""
    from datetime import timedelta

    short = dist.new_group(list(range(RANKS)), timeout=timedelta(seconds=2), backend="gloo")
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    outcome = ("skipped", "", 0.0)
    if rank != 1:
        torch.manual_seed(0)
        pixels, grid = towers.make_batch(GRIDS[rank], seed=rank)
        outcome = _outcome(
            lambda: ViTBalancer(ViTBalanceConfig(**APPLY), short)(towers.TensorTower(), pixels, grid)
        )
    dist.destroy_process_group(short)
    dist.barrier(subgroup(RANKS))  # the others' timeouts are over
    _still_in_step(subgroup(RANKS), rank)
    return outcome


def test_a_rank_that_skips_a_call_is_named_as_the_cause(multirank: Any) -> None:
    """The ranks that made a balanced call another rank skipped wait for the group's timeout (a
    collective cannot tell a late rank from an absent one), then raise a RuntimeError that says
    what gloo's timeout text does not: every rank must make the same balanced calls."""
    with multirank(POOL) as w:
        results = w.run(_skipped_call_case, timeout=60)[:RANKS]
    assert results[1][0] == "skipped"
    for kind, message, seconds in (results[0], results[2]):
        assert kind == "RuntimeError" and "the gather that starts a balanced call failed" in message, message
        assert "every rank of the group must make the same balanced calls" in message, message
        assert seconds < FAST_S, seconds


def _prepared_on_some_ranks_case() -> tuple[str, str, float] | None:
    """Every rank prepares a plan that moves images; rank 1 forgets to pass it (``prepared=None``),
    on a group whose collectives time out after 2 s; then a good call on the pool's group."""
    from datetime import timedelta

    short = dist.new_group(list(range(RANKS)), timeout=timedelta(seconds=2), backend="gloo")
    rank = dist.get_rank()
    if rank >= RANKS:
        return None
    tower, pixels, grid = _tower_and_batch(rank)
    balancer = ViTBalancer(ViTBalanceConfig(**APPLY), short)
    ticket = balancer.prepare(pixels, grid, tower)
    assert ticket is not None and ticket.plan.applied
    outcome = _outcome(lambda: balancer(tower, pixels, grid, prepared=ticket if rank != 1 else None))
    dist.destroy_process_group(short)
    dist.barrier(subgroup(RANKS))  # the others' timeouts are over
    _still_in_step(subgroup(RANKS), rank)
    return outcome


def test_a_rank_that_calls_without_the_prepared_plan_is_named_as_the_cause(multirank: Any) -> None:
    """The ranks given their plan start with the pixel trip, the one without it with the metadata
    gather: they wait for the group's timeout. The ranks in the trip raised gloo's text alone; now
    they say what to do, as the rank in the gather does (and keep the backend's error type)."""
    with multirank(POOL) as w:
        results = w.run(_prepared_on_some_ranks_case, timeout=60)[:RANKS]
    assert all(kind in {"RuntimeError", "DistBackendError"} for kind, _, _ in results), results
    for _, message, seconds in (results[0], results[2]):
        assert "the pixel trip of a call given a plan made before it failed" in message, message
        assert "every rank must pass the plan made for its call (prepared=), or none" in message, message
        assert seconds < FAST_S, seconds
    assert "the gather that starts a balanced call failed" in results[1][1], results[1]


def _gather_raising(error: BaseException) -> Any:
    """``_gathered_metadata`` with its gather raising ``error`` (and no process group needed)."""
    host = mock.patch.object(balancer_module, "host_device", return_value=torch.device("cpu"))
    gather = mock.patch.object(balancer_module, "gather_metadata", side_effect=error)
    with host, gather:
        return balancer_module._gathered_metadata(mock.Mock(), None)


def test_the_rewrapped_gather_error_keeps_the_backends_type() -> None:
    """Loops that catch torch.distributed's errors (DistBackendError) still catch the rewrapped one;
    an out-of-memory error passes as it is."""
    for raised, expected in (
        (dist.DistBackendError("NCCL watchdog timeout"), dist.DistBackendError),
        (RuntimeError("Connection closed by peer"), RuntimeError),
    ):
        with pytest.raises(expected, match="balanced call failed on this rank") as caught:
            _gather_raising(raised)
        assert type(caught.value) is expected and caught.value.__cause__ is raised
    for own in (
        torch.OutOfMemoryError("out of memory"),
        torch.AcceleratorError("CUDA error"),
        NotImplementedError(),
    ):
        with pytest.raises(type(own)) as caught_own:
            _gather_raising(own)
        assert caught_own.value is own  # not the collective's: as it is


def _trip_raising(error: BaseException, prepared: bool) -> None:
    """A call's pixel trip raising ``error`` in :meth:`_Call.first_trip` (no process group needed)."""
    call = balancer_module._Call(group=None, rank=0, merge=2, device=torch.device("cpu"))
    call.batch_digest = 0 if prepared else None
    with call.first_trip():
        raise error


def test_a_prepared_calls_trip_rewraps_only_the_backends_errors() -> None:
    """The pixel trip of a call given a plan made before it is its first collective: the backend's
    errors there say that every rank must pass its plan; errors of the rank's own work in the trip
    (a device error, out of memory) pass as they are, as do all in a call that gathered first."""
    for raised in (dist.DistBackendError("NCCL watchdog timeout"), RuntimeError("Timed out waiting 2000ms")):
        with pytest.raises(type(raised), match=r"pass the plan made for its call \(prepared=\)") as caught:
            _trip_raising(raised, prepared=True)
        assert type(caught.value) is type(raised) and caught.value.__cause__ is raised
        with pytest.raises(type(raised)) as unprepared:
            _trip_raising(raised, prepared=False)
        assert unprepared.value is raised
    for own in (
        torch.OutOfMemoryError("out of memory"),
        torch.AcceleratorError("CUDA error"),
        NotImplementedError(),
    ):
        with pytest.raises(type(own)) as caught_own:
            _trip_raising(own, prepared=True)
        assert caught_own.value is own
