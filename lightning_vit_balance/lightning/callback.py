"""ViTBalanceCallback: the balancer's per-call diagnostics as metrics on the Trainer's loggers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics import MeanMetric, Metric, SumMetric

from lightning_vit_balance.planning import REASONS

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["ViTBalanceCallback"]

_PREFIX = "vit_balance/"
#: Every reason a call can be skipped for, logged as ``vit_balance/skipped/{reason}``.
_SKIP_REASONS: tuple[str, ...] = tuple(reason for reason in REASONS if reason != "applied")


class _ElementwiseMean(Metric):
    """Mean of equally sized vectors (the load of every rank, one vector per call)."""

    full_state_update = False

    def __init__(self, size: int) -> None:
        # The loads are identical on every DP rank: nothing to synchronise.
        super().__init__(sync_on_compute=False)
        self.add_state("total", default=torch.zeros(size, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: Sequence[float]) -> None:
        self.total += torch.as_tensor(values, dtype=torch.float64)
        self.count += 1

    def compute(self) -> torch.Tensor:
        return self.total / self.count


class ViTBalanceCallback(Callback):
    r"""Logs how ViT work was balanced across data-parallel ranks, per optimizer step.

    Reads the :class:`~lightning_vit_balance.BalanceStats` that
    :meth:`ViTBalanceMixin.encode_images <lightning_vit_balance.ViTBalanceMixin.encode_images>`
    records for every call during training (several per step with images and videos, or gradient
    accumulation), aggregates the calls of a step with torchmetrics and logs them through every
    logger of the Trainer (CSV, TensorBoard, W&B...) on global rank 0. Only metrics are logged:
    nothing here changes training. Calls made outside training batches (validation, test,
    predict) are not logged.

    Example::

        model = MyVLM(vit_balance_config=ViTBalanceConfig(verbose=True))  # uses ViTBalanceMixin
        trainer = Trainer(strategy="ddp", devices=8, callbacks=[ViTBalanceCallback(prog_bar=True)])
        trainer.fit(model)

    With ``verbose=True`` in the module's ``vit_balance_config`` (the seed's
    ``--dp-balance-verbose``), DP rank 0 also prints the seed's report for every call: APPLY or
    SKIP with the reason, the imbalance, the load of every rank before and after, and the
    cumulative applied/total count. The balancer prints it, at the call, so it appears with or
    without this callback.

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
        ``vit_balance/bytes_sent``                  bytes global rank 0 sent, both trips, summed
        ``vit_balance/bytes_received``              bytes global rank 0 received, both trips, summed
        ``vit_balance/plan_ms``                     milliseconds spent gathering sizes and planning
        ``vit_balance/exchange_ms``                 milliseconds spent moving tensors
        ``vit_balance/collectives``                 collective operations issued, summed
        ``vit_balance/applied_total``               calls that moved images since the fit started
        ``vit_balance/calls_total``                 calls since the fit started
        ``vit_balance/skipped/{reason}``            calls skipped for ``reason`` since the fit
                                                    started, one key for every reason of
                                                    :data:`~lightning_vit_balance.REASONS` but
                                                    ``applied``
        ==========================================  ==================================================

        ``applied_total + sum(skipped/*) == calls_total``. A step without ViT calls logs nothing.
        The cumulative counts are saved in checkpoints and resume with them.

    Args:
        log_every_n_steps: Log every this many optimizer steps; ``None`` follows the Trainer's
            ``log_every_n_steps``; ``0`` never logs.
        log_per_rank_loads: Log the ``load_before/rank_{r}`` and ``load_after/rank_{r}`` series,
            two per DP rank: turn off at large DP sizes.
        prog_bar: Show ``vit_balance/imbalance_before`` and ``vit_balance/imbalance_after`` of the
            latest step in the progress bar.
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
        self.applied_total = 0
        self.calls_total = 0
        self.skipped_total: dict[str, int] = dict.fromkeys(_SKIP_REASONS, 0)
        self._warned_no_mixin = False
        self._step_imbalance: list[tuple[float, float]] = []
        self._reset_window()

    def _reset_window(self) -> None:
        # float64: byte and patch sums pass 2**24, where float32 stops counting exactly. No sync:
        # plans and loads are the same on every DP rank, and only global rank 0 logs.
        def mean() -> Metric:
            return MeanMetric(sync_on_compute=False).set_dtype(torch.float64)

        def total() -> Metric:
            return SumMetric(sync_on_compute=False).set_dtype(torch.float64)

        self._window_calls = 0
        self._means: dict[str, Metric] = {
            name: mean() for name in ("applied", "imbalance_before", "imbalance_after")
        }
        self._sums: dict[str, Metric] = {
            name: total()
            for name in (
                "moved_images",
                "moved_patches",
                "total_patches",
                "bytes_sent",
                "bytes_received",
                "plan_ms",
                "exchange_ms",
                "collectives",
            )
        }
        self._loads: dict[str, _ElementwiseMean] = {}

    # ------------------------------------------------------------------ draining the module

    def _drain(self, pl_module: LightningModule) -> list[Any]:
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

    def _add(self, stats: Any) -> None:
        self.calls_total += 1
        if stats.applied:
            self.applied_total += 1
        else:
            self.skipped_total[stats.reason] = self.skipped_total.get(stats.reason, 0) + 1

        self._window_calls += 1
        self._step_imbalance.append((float(stats.imbalance_before), float(stats.imbalance_after)))
        self._means["applied"].update(1.0 if stats.applied else 0.0)
        self._means["imbalance_before"].update(float(stats.imbalance_before))
        self._means["imbalance_after"].update(float(stats.imbalance_after))
        for name in ("moved_images", "moved_patches", "total_patches", "bytes_sent", "bytes_received"):
            self._sums[name].update(float(getattr(stats, name)))
        self._sums["plan_ms"].update(1000.0 * float(stats.plan_seconds))
        self._sums["exchange_ms"].update(1000.0 * float(stats.exchange_seconds))
        self._sums["collectives"].update(float(stats.collectives))
        if self.log_per_rank_loads:
            for side in ("before", "after"):
                values = tuple(getattr(stats, f"loads_{side}"))
                metric = self._loads.get(side)
                if metric is None or metric.total.numel() != len(values):
                    # A new DP size starts a fresh series.
                    metric = self._loads[side] = _ElementwiseMean(len(values))
                metric.update(values)

    # ------------------------------------------------------------------ metrics

    def window_metrics(self) -> dict[str, float]:
        """The metrics of the calls since the last logged step, as the loggers receive them.

        Returns an empty dict when no call was recorded since then.
        """
        if self._window_calls == 0:
            return {}
        metrics: dict[str, float] = {_PREFIX + "calls": float(self._window_calls)}
        for name, metric in self._means.items():
            metrics[_PREFIX + name] = float(metric.compute())
        if self.log_per_rank_loads:
            for side in ("before", "after"):
                if side in self._loads:
                    for r, value in enumerate(self._loads[side].compute().tolist()):
                        metrics[f"{_PREFIX}load_{side}/rank_{r}"] = float(value)
        sums = {name: float(metric.compute()) for name, metric in self._sums.items()}
        metrics[_PREFIX + "moved_images"] = sums["moved_images"]
        metrics[_PREFIX + "moved_patches"] = sums["moved_patches"]
        total = sums["total_patches"]
        metrics[_PREFIX + "moved_patch_fraction"] = sums["moved_patches"] / total if total > 0 else 0.0
        for name in ("bytes_sent", "bytes_received", "plan_ms", "exchange_ms", "collectives"):
            metrics[_PREFIX + name] = sums[name]
        metrics[_PREFIX + "applied_total"] = float(self.applied_total)
        metrics[_PREFIX + "calls_total"] = float(self.calls_total)
        for reason in sorted(self.skipped_total):
            metrics[f"{_PREFIX}skipped/{reason}"] = float(self.skipped_total[reason])
        return metrics

    def _should_log(self, trainer: Trainer, step: int) -> bool:
        every = trainer.log_every_n_steps if self.log_every_n_steps is None else self.log_every_n_steps
        if every <= 0:
            return False
        # Same rule as the Trainer's own step logging: steps are counted from 1.
        return (step + 1) % every == 0 or trainer.should_stop

    # ------------------------------------------------------------------ hooks

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self.applied_total = 0
            self.calls_total = 0
            self.skipped_total = dict.fromkeys(_SKIP_REASONS, 0)
            self._step_imbalance = []
            self._reset_window()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Calls made outside a training batch (validation, sanity check) are not training steps.
        self._drain(pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for stats in self._drain(pl_module):
            self._add(stats)
        if trainer.fit_loop._should_accumulate() and pl_module.automatic_optimization:
            return
        # The optimizer step is over.
        if self.prog_bar and self._step_imbalance:
            count = len(self._step_imbalance)
            before = sum(b for b, _ in self._step_imbalance) / count
            after = sum(a for _, a in self._step_imbalance) / count
            pl_module.log(_PREFIX + "imbalance_before", before, prog_bar=True, logger=False, on_step=True)
            pl_module.log(_PREFIX + "imbalance_after", after, prog_bar=True, logger=False, on_step=True)
        self._step_imbalance = []
        # The step every `self.log` value of this batch is logged at (not yet advanced here).
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        if not self._should_log(trainer, step):
            return
        metrics = self.window_metrics()
        self._reset_window()
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._drain(pl_module)

    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._drain(pl_module)

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._drain(pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {
            "applied_total": self.applied_total,
            "calls_total": self.calls_total,
            "skipped_total": dict(sorted(self.skipped_total.items())),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.applied_total = int(state_dict["applied_total"])
        self.calls_total = int(state_dict["calls_total"])
        self.skipped_total = dict.fromkeys(_SKIP_REASONS, 0)
        self.skipped_total.update({str(k): int(v) for k, v in state_dict["skipped_total"].items()})
