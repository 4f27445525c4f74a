"""The rules a balanced call's recomputation under activation checkpointing follows (one process)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lightning_vit_balance import ViTBalanceConfig, plan_rebalance
from lightning_vit_balance.exchange import RankMetadata
from lightning_vit_balance.recompute import PlanMemory, in_backward_pass


def _metadata(grids: list[list[tuple[int, int, int]]]) -> tuple[RankMetadata, ...]:
    return tuple(
        RankMetadata(status=0, details=(), channels=3, dtype_code=0, requires_grad=False, grids=tuple(rows))
        for rows in grids
    )


def test_a_recomputation_recalls_the_latest_call_of_its_grids_not_recalled_yet() -> None:
    grids = [[(1, 8, 8), (1, 4, 4)], [(1, 2, 2)]]
    applied = plan_rebalance([[64, 16], [4]], ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
    skipped = plan_rebalance([[64, 16], [4]], ViTBalanceConfig(trigger_threshold=5.0))
    assert applied.destinations != skipped.destinations
    memory = PlanMemory(size=3)
    memory.remember(_metadata(grids), skipped)  # an earlier step's call of the same batch
    memory.remember(_metadata(grids), applied)
    memory.remember(_metadata([[(1, 2, 2)], []]), skipped)
    # Recomputed in the reverse order of the forward calls: each takes its own.
    assert memory.recall(_metadata(grids)) is applied
    assert memory.recall(_metadata(grids)) is skipped
    assert memory.recall(_metadata(grids)) is applied  # all taken (a second backward): the latest
    assert memory.recall(_metadata([[(1, 4, 4)], []])) is None
    memory.remember(_metadata([[(1, 2, 2)], []]), applied)
    memory.remember(_metadata([[(1, 2, 2)], []]), applied)
    assert memory.recall(_metadata(grids)) is None  # dropped: only the latest 3 are kept


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
