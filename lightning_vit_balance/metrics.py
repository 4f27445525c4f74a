"""Balanced calls' diagnostics as ``vit_balance/*`` metrics, for any training loop's logger.

:class:`BalanceMetrics` aggregates the :class:`~lightning_vit_balance.BalanceStats` of a span of
calls (a window: one optimizer step, or the steps since the last logged one) and counts every call
since training started. The Lightning callback and the Hugging Face ``Trainer`` callback log what
it gives; a plain PyTorch loop can log it too::

    metrics = BalanceMetrics()
    handle.pop_stats()  # the handle keeps each forward's stats from its first call on
    for step, batch in enumerate(loader):
        loss = model(**batch).loss  # a model given to balance_vision_tower
        ...
        for stats in handle.pop_stats():
            metrics.add(stats)
        if step % 10 == 0:
            logger.log(metrics.metrics(), step=step)
            metrics.reset_window()
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_vit_balance.config import require_flag
from lightning_vit_balance.planning import REASONS

if TYPE_CHECKING:
    from lightning_vit_balance.balancer import BalanceStats

__all__ = ["BalanceMetrics"]

PREFIX = "vit_balance/"
#: Data-parallel sizes up to which the per-rank series are logged by default (``per_rank_loads=None``):
#: three series per rank, so 192 at this size; beyond it a logger (and a dashboard's legend) would
#: carry hundreds to thousands of them per record, and the summaries (``vit_ms_max``,
#: ``vit_ms_mean``, ``vit_ms_slowest_rank``, the imbalances) tell the story.
PER_RANK_SERIES_UP_TO = 64
#: Every reason a call can be skipped for, counted as ``vit_balance/skipped/{reason}``.
SKIP_REASONS: tuple[str, ...] = tuple(reason for reason in REASONS if reason != "applied")
#: Per-call figures averaged over the calls of a window.
_MEANS: tuple[str, ...] = ("applied", "imbalance_before", "imbalance_after")
#: Per-call figures summed over the calls of a window.
_SUMS: tuple[str, ...] = (
    "moved_images",
    "moved_patches",
    "total_patches",
    "bytes_sent",
    "bytes_received",
    "plan_ms",
    "exchange_ms",
    "prepare_ms",
    "trip_ms",
    "collectives",
)


def _call_figures(stats: BalanceStats) -> dict[str, float]:
    """The figures of one call that a window averages (:data:`_MEANS`) or sums (:data:`_SUMS`)."""
    return {
        "applied": 1.0 if stats.applied else 0.0,
        "imbalance_before": float(stats.imbalance_before),
        "imbalance_after": float(stats.imbalance_after),
        "moved_images": float(stats.moved_images),
        "moved_patches": float(stats.moved_patches),
        "total_patches": float(stats.total_patches),
        "bytes_sent": float(stats.bytes_sent),
        "bytes_received": float(stats.bytes_received),
        "plan_ms": 1000.0 * float(stats.plan_seconds),
        "exchange_ms": 1000.0 * float(stats.exchange_seconds),
        "prepare_ms": 1000.0 * float(stats.prepare_seconds),
        # A call reports the trips of the one before it, -1 when none are due.
        "trip_ms": max(0.0, float(stats.trip_ms)),
        "collectives": float(stats.collectives),
    }


class _Window:
    """The calls of a span of optimizer steps.

    Python floats are float64: byte and patch sums pass 2**24, where float32 stops counting
    exactly. Nothing is synchronised: plans and loads are the same on every DP rank.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.imbalance_calls = 0  # calls whose imbalance is known (not NaN)
        self.totals: dict[str, float] = dict.fromkeys(_MEANS + _SUMS, 0.0)
        self.load_calls = 0
        self.loads: dict[str, list[float]] = {}
        self.vit_calls = 0
        self.vit_max = 0.0
        self.vit_mean = 0.0
        self.vit_per_rank: list[float] = []
        self.cost_fits = -1  # the most online cost fits of a call's balancer (-1: none fits)
        self.cost_error_calls = 0  # calls whose cost_error is known
        self.cost_error = 0.0  # their sum

    def add(self, stats: BalanceStats, per_rank_loads: bool | None) -> None:
        self.calls += 1
        figures = _call_figures(stats)
        unknown = math.isnan(figures["imbalance_before"]) or math.isnan(figures["imbalance_after"])
        if unknown or stats.reason == "no-images":
            # Unknown (balancing disabled on many ranks: nothing gathered), or no load to balance
            # (text-only steps, whose 0 would pass for perfect balance): left out of the means.
            figures["imbalance_before"] = figures["imbalance_after"] = 0.0
        else:
            self.imbalance_calls += 1
        for name, value in figures.items():
            self.totals[name] += value
        self._add_vit_ms(tuple(stats.vit_ms))
        self._add_cost_fit(int(stats.cost_fits), float(stats.cost_error))
        before, after = tuple(stats.loads_before), tuple(stats.loads_after)
        if not (len(before) <= PER_RANK_SERIES_UP_TO if per_rank_loads is None else per_rank_loads):
            # No series at this DP size or setting, nor any a restored window held (another run's).
            self.load_calls, self.loads = 0, {}
            return
        if len(before) != len(self.loads.get("before", before)):
            # A new DP size starts a fresh series.
            self.load_calls, self.loads = 0, {}
        self.load_calls += 1
        for side, values in (("before", before), ("after", after)):
            sums = self.loads.setdefault(side, [0.0] * len(values))
            self.loads[side] = [s + float(v) for s, v in zip(sums, values)]

    def state_dict(self) -> dict[str, Any]:
        """The window's sums as plain numbers (a checkpoint taken between two logged records)."""
        return {
            "calls": self.calls,
            "imbalance_calls": self.imbalance_calls,
            "totals": dict(self.totals),
            "load_calls": self.load_calls,
            "loads": {side: list(values) for side, values in self.loads.items()},
            "vit_calls": self.vit_calls,
            "vit_max": self.vit_max,
            "vit_mean": self.vit_mean,
            "vit_per_rank": list(self.vit_per_rank),
            "cost_fits": self.cost_fits,
            "cost_error_calls": self.cost_error_calls,
            "cost_error": self.cost_error,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> _Window:
        """The window :meth:`state_dict` describes (``KeyError``, ``TypeError`` or ``ValueError``
        where it does not)."""
        window = cls()
        window.calls, window.imbalance_calls = _count(state["calls"]), _count(state["imbalance_calls"])
        saved = {str(name): float(value) for name, value in dict(state["totals"]).items()}
        # Figures another version sums: those it lacks start at 0, those this one lacks are left.
        window.totals = {name: saved.get(name, 0.0) for name in window.totals}
        window.load_calls = _count(state["load_calls"])
        loads = dict(state["loads"]).items()
        window.loads = {str(side): [float(v) for v in values] for side, values in loads}
        window.vit_calls = _count(state["vit_calls"])
        window.vit_max, window.vit_mean = float(state["vit_max"]), float(state["vit_mean"])
        window.vit_per_rank = [float(v) for v in state["vit_per_rank"]]
        # A window saved before the cost fit's figures were kept has none.
        window.cost_fits = int(state.get("cost_fits", -1))
        window.cost_error_calls = _count(state.get("cost_error_calls", 0))
        window.cost_error = float(state.get("cost_error", 0.0))
        window._check_sums()
        return window

    def _check_sums(self) -> None:
        """Raise ValueError where the sums could not come from :meth:`add` (a corrupted or edited
        checkpoint): the window's figures would divide by zero or take the max of nothing."""
        counts = (self.imbalance_calls, self.load_calls, self.vit_calls, self.cost_error_calls)
        series = [len(values) for values in self.loads.values()]
        if max(counts) > self.calls:
            raise ValueError(f"calls={self.calls} is fewer than the imbalance, load or vit calls {counts}")
        if (self.load_calls == 0 and any(series)) or len(set(series)) > 1:
            raise ValueError(f"load_calls={self.load_calls} does not match loads of {series} ranks")
        if self.cost_fits < -1 or not math.isfinite(self.cost_error) or self.cost_error < 0:
            raise ValueError(f"cost_fits={self.cost_fits}, cost_error={self.cost_error}: not a fit's figures")
        if (self.vit_calls > 0) != bool(self.vit_per_rank):
            raise ValueError(
                f"vit_calls={self.vit_calls} does not match vit_per_rank of {len(self.vit_per_rank)} ranks"
            )

    def _add_vit_ms(self, vit_ms: tuple[float, ...]) -> None:
        """Every rank's measured ViT milliseconds (of its previous call; -1 where none yet)."""
        known = [v for v in vit_ms if v >= 0]
        if not known or len(known) != len(vit_ms):
            return
        if len(self.vit_per_rank) != len(vit_ms):
            self.vit_calls, self.vit_max, self.vit_mean = 0, 0.0, 0.0
            self.vit_per_rank = [0.0] * len(vit_ms)
        self.vit_calls += 1
        self.vit_max += max(known)
        self.vit_mean += sum(known) / len(known)
        self.vit_per_rank = [total + value for total, value in zip(self.vit_per_rank, vit_ms)]

    def _add_cost_fit(self, fits: int, error: float) -> None:
        """The online cost fit's figures of one call (``fits`` -1 where it does not fit online). The
        most fits: one balancer's count only grows, and of several (a teacher's and a student's),
        the record tells how far the furthest got."""
        self.cost_fits = max(self.cost_fits, fits)
        if math.isfinite(error):
            self.cost_error_calls += 1
            self.cost_error += error

    def _cost_fit_metrics(self) -> dict[str, float]:
        metrics = {}
        if self.cost_fits >= 0:
            metrics[PREFIX + "cost_fits"] = float(self.cost_fits)
        if self.cost_error_calls:
            metrics[PREFIX + "cost_fit_error"] = self.cost_error / self.cost_error_calls
        return metrics

    def _vit_metrics(self, per_rank: bool) -> dict[str, float]:
        if self.vit_calls == 0:
            return {}
        # The rank whose calls took longest in all (ties: the lowest): one key at any DP size.
        slowest = max(range(len(self.vit_per_rank)), key=self.vit_per_rank.__getitem__)
        metrics = {
            PREFIX + "vit_ms_max": self.vit_max / self.vit_calls,
            PREFIX + "vit_ms_mean": self.vit_mean / self.vit_calls,
            PREFIX + "vit_ms_slowest_rank": float(slowest),
        }
        if per_rank:
            for r, total in enumerate(self.vit_per_rank):
                metrics[f"{PREFIX}vit_ms/rank_{r}"] = total / self.vit_calls
        return metrics

    def metrics(self) -> dict[str, float]:
        """The window's metrics (without the cumulative counts); empty without calls."""
        if self.calls == 0:
            return {}
        metrics = {
            PREFIX + "calls": float(self.calls),
            PREFIX + "applied": self.totals["applied"] / self.calls,
        }
        if self.imbalance_calls:
            for name in ("imbalance_before", "imbalance_after"):
                metrics[PREFIX + name] = self.totals[name] / self.imbalance_calls
        for side in ("before", "after"):
            for r, total in enumerate(self.loads.get(side, ())):
                metrics[f"{PREFIX}load_{side}/rank_{r}"] = total / self.load_calls
        for name in _SUMS:
            if name == "total_patches":  # logged in its place as the moved fraction's denominator
                patches, moved = self.totals[name], self.totals["moved_patches"]
                metrics[PREFIX + "moved_patch_fraction"] = moved / patches if patches > 0 else 0.0
            else:
                metrics[PREFIX + name] = self.totals[name]
        metrics.update(self._vit_metrics(per_rank=bool(self.loads)))
        metrics.update(self._cost_fit_metrics())
        return metrics


class BalanceMetrics:
    """The ``vit_balance/*`` metrics of balanced calls: a window of calls, and counts since the start.

    :meth:`add` each call's :class:`~lightning_vit_balance.BalanceStats` (on every rank: plans and
    loads are the same on each, only ``bytes_sent`` and ``bytes_received`` are the rank's own);
    :meth:`metrics` gives the window's figures with the cumulative counts, keyed as
    :class:`~lightning_vit_balance.ViTBalanceCallback` documents them, and :meth:`reset_window`
    starts the next window. The counts (:meth:`state_dict`) belong in checkpoints, so a resumed
    run counts on.

    Args:
        per_rank_loads: Include the ``load_before/rank_{r}``, ``load_after/rank_{r}`` and
            ``vit_ms/rank_{r}`` series, three per DP rank. ``None`` (default): up to
            :data:`PER_RANK_SERIES_UP_TO` DP ranks, not beyond.
    """

    def __init__(self, per_rank_loads: bool | None = None) -> None:
        self.per_rank_loads = require_flag("BalanceMetrics", "per_rank_loads", per_rank_loads, optional=True)
        self.applied_total = 0
        self.calls_total = 0
        self.skipped_total: dict[str, int] = dict.fromkeys(SKIP_REASONS, 0)
        self._window = _Window()

    @property
    def window_calls(self) -> int:
        """Calls added since the window started."""
        return self._window.calls

    def add(self, stats: BalanceStats) -> None:
        """Count one balanced call, in the window and since the start."""
        if stats is None or not hasattr(stats, "applied"):
            hint = " (a balancer's last_stats is None until its first call)" if stats is None else ""
            raise TypeError(f"BalanceMetrics.add(stats={stats!r}) is invalid: expected a BalanceStats{hint}.")
        self.calls_total += 1
        if stats.applied:
            self.applied_total += 1
        else:
            self.skipped_total[stats.reason] = self.skipped_total.get(stats.reason, 0) + 1
        self._window.add(stats, self.per_rank_loads)

    def window_metrics(self) -> dict[str, float]:
        """The window's figures, without the cumulative counts; empty when it has no calls."""
        return self._window.metrics()

    def total_metrics(self) -> dict[str, float]:
        """``vit_balance/applied_total``, ``calls_total`` and ``skipped/{reason}`` since the start."""
        metrics = {
            PREFIX + "applied_total": float(self.applied_total),
            PREFIX + "calls_total": float(self.calls_total),
        }
        for reason in sorted(self.skipped_total):
            metrics[f"{PREFIX}skipped/{reason}"] = float(self.skipped_total[reason])
        return metrics

    def metrics(self) -> dict[str, float]:
        """The window's figures and the cumulative counts; empty when the window has no calls."""
        window = self.window_metrics()
        return {**window, **self.total_metrics()} if window else {}

    def reset_window(self) -> None:
        """Start a new window (the counts since the start go on)."""
        self._window = _Window()

    def state_dict(self) -> dict[str, Any]:
        """The counts since the start, as plain ints, and the window's sums, plain numbers (what a
        checkpoint keeps: a run resumed between two logged records logs the calls before the
        checkpoint in its first record, as the run would have)."""
        return {
            "applied_total": self.applied_total,
            "calls_total": self.calls_total,
            "skipped_total": dict(sorted(self.skipped_total.items())),
            "window": self._window.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Go on counting from :meth:`state_dict`'s counts, and go on with its window (a state
        saved before windows were kept starts an empty one).

        Raises:
            ValueError: If ``state_dict`` lacks a count or holds one that is not a whole number, or
                holds a window that is not one :meth:`state_dict` gives.
        """
        try:
            applied = _count(state_dict["applied_total"])
            calls = _count(state_dict["calls_total"])
            skipped = {str(k): _count(v) for k, v in dict(state_dict["skipped_total"]).items()}
            saved = state_dict.get("window")
            window = _Window() if saved is None else _Window.from_state(saved)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"BalanceMetrics.load_state_dict(state_dict={state_dict!r}) is invalid: expected the "
                f"counts and window of BalanceMetrics.state_dict() ({error})."
            ) from None
        self.applied_total, self.calls_total = applied, calls
        self.skipped_total = dict.fromkeys(SKIP_REASONS, 0)
        self.skipped_total.update(skipped)
        self._window = window


def _count(value: Any) -> int:
    """A count read back from a checkpoint (JSON or torch): a whole number >= 0."""
    if isinstance(value, bool) or float(value) != int(value) or int(value) < 0:
        raise ValueError(f"{value!r} is not a count")
    return int(value)
