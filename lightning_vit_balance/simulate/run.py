"""The simulation: random micro-batches on every rank, one plan per step, per-step figures."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from lightning_vit_balance.config import ViTBalanceConfig
from lightning_vit_balance.planning import RebalancePlan, plan_rebalance, positive_ints

__all__ = ["DPResult", "draw_batches", "simulate"]

#: What each entry of ``simulate``'s ``samples`` must be.
_SAMPLE = "a positive int (a visual's patch count T*H*W)"


@dataclass(frozen=True, eq=False)
class DPResult:
    """Per-step figures of the simulation at one data-parallel size.

    Attributes:
        ranks: Data-parallel size.
        imbalance_before: ``max/mean - 1`` of the rank loads with every image at home, per step.
        imbalance_after: The same under the plan (equal to before on skipped steps).
        makespan_before: Slowest rank's cost without balancing, per step.
        makespan_after: Slowest rank's cost with balancing (skipped steps: unchanged).
        lower_bound: No plan's slowest rank costs less: ``max(mean load, largest image)``.
        reasons: The plan's ``reason`` per step (``"applied"`` or why it skipped).
        moved_rows: Patch rows sent to another rank, all ranks together, per step.
        busiest_rows: Most patch rows one rank sends or receives, per step.
        plan_seconds: Wall time of ``plan_rebalance``, per step.
    """

    ranks: int
    imbalance_before: np.ndarray
    imbalance_after: np.ndarray
    makespan_before: np.ndarray
    makespan_after: np.ndarray
    lower_bound: np.ndarray
    reasons: tuple[str, ...]
    moved_rows: np.ndarray
    busiest_rows: np.ndarray
    plan_seconds: np.ndarray

    @property
    def steps(self) -> int:
        """Simulated steps."""
        return len(self.reasons)

    @property
    def speedup(self) -> float:
        """Mean slowest-rank cost without balancing over the mean with it (ViT only)."""
        after = float(self.makespan_after.mean())
        return float(self.makespan_before.mean()) / after if after > 0 else 1.0

    @property
    def speedup_bound(self) -> float:
        """The most any plan could give: mean slowest-rank cost over the mean lower bound."""
        bound = float(self.lower_bound.mean())
        return float(self.makespan_before.mean()) / bound if bound > 0 else 1.0

    def reason_shares(self) -> dict[str, float]:
        """Share of steps per plan reason, ``"applied"`` included, most frequent first."""
        counts = Counter(self.reasons)
        return {reason: n / self.steps for reason, n in counts.most_common()}


class _Sampler:
    """Draws micro-batches fast: every sample's visuals live in one flat array."""

    def __init__(
        self,
        samples: Sequence[Sequence[int]],
        ranks: int,
        samples_per_rank: int,
        seed: int,
        frames: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.lengths = np.fromiter(map(len, samples), dtype=np.int64, count=len(samples))
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1]))
        self.visuals = np.fromiter(chain.from_iterable(samples), dtype=np.int64)
        self.steps = None if frames is None else np.fromiter(chain.from_iterable(frames), dtype=np.int64)
        self.shape = (ranks, samples_per_rank)
        self.rng = np.random.default_rng([seed, ranks])

    def draw(self) -> tuple[list[list[int]], np.ndarray, np.ndarray, list[list[int]] | None]:
        """(each rank's patch counts, the same flat, the rank of each, each rank's temporal steps
        or ``None`` without frames) for one step."""
        picks = self.rng.integers(0, len(self.lengths), size=self.shape).reshape(-1)
        lengths = self.lengths[picks]
        # Visual j of picked sample i sits at starts[i] + j in the flat array.
        first = np.cumsum(lengths) - lengths
        index = np.repeat(self.starts[picks] - first, lengths) + np.arange(int(lengths.sum()))
        flat = self.visuals[index]
        per_rank = lengths.reshape(self.shape).sum(axis=1)
        ends = np.cumsum(per_rank).tolist()
        bounds = list(zip([0, *ends[:-1]], ends))
        values = flat.tolist()
        rows = [values[a:b] for a, b in bounds]
        steps = None
        if self.steps is not None:
            picked = self.steps[index].tolist()
            steps = [picked[a:b] for a, b in bounds]
        return rows, flat, np.repeat(np.arange(self.shape[0]), per_rank), steps


def draw_batches(
    samples: Sequence[Sequence[int]], ranks: int, samples_per_rank: int, steps: int, seed: int
) -> Iterator[list[list[int]]]:
    """Per step, the patch counts of every rank's micro-batch.

    Each rank draws ``samples_per_rank`` samples uniformly, with replacement, from ``samples``
    (each a sequence of patch counts); a rank's list is its samples' visuals in order. The draws
    depend only on ``seed`` and ``ranks``, so a DP size gives the same batches whichever other sizes
    are simulated with it.
    """
    sampler = _Sampler(samples, ranks, samples_per_rank, seed)
    for _ in range(steps):
        yield sampler.draw()[0]


def _traffic(plan: RebalancePlan, counts: np.ndarray, home: np.ndarray) -> tuple[int, int]:
    """(rows sent away over all ranks, most rows one rank sends or receives) of a plan.

    ``counts`` and ``home``: the plan's patch counts, flat, and the rank each image comes from.
    """
    if not plan.applied:
        return 0, 0
    dest = np.fromiter(chain.from_iterable(plan.destinations), dtype=np.int64, count=counts.size)
    away = dest != home
    sent = np.bincount(home[away], weights=counts[away], minlength=plan.num_ranks)
    received = np.bincount(dest[away], weights=counts[away], minlength=plan.num_ranks)
    return int(counts[away].sum()), int(max(sent.max(), received.max()))


def _steps_as_items(
    batch: list[list[int]], counts: np.ndarray, home: np.ndarray, frames: list[list[int]]
) -> tuple[list[list[int]], np.ndarray, np.ndarray, list[list[int]]]:
    """A drawn step with each visual of ``T`` temporal steps as ``T`` items of ``1/T`` of its patches,
    as the balancer gathers them with ``split_videos``; ``draw``'s four values."""
    steps = np.fromiter(chain.from_iterable(frames), dtype=np.int64, count=counts.size)
    rows = [[n // t for n, t in zip(row, ts) for _ in range(t)] for row, ts in zip(batch, frames)]
    return rows, np.repeat(counts // steps, steps), np.repeat(home, steps), [[1] * len(row) for row in rows]


def _simulate_size(
    samples: Sequence[Sequence[int]],
    ranks: int,
    samples_per_rank: int,
    steps: int,
    seed: int,
    config: ViTBalanceConfig,
    progress: Callable[[int], None] | None,
    frames: Sequence[Sequence[int]] | None,
) -> DPResult:
    figures = np.zeros((8, steps))
    reasons: list[str] = []
    sampler = _Sampler(samples, ranks, samples_per_rank, seed, frames)
    for step in range(steps):
        batch, counts, home, batch_frames = sampler.draw()
        if config.split_videos and batch_frames is not None:
            batch, counts, home, batch_frames = _steps_as_items(batch, counts, home, batch_frames)
        start = time.perf_counter()
        plan = plan_rebalance(batch, config, frames=batch_frames)
        elapsed = time.perf_counter() - start
        moved, busiest = _traffic(plan, counts, home)
        figures[:, step] = (
            plan.imbalance_before,
            plan.imbalance_after,
            plan.makespan_before,
            plan.makespan_after,
            plan.lower_bound,
            moved,
            busiest,
            elapsed,
        )
        reasons.append(plan.reason)
        if progress is not None:
            progress(1)
    return DPResult(ranks, *figures[:5], tuple(reasons), *figures[5:])


def _check_frames(samples: Sequence[Sequence[int]], frames: Sequence[Sequence[int]]) -> None:
    """Raise unless ``frames`` holds one positive int per visual of every sample."""
    if len(frames) != len(samples):
        raise ValueError(
            f"simulate(frames=...) has {len(frames)} samples, samples has {len(samples)}: expected one "
            "row of temporal steps per sample (VisualDataset.frames)."
        )
    for s, (row, sample) in enumerate(zip(frames, samples)):
        if len(row) != len(sample) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in row
        ):
            raise ValueError(
                f"simulate(frames[{s}]={list(row)!r}) is invalid: expected {len(sample)} ints >= 1, one "
                f"per visual of samples[{s}]."
            )


def simulate(
    samples: Sequence[Sequence[int]],
    ranks: Sequence[int],
    *,
    samples_per_rank: int,
    steps: int,
    seed: int = 0,
    config: ViTBalanceConfig | None = None,
    progress: Callable[[int], None] | None = None,
    frames: Sequence[Sequence[int]] | None = None,
) -> tuple[DPResult, ...]:
    """Simulate ``steps`` training steps at each DP size in ``ranks`` and plan every one.

    Args:
        samples: Patch counts of each sample's visuals (``VisualDataset.samples``).
        ranks: Data-parallel sizes to simulate.
        samples_per_rank: Samples in each rank's micro-batch.
        steps: Steps per DP size.
        seed: Seeds the draws (see :func:`draw_batches`).
        config: Solver, skip rules and cost model passed to ``plan_rebalance``.
        progress: Called with ``1`` after every planned step.
        frames: Temporal steps ``t`` of each sample's visuals, shaped like ``samples``
            (``VisualDataset.frames``), passed to ``plan_rebalance``: a per-frame cost model
            (``config.cost_per_frame_attention``) prices videos with them. ``None``: 1 each.

    Raises:
        ValueError: a count is not a positive int, ``samples`` is empty, or ``frames`` is not
            shaped like ``samples``.
    """
    for name, value in (
        ("samples_per_rank", samples_per_rank),
        ("steps", steps),
        *(("ranks", r) for r in ranks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"simulate({name}={value!r}) is invalid: expected an int >= 1.")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"simulate(seed={seed!r}) is invalid: expected an int >= 0.")
    if not samples or not ranks:
        raise ValueError(f"simulate needs samples and ranks, got {len(samples)} samples and ranks={ranks!r}.")
    # Each visual a positive int, named where the user put it: the draws would read 1.5 as 1, and
    # a bad count would be reported later as a position in a drawn batch instead.
    positive_ints(samples, "samples", _SAMPLE)
    if frames is not None:
        _check_frames(samples, frames)
    config = config if config is not None else ViTBalanceConfig()
    return tuple(
        _simulate_size(samples, r, samples_per_rank, steps, seed, config, progress, frames) for r in ranks
    )
