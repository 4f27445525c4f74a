"""ViTBalanceCallback: the balancer's per-call diagnostics as metrics on the Trainer's loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_vit_balance.planning import REASONS

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from lightning_vit_balance.balancer import BalanceStats

__all__ = ["ViTBalanceCallback"]

_PREFIX = "vit_balance/"
#: Every reason a call can be skipped for, logged as ``vit_balance/skipped/{reason}``.
_SKIP_REASONS: tuple[str, ...] = tuple(reason for reason in REASONS if reason != "applied")
#: Per-call figures averaged over the calls of a record.
_MEANS: tuple[str, ...] = ("applied", "imbalance_before", "imbalance_after")
#: Per-call figures summed over the calls of a record.
_SUMS: tuple[str, ...] = (
    "moved_images",
    "moved_patches",
    "total_patches",
    "bytes_sent",
    "bytes_received",
    "plan_ms",
    "exchange_ms",
    "collectives",
)


def _call_figures(stats: BalanceStats) -> dict[str, float]:
    """The figures of one call that a record averages (:data:`_MEANS`) or sums (:data:`_SUMS`)."""
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
        "collectives": float(stats.collectives),
    }


class _Window:
    """The calls of a span of optimizer steps: one step, or the steps since the last logged one.

    Python floats are float64: byte and patch sums pass 2**24, where float32 stops counting
    exactly. Nothing is synchronised: plans and loads are the same on every DP rank.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.totals: dict[str, float] = dict.fromkeys(_MEANS + _SUMS, 0.0)
        self.load_calls = 0
        self.loads: dict[str, list[float]] = {}
        self.vit_calls = 0
        self.vit_max = 0.0
        self.vit_mean = 0.0
        self.vit_per_rank: list[list[float]] = []

    def add(self, stats: BalanceStats, per_rank_loads: bool) -> None:
        self.calls += 1
        for name, value in _call_figures(stats).items():
            self.totals[name] += value
        self._add_vit_ms(tuple(getattr(stats, "vit_ms", ())))
        if not per_rank_loads:
            return
        before, after = tuple(stats.loads_before), tuple(stats.loads_after)
        if len(before) != len(self.loads.get("before", before)):
            # A new DP size starts a fresh series.
            self.load_calls, self.loads = 0, {}
        self.load_calls += 1
        for side, values in (("before", before), ("after", after)):
            sums = self.loads.setdefault(side, [0.0] * len(values))
            self.loads[side] = [s + float(v) for s, v in zip(sums, values)]

    def _add_vit_ms(self, vit_ms: tuple[float, ...]) -> None:
        """Every rank's measured ViT milliseconds (of its previous call; -1 where none yet)."""
        known = [v for v in vit_ms if v >= 0]
        if not known or len(known) != len(vit_ms):
            return
        if len(self.vit_per_rank) != len(vit_ms):
            self.vit_calls, self.vit_max, self.vit_mean = 0, 0.0, 0.0
            self.vit_per_rank = [[0.0, 0.0] for _ in vit_ms]
        self.vit_calls += 1
        self.vit_max += max(known)
        self.vit_mean += sum(known) / len(known)
        for total, value in zip(self.vit_per_rank, vit_ms):
            total[0] += value

    def _vit_metrics(self, per_rank: bool) -> dict[str, float]:
        if self.vit_calls == 0:
            return {}
        metrics = {
            _PREFIX + "vit_ms_max": self.vit_max / self.vit_calls,
            _PREFIX + "vit_ms_mean": self.vit_mean / self.vit_calls,
        }
        if per_rank:
            for r, (total, _) in enumerate(self.vit_per_rank):
                metrics[f"{_PREFIX}vit_ms/rank_{r}"] = total / self.vit_calls
        return metrics

    def metrics(self) -> dict[str, float]:
        """The record's metrics (without the cumulative counts); empty without calls."""
        if self.calls == 0:
            return {}
        metrics = {_PREFIX + "calls": float(self.calls)}
        metrics.update({_PREFIX + name: self.totals[name] / self.calls for name in _MEANS})
        for side in ("before", "after"):
            for r, total in enumerate(self.loads.get(side, ())):
                metrics[f"{_PREFIX}load_{side}/rank_{r}"] = total / self.load_calls
        patches = self.totals["total_patches"]
        for name in ("moved_images", "moved_patches"):
            metrics[_PREFIX + name] = self.totals[name]
        moved = self.totals["moved_patches"]
        metrics[_PREFIX + "moved_patch_fraction"] = moved / patches if patches > 0 else 0.0
        for name in ("bytes_sent", "bytes_received", "plan_ms", "exchange_ms", "collectives"):
            metrics[_PREFIX + name] = self.totals[name]
        metrics.update(self._vit_metrics(per_rank=bool(self.loads)))
        return metrics


class ViTBalanceCallback(Callback):
    r"""Logs how ViT work was balanced across data-parallel ranks, per optimizer step.

    Reads the :class:`~lightning_vit_balance.BalanceStats` that
    :meth:`ViTBalanceMixin.encode_images <lightning_vit_balance.ViTBalanceMixin.encode_images>`
    (and ``encode_visual``, and the Hugging Face model balanced by ``balance_vision_tower``: one
    call per forward) records for every call during training (several per step with images and
    videos, or gradient accumulation), aggregates the calls of each step and logs them through
    every logger of the Trainer (CSV, TensorBoard, W&B...) at the Trainer's logging cadence. Only
    metrics are logged: nothing here changes training. Calls made outside training batches
    (validation, test, predict) are not logged.

    Every optimizer step's values also go to ``trainer.callback_metrics`` on every rank, as
    ``self.log(..., on_step=True)`` would put them, so other callbacks can watch them::

        ModelCheckpoint(monitor="vit_balance/imbalance_after", mode="min")
        EarlyStopping(monitor="vit_balance/imbalance_after", mode="min", check_on_train_epoch_end=True)

    Example::

        model = MyVLM(vit_balance_config=ViTBalanceConfig(verbose=True))  # uses ViTBalanceMixin
        trainer = Trainer(strategy="ddp", devices=8, callbacks=[ViTBalanceCallback(prog_bar=True)])
        trainer.fit(model)

    With ``verbose=True`` in the module's ``vit_balance_config`` (the seed's
    ``--dp-balance-verbose``), DP rank 0 also reports every call: APPLY or SKIP with the reason,
    the imbalance, the load of every rank before and after, and the cumulative applied/total
    count. The balancer reports it, at the call, so it appears with or without this callback.

    Logged Metrics:
        Values aggregate the calls since the previous logged step: one optimizer step when
        logging every step. "Load" is the cost model's estimate (``l**2`` by default).

        ==========================================  ==================================================
        Key                                         Value
        ==========================================  ==================================================
        ``vit_balance/calls``                       ViT calls aggregated in this record
        ``vit_balance/applied``                     fraction of those calls that moved images (1 or
                                                    0 with one call per step)
        ``vit_balance/imbalance_before``            mean of ``max(load) / mean(load) - 1`` over ranks,
                                                    every image on its own rank
        ``vit_balance/imbalance_after``             the same after balancing (equal when skipped)
        ``vit_balance/load_before/rank_{r}``        mean load of DP rank ``r`` before balancing
                                                    (only with ``log_per_rank_loads``)
        ``vit_balance/load_after/rank_{r}``         mean load of DP rank ``r`` after balancing
        ``vit_balance/moved_images``                images encoded away from their rank, summed
        ``vit_balance/moved_patches``               patches (pixel rows) sent to another rank, summed
        ``vit_balance/moved_patch_fraction``        moved patches / all patches of these calls
        ``vit_balance/bytes_sent``                  bytes this rank sent, both trips, summed (the
                                                    loggers get global rank 0's)
        ``vit_balance/bytes_received``              bytes this rank received, both trips, summed
        ``vit_balance/plan_ms``                     milliseconds spent gathering sizes and planning
        ``vit_balance/exchange_ms``                 milliseconds spent moving tensors
        ``vit_balance/collectives``                 collective operations issued, summed
        ``vit_balance/vit_ms/rank_{r}``             measured milliseconds of DP rank ``r``'s ViT
                                                    forward (only with ``log_per_rank_loads``)
        ``vit_balance/vit_ms_max``                  the slowest rank's ViT milliseconds: the
                                                    straggler itself
        ``vit_balance/vit_ms_mean``                 the mean over ranks (``max / mean - 1`` is the
                                                    measured imbalance)
        ``vit_balance/applied_total``               calls that moved images since the fit started
        ``vit_balance/calls_total``                 calls since the fit started
        ``vit_balance/skipped/{reason}``            calls skipped for ``reason`` since the fit
                                                    started, one key for every reason of
                                                    :data:`~lightning_vit_balance.REASONS` but
                                                    ``applied``
        ==========================================  ==================================================

        ``applied_total + sum(skipped/*) == calls_total``. A step without ViT calls logs nothing.
        The ``vit_ms`` series are measured, not modelled: each balanced call carries every rank's
        host-timed ViT forward of its previous call in the metadata gather it makes anyway, so
        they trail by one call and cost no collective (CUDA timings are host launch times: see
        the README).
        The cumulative counts are saved in checkpoints and resume with them.

    Args:
        log_every_n_steps: ``None`` (default) logs at the Trainer's own cadence (its
            ``log_every_n_steps``, and the last step). An int logs every this many optimizer steps
            under the same rule, for this callback only (e.g. less often than the rest at large
            DP sizes); ``0`` never logs (``callback_metrics`` and the progress bar still get every
            step's values, and no logger is needed).
        log_per_rank_loads: Log the ``load_before/rank_{r}`` and ``load_after/rank_{r}`` series,
            two per DP rank: turn off at large DP sizes.
        prog_bar: Show ``vit_balance/imbalance_before`` and ``vit_balance/imbalance_after`` of the
            latest step in the progress bar.

    Raises:
        ValueError: If ``log_every_n_steps`` is neither ``None`` nor an int ``>= 0``.
        MisconfigurationException: At the start of a fit whose Trainer has no logger (unless
            ``log_every_n_steps=0``).
    """

    def __init__(
        self, log_every_n_steps: int | None = None, log_per_rank_loads: bool = True, prog_bar: bool = False
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 0
        ):
            raise ValueError(
                f"ViTBalanceCallback(log_every_n_steps={log_every_n_steps!r}) is invalid: expected None "
                f"or an int >= 0."
            )
        self.log_every_n_steps = log_every_n_steps
        self.log_per_rank_loads = bool(log_per_rank_loads)
        self.prog_bar = bool(prog_bar)
        self._warned_no_mixin = False
        self._reset_totals()

    def _reset_totals(self) -> None:
        self.applied_total = 0
        self.calls_total = 0
        self.skipped_total: dict[str, int] = dict.fromkeys(_SKIP_REASONS, 0)
        self._step = _Window()
        self._interval = _Window()

    # ------------------------------------------------------------------ draining the module

    def _drain(self, pl_module: LightningModule) -> list[BalanceStats]:
        pop = getattr(pl_module, "pop_vit_balance_stats", None)
        if pop is None:
            if not self._warned_no_mixin:
                rank_zero_warn(
                    f"ViTBalanceCallback: {type(pl_module).__name__} does not use ViTBalanceMixin "
                    f"(no pop_vit_balance_stats method), so there is nothing to log."
                )
                self._warned_no_mixin = True
            return []
        return list(pop())

    def _add(self, stats: BalanceStats) -> None:
        self.calls_total += 1
        if stats.applied:
            self.applied_total += 1
        else:
            self.skipped_total[stats.reason] = self.skipped_total.get(stats.reason, 0) + 1
        self._step.add(stats, self.log_per_rank_loads)
        self._interval.add(stats, self.log_per_rank_loads)

    # ------------------------------------------------------------------ metrics

    def _with_totals(self, metrics: dict[str, float]) -> dict[str, float]:
        if not metrics:
            return {}
        metrics[_PREFIX + "applied_total"] = float(self.applied_total)
        metrics[_PREFIX + "calls_total"] = float(self.calls_total)
        for reason in sorted(self.skipped_total):
            metrics[f"{_PREFIX}skipped/{reason}"] = float(self.skipped_total[reason])
        return metrics

    def window_metrics(self) -> dict[str, float]:
        """The metrics of the calls since the last logged step, as the loggers receive them.

        Returns an empty dict when no call was recorded since then.
        """
        return self._with_totals(self._interval.metrics())

    def _should_log(self, trainer: Trainer) -> bool:
        if self.log_every_n_steps is None:
            return trainer._logger_connector.should_update_logs
        if self.log_every_n_steps == 0:
            return False
        # The Trainer's rule (`_LoggerConnector.should_update_logs`) at this callback's interval;
        # the step counter advances after this hook, hence `+ 1`.
        step = trainer.fit_loop.epoch_loop._batches_that_stepped + 1
        return step % self.log_every_n_steps == 0 or trainer.should_stop

    def _publish_step(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Put the finished step's values in ``callback_metrics`` (and the progress bar)."""
        metrics = self._with_totals(self._step.metrics())
        self._step = _Window()
        if not metrics:
            return
        # CPU float64 scalars: exact counts, and no device copy per metric and step. Monitors
        # (ModelCheckpoint, EarlyStopping) compare them on any device.
        values = torch.tensor(list(metrics.values()), dtype=torch.float64)
        trainer.callback_metrics.update(zip(metrics, values.unbind()))
        if self.prog_bar:
            for key in (_PREFIX + "imbalance_before", _PREFIX + "imbalance_after"):
                pl_module.log(key, metrics[key], prog_bar=True, logger=False, on_step=True)

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers and self.log_every_n_steps != 0:
            raise MisconfigurationException(
                "Cannot use ViTBalanceCallback with a Trainer that has no logger (Trainer(logger=False)): "
                "it logs through the Trainer's loggers. Pass a logger, or "
                "ViTBalanceCallback(log_every_n_steps=0) to only feed callback_metrics and the progress bar."
            )
        # A checkpoint being resumed restores the totals after this hook (`load_state_dict`).
        self._reset_totals()

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Calls made outside a training batch (validation, sanity check) are not training steps.
        self._drain(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for stats in self._drain(pl_module):
            self._add(stats)
        if trainer.fit_loop._should_accumulate() and pl_module.automatic_optimization:
            return
        # The optimizer step is over.
        self._publish_step(trainer, pl_module)
        if not self._should_log(trainer):
            return
        metrics = self.window_metrics()
        self._interval = _Window()
        if metrics:
            # The step every `self.log` value of this batch is logged at (not yet advanced here).
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            trainer._logger_connector.log_metrics(metrics, step=step)

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._drain(pl_module)

    @override
    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._drain(pl_module)

    @override
    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._drain(pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "applied_total": self.applied_total,
            "calls_total": self.calls_total,
            "skipped_total": dict(sorted(self.skipped_total.items())),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.applied_total = int(state_dict["applied_total"])
        self.calls_total = int(state_dict["calls_total"])
        self.skipped_total = dict.fromkeys(_SKIP_REASONS, 0)
        self.skipped_total.update({str(k): int(v) for k, v in state_dict["skipped_total"].items()})
