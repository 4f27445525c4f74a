"""The rules a balanced call's recomputation under activation checkpointing follows (one process)."""

from __future__ import annotations

from typing import Any, ClassVar
from unittest import mock

import pytest
import torch

from lightning_vit_balance import ViTBalanceConfig, plan_rebalance
from lightning_vit_balance.exchange import RankMetadata
from lightning_vit_balance.recompute import PlanMemory, in_backward_pass


def _metadata(grids: list[list[tuple[int, int, int]]]) -> tuple[RankMetadata, ...]:
    return tuple(
        RankMetadata(status=0, details=(), channels=3, dtype_code=0, requires_grad=False, grids=tuple(rows))
        for rows in grids
    )


def test_a_recomputation_recalls_its_calls_plan_or_raises_where_it_cannot_tell() -> None:
    grids = [[(1, 8, 8), (1, 4, 4)], [(1, 2, 2)]]
    applied = plan_rebalance([[64, 16], [4]], ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
    skipped = plan_rebalance([[64, 16], [4]], ViTBalanceConfig(trigger_threshold=5.0))
    assert applied.destinations != skipped.destinations
    other = _metadata([[(1, 2, 2)], []])
    memory = PlanMemory(size=4)
    with torch.no_grad():
        memory.remember(_metadata(grids), skipped)  # built no graph: a reentrant forward, a metric
    memory.remember(_metadata(grids), applied)
    memory.remember(other, skipped)
    assert memory.recall(_metadata(grids)) is applied  # the call that built a graph first
    assert memory.recall(_metadata(grids)) is skipped  # then the one that built none
    with pytest.raises(RuntimeError, match="2 calls had its images and were planned differently"):
        memory.recall(_metadata(grids))  # all taken (a second backward pass): they disagree
    assert memory.recall(other) is skipped
    assert memory.recall(other) is skipped  # taken again by a second backward pass
    memory.remember(_metadata(grids), applied)
    memory.remember(_metadata(grids), skipped)  # the same images planned otherwise since
    with pytest.raises(RuntimeError, match="cannot tell which plan its forward call used"):
        memory.recall(_metadata(grids))
    with pytest.raises(RuntimeError, match="none of the latest 4 calls had its images"):
        memory.recall(_metadata([[(1, 4, 4)], []]))
    # A plain and a checkpointed call of the same images, one recomputed; the next step's call of
    # them planned otherwise (the cost fit refitted): its recomputation takes that step's plan.
    memory = PlanMemory(size=4)
    memory.remember(_metadata(grids), applied)
    memory.remember(_metadata(grids), applied)
    assert memory.recall(_metadata(grids)) is applied
    memory.remember(_metadata(grids), skipped)
    assert memory.recall(_metadata(grids)) is skipped


def test_a_failed_calls_plans_are_forgotten_and_only_those() -> None:
    grids = _metadata([[(1, 8, 8), (1, 4, 4)], [(1, 2, 2)]])
    applied = plan_rebalance([[64, 16], [4]], ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
    skipped = plan_rebalance([[64, 16], [4]], ViTBalanceConfig(trigger_threshold=5.0))
    # Planned apart (one moves an image), so a recall among both raises: each step below tells
    # which plans the memory still holds.
    assert applied.applied and not skipped.applied
    memory = PlanMemory(size=2)
    memory.remember(grids, skipped)
    memory.remember(grids, applied)
    memory.remember(grids, applied)  # the oldest leaves the memory, not the count
    mark = memory.remembered
    memory.forget_since(mark)  # a call that raised before it planned
    assert memory.recall(grids) is applied
    memory.remember(grids, skipped)  # a call that raised after its plan (in its ViT)
    memory.forget_since(mark)
    assert memory.remembered == mark and memory.recall(grids) is applied  # no other plan among them


def test_forgetting_more_plans_than_the_memory_holds_leaves_it_empty_and_counted() -> None:
    """A call that raised after more plans than the memory keeps (a memory of one, a call of two
    towers) forgets what is left of them without an error of its own in place of the call's, and
    the count goes back to its mark, so the next failed call forgets only its own plans."""
    grids = _metadata([[(1, 8, 8), (1, 4, 4)], [(1, 2, 2)]])
    plan = plan_rebalance([[64, 16], [4]], ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
    memory = PlanMemory(size=1)
    mark = memory.remembered
    memory.remember(grids, plan)
    memory.remember(grids, plan)
    memory.forget_since(mark)
    assert memory.remembered == mark
    with pytest.raises(RuntimeError, match="none of the latest 1 calls had its images"):
        memory.recall(grids)


class _Probe(torch.autograd.Function):
    """Records :func:`in_backward_pass` in its forward and backward."""

    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _Probe.seen.append(in_backward_pass())
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _Probe.seen.append(in_backward_pass())
        return grad


def test_in_backward_pass_is_true_only_while_autograd_runs_a_backward_pass() -> None:
    _Probe.seen.clear()
    x = torch.ones(2, requires_grad=True)
    _Probe.apply(x).sum().backward()
    torch.autograd.grad(_Probe.apply(x).sum(), x)
    assert _Probe.seen == [False, True, False, True]
    assert not in_backward_pass()
    # A process's first backward pass has task id 0 (seen above only where no test ran one before).
    for task, running in ((0, True), (7, True), (-1, False)):
        with mock.patch.object(torch._C, "_current_graph_task_id", return_value=task):
            assert in_backward_pass() is running
