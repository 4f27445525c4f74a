"""ViTBalanceCallback: the balancer's per-call diagnostics as metrics on the Trainer's loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_vit_balance.config import require_flag
from lightning_vit_balance.metrics import PREFIX, BalanceMetrics

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from lightning_vit_balance.balancer import BalanceStats

__all__ = ["ViTBalanceCallback"]


#: Optimizer steps after which a fit whose steps made no balanced call is told so (a text-only
#: first step is no reason to warn; a whole epoch may be hours).
NO_CALLS_TOLD_AFTER_STEPS = 10


def _under(loop: str, metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` keyed under an evaluation loop's name: ``vit_balance/val/calls``..."""
    return {f"{PREFIX}{loop}/{key.removeprefix(PREFIX)}": value for key, value in metrics.items()}


def _switched_off(pl_module: LightningModule) -> bool:
    """Whether the module's ``vit_balance_config`` (which its drop-in towers balance with too, where
    it is set) says ``enabled=False``."""
    resolve = getattr(pl_module, "resolved_vit_balance_config", None)
    if resolve is None or getattr(pl_module, "vit_balance_config", None) is None:
        return False  # the default, or the towers' own defaults: enabled
    return not resolve().enabled


class ViTBalanceCallback(Callback):
    r"""Logs how ViT work was balanced across data-parallel ranks, per optimizer step.

    Reads the :class:`~lightning_vit_balance.BalanceStats` that
    :meth:`ViTBalanceMixin.encode_images <lightning_vit_balance.ViTBalanceMixin.encode_images>`
    (and ``encode_visual``, and the Hugging Face model balanced by ``balance_vision_tower``: one
    call per forward) records for every call during training (several per step with images and
    videos, or gradient accumulation), aggregates the calls of each step and logs them through
    every logger of the Trainer (CSV, TensorBoard, W&B...) at the Trainer's logging cadence. Only
    metrics are logged: nothing here changes training. Balanced calls of a validation or test loop
    (not its sanity check) are logged once per loop, where Lightning logs the loop's
    ``on_epoch`` values: the same keys under ``vit_balance/val/`` and ``vit_balance/test/``
    (``vit_balance/val/vit_ms_max``), aggregating every call of the loop, with ``calls_total`` and
    ``skipped/{reason}`` counting that loop's calls. Lightning's predict loop logs nothing: a
    predict run's figures (the same keys under ``vit_balance/predict/``) are
    :attr:`last_predict_metrics`, and rank 0 prints a line of them at its end.

    Every optimizer step's values also go to ``trainer.callback_metrics`` on every rank, as
    ``self.log(..., on_step=True)`` would put them (and each evaluation loop's at its end), so
    other callbacks can watch them::

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
                                                    (with ``log_per_rank_loads``: by default up to
                                                    64 DP ranks)
        ``vit_balance/load_after/rank_{r}``         mean load of DP rank ``r`` after balancing
        ``vit_balance/moved_images``                images encoded away from their rank, summed
        ``vit_balance/moved_patches``               patches (pixel rows) sent to another rank, summed
        ``vit_balance/moved_patch_fraction``        moved patches / all patches of these calls
        ``vit_balance/bytes_sent``                  bytes this rank sent, both trips, summed (the
                                                    loggers get global rank 0's)
        ``vit_balance/bytes_received``              bytes this rank received, both trips, summed
        ``vit_balance/plan_ms``                     milliseconds planning inside the calls (a plan
                                                    made before its call counts in ``prepare_ms``)
        ``vit_balance/exchange_ms``                 milliseconds in the calls' collectives: the size
                                                    gather, both trips and the status gather,
                                                    packing included
        ``vit_balance/prepare_ms``                  milliseconds making plans before their calls
                                                    (``plan_ahead``, ``prepare``, the drop-in's
                                                    collator): the size gather and the planning
        ``vit_balance/trip_ms``                     milliseconds in this rank's trips, forward and
                                                    backward, packing included: on CUDA the
                                                    device's time (events, a call late), where
                                                    ``exchange_ms`` is the host's; without the
                                                    status gather's wait for the slowest ViT
        ``vit_balance/collectives``                 collective operations issued, summed
        ``vit_balance/vit_ms/rank_{r}``             measured milliseconds of DP rank ``r``'s ViT
                                                    forward (only with ``log_per_rank_loads``)
        ``vit_balance/vit_ms_max``                  the slowest rank's ViT milliseconds: the
                                                    straggler itself
        ``vit_balance/vit_ms_mean``                 the mean over ranks (``max / mean - 1`` is the
                                                    measured imbalance)
        ``vit_balance/vit_ms_slowest_rank``         the DP rank whose ViT took longest over the
                                                    record's calls: a rank slow step after step
                                                    is a slow device, which balancing by cost
                                                    cannot see
        ``vit_balance/cost_fits``                   with ``calibrate_cost``: the online cost
                                                    fit's successful fits so far (0: still the
                                                    configuration's model)
        ``vit_balance/cost_fit_error``              with ``calibrate_cost``, once fitted: the
                                                    fitted model's median relative error on the
                                                    ranks' measured ViT times, before it refits
                                                    on them (0.05: within 5%), mean over calls
        ``vit_balance/applied_total``               calls that moved images since the fit started
        ``vit_balance/calls_total``                 calls since the fit started
        ``vit_balance/skipped/{reason}``            calls skipped for ``reason`` since the fit
                                                    started, one key for every reason of
                                                    :data:`~lightning_vit_balance.REASONS` but
                                                    ``applied``
        ==========================================  ==================================================

        ``applied_total + sum(skipped/*) == calls_total``. A step without ViT calls logs nothing.
        The ``vit_ms`` series are measured, not modelled: each balanced call carries every rank's
        ViT forward time of its previous call (a host timer on CPU; CUDA events on a GPU, read a
        call later) in the metadata gather it makes anyway, so they trail by one call and cost no
        collective (see the README).
        The cumulative counts are saved in checkpoints and resume with them.

    Args:
        log_every_n_steps: ``None`` (default) logs at the Trainer's own cadence (its
            ``log_every_n_steps``, and the step where a fit stops early). An int logs every this
            many optimizer steps under the same rule, for this callback only (e.g. less often than
            the rest at large DP sizes); ``0`` never logs (``callback_metrics`` and the progress
            bar still get every step's values, and no logger is needed). As with ``self.log``, the
            steps after the last logged one of a fit that ends between two (``max_steps``) are not
            logged; the cumulative counts, checkpointed, include them.
        log_per_rank_loads: Log the ``load_before/rank_{r}``, ``load_after/rank_{r}`` and
            ``vit_ms/rank_{r}`` series, three per DP rank. ``None`` (default): up to 64 DP ranks
            (:data:`~lightning_vit_balance.metrics.PER_RANK_SERIES_UP_TO`), not beyond, where the
            summaries stand for them.
        prog_bar: Show ``vit_balance/imbalance_before`` and ``vit_balance/imbalance_after`` of the
            latest step in the progress bar.

    Raises:
        ValueError: If ``log_every_n_steps`` is neither ``None`` nor an int ``>= 0``.
        MisconfigurationException: At the start of a fit whose Trainer has no logger (unless
            ``log_every_n_steps=0``).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        log_per_rank_loads: bool | None = None,
        prog_bar: bool = False,
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
        self.log_per_rank_loads = require_flag(
            "ViTBalanceCallback", "log_per_rank_loads", log_per_rank_loads, optional=True
        )
        self.prog_bar = require_flag("ViTBalanceCallback", "prog_bar", prog_bar)
        self._warned_no_mixin = False
        self._told_no_calls = False
        self._reset_totals()
        # Each running evaluation loop's calls (the loop's own counts: nothing checkpointed).
        self._evaluation: dict[str, BalanceMetrics] = {}
        self.last_predict_metrics: dict[str, float] = {}
        """The latest predict run's figures, keyed ``vit_balance/predict/...`` (empty before one, or
        where its calls encoded directly); the same on every rank but the bytes and timings. Under
        ``ddp_spawn`` the ranks' copies of the callback hold them, not the launching process's."""

    def _reset_totals(self) -> None:
        # The interval since the last logged step, with the counts since the fit started; and the
        # optimizer step, for callback_metrics (its counts are the interval's).
        self._interval = BalanceMetrics(self.log_per_rank_loads)
        self._step = BalanceMetrics(self.log_per_rank_loads)

    @property
    def applied_total(self) -> int:
        """Calls that moved images since the fit started (``vit_balance/applied_total``)."""
        return self._interval.applied_total

    @property
    def calls_total(self) -> int:
        """Calls since the fit started (``vit_balance/calls_total``)."""
        return self._interval.calls_total

    @property
    def skipped_total(self) -> dict[str, int]:
        """Calls skipped per reason since the fit started (``vit_balance/skipped/{reason}``)."""
        return dict(self._interval.skipped_total)

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
        self._step.add(stats)
        self._interval.add(stats)

    # ------------------------------------------------------------------ metrics

    def window_metrics(self) -> dict[str, float]:
        """The metrics of the calls since the last logged step, as the loggers receive them.

        Returns an empty dict when no call was recorded since then.
        """
        return self._interval.metrics()

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
        window = self._step.window_metrics()
        self._step.reset_window()
        if not window:
            return
        metrics = {**window, **self._interval.total_metrics()}
        _to_callback_metrics(trainer, metrics)
        if self.prog_bar:
            for key in (PREFIX + "imbalance_before", PREFIX + "imbalance_after"):
                if key in metrics:  # unknown where balancing is disabled on many ranks
                    pl_module.log(key, metrics[key], prog_bar=True, logger=False, on_step=True)

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers and self.log_every_n_steps != 0:
            raise MisconfigurationException(
                "Cannot use ViTBalanceCallback with a Trainer that has no logger (Trainer(logger=False), or "
                "barebones=True): "
                "it logs through the Trainer's loggers. Pass a logger, or "
                "ViTBalanceCallback(log_every_n_steps=0) to only feed callback_metrics and the progress bar."
            )
        # A checkpoint being resumed restores the totals after this hook (`load_state_dict`).
        self._reset_totals()
        self._told_no_calls = False

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
        if trainer.global_step >= NO_CALLS_TOLD_AFTER_STEPS:
            self._tell_no_calls(pl_module)
        if not self._should_log(trainer):
            return
        metrics = self.window_metrics()
        self._interval.reset_window()
        if metrics:
            # The step every `self.log` value of this batch is logged at (not yet advanced here).
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            trainer._logger_connector.log_metrics(metrics, step=step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._tell_no_calls(pl_module)

    def _tell_no_calls(self, pl_module: LightningModule) -> None:
        """Warn once per fit where no training step made a ViT call through the mixin: a model
        never given to ``balance_vision_tower`` (or a ViT called directly) trains unbalanced, and
        nothing else would say so. Not where the module's configuration switches balancing off
        (``enabled=False``): a comparison run, which records nothing by design."""
        if (
            self._told_no_calls
            or self.calls_total
            or getattr(pl_module, "pop_vit_balance_stats", None) is None
            or _switched_off(pl_module)
        ):
            return
        self._told_no_calls = True
        rank_zero_warn(
            f"ViTBalanceCallback: no training step of {type(pl_module).__name__} called a ViT through "
            "ViTBalanceMixin, so nothing was balanced or logged. Give a Hugging Face model to "
            "self.balance_vision_tower(model) (in __init__ or configure_model), or call "
            "self.encode_images(vit, pixel_values, grid_thw) (self.encode_visual for images and "
            "videos) where the step called the ViT. A fit on text alone has nothing to balance, and "
            "one without a data-parallel group (configure_vit_balance_group() returned None) records "
            "nothing."
        )

    def _evaluation_start(self, pl_module: LightningModule, loop: str) -> None:
        """Start ``loop``'s record afresh: a run of it interrupted before its end (an exception in a
        batch) logs nothing, and its calls, recorded or still queued, are none of this run's."""
        self._evaluation.pop(loop, None)
        self._drain(pl_module)

    def _evaluation_batch_end(self, pl_module: LightningModule, loop: str) -> None:
        """Add the batch's calls to the running ``loop``'s (``val``, ``test``, ``predict``) record."""
        metrics = self._evaluation.setdefault(loop, BalanceMetrics(self.log_per_rank_loads))
        for stats in self._drain(pl_module):
            metrics.add(stats)

    def _evaluation_end(self, trainer: Trainer, loop: str) -> None:
        """Log a finished evaluation loop's calls, once, as Lightning logs its ``on_epoch`` values:
        at the training step it ran after, with the epoch."""
        metrics = self._evaluation.pop(loop, None)
        if metrics is None or trainer.sanity_checking:  # Lightning logs no sanity check's values
            return
        figures = _under(loop, metrics.metrics())
        _to_callback_metrics(trainer, figures)
        if self.log_every_n_steps != 0:
            trainer._logger_connector.log_metrics(figures)

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_start(pl_module, "val")

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
        self._evaluation_batch_end(pl_module, "val")

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_end(trainer, "val")

    @override
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_start(pl_module, "test")

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
        self._evaluation_batch_end(pl_module, "test")

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_end(trainer, "test")

    @override
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluation_start(pl_module, "predict")

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
        self._evaluation_batch_end(pl_module, "predict")

    @override
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        metrics = self._evaluation.pop("predict", None)
        self.last_predict_metrics = _under("predict", metrics.metrics()) if metrics is not None else {}
        if self.last_predict_metrics:
            rank_zero_info(_predict_line(self.last_predict_metrics))

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._interval.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._interval.load_state_dict(state_dict)


def _to_callback_metrics(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Put ``metrics`` in ``trainer.callback_metrics``: CPU float64 scalars, so counts stay exact
    and no metric is copied to a device. Monitors (ModelCheckpoint, EarlyStopping) compare them on
    any device."""
    if metrics:
        values = torch.tensor(list(metrics.values()), dtype=torch.float64)
        trainer.callback_metrics.update(zip(metrics, values.unbind()))


def _predict_line(metrics: dict[str, float]) -> str:
    """A predict run's figures in a line (``vit_balance/predict/...`` keys; those a run lacks, left
    out: the ``vit_ms`` ones before a second call, the imbalances without images)."""
    figure = {key.removeprefix(PREFIX + "predict/"): value for key, value in metrics.items()}
    parts = [f"{int(figure['applied_total'])} of {int(figure['calls_total'])} calls moved images"]
    if "imbalance_before" in figure:
        parts.append(f"load imbalance {figure['imbalance_before']:.3f} -> {figure['imbalance_after']:.3f}")
    if "vit_ms_max" in figure:
        parts.append(
            f"slowest rank's ViT {figure['vit_ms_max']:.1f} ms a call (mean {figure['vit_ms_mean']:.1f})"
        )
    return "ViTBalanceCallback: predict: " + "; ".join(parts) + "."
