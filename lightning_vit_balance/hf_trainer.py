"""Hugging Face ``Trainer`` integration: the drop-in's ``vit_balance/*`` metrics in the Trainer's
logs, and its balancer state in the Trainer's checkpoints.

Imported on first use of :class:`ViTBalanceTrainerCallback` (it imports transformers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from lightning_vit_balance.callsite import warn_at_user
from lightning_vit_balance.config import require_flag
from lightning_vit_balance.hf import BalancedVisionTower, continue_fit
from lightning_vit_balance.metrics import BalanceMetrics

__all__ = ["ViTBalanceTrainerCallback"]


class ViTBalanceTrainerCallback(TrainerCallback, ExportableState):
    """The drop-in's diagnostics in a Hugging Face ``Trainer``'s logs, and its state in the
    Trainer's checkpoints, for a model given to ``balance_vision_tower``.

    Example::

        handle = balance_vision_tower(model, ViTBalanceConfig(calibrate_cost=True))
        trainer = Trainer(model=model, args=args, ..., callbacks=[ViTBalanceTrainerCallback()])
        trainer.train(resume_from_checkpoint=True)

    **Metrics.** Every training log of the Trainer (``logging_steps``) gets the ``vit_balance/*``
    figures of the balanced forwards since the previous one, keyed and aggregated as
    :class:`~lightning_vit_balance.ViTBalanceCallback` documents them (:class:`BalanceMetrics`):
    imbalance before and after, loads and measured ViT milliseconds per rank, images, patches and
    bytes moved, time spent, and the counts since training started. They go into ``logs`` (printed
    by the progress callback, seen by the callbacks after this one) and the Trainer's
    ``state.log_history`` (``trainer_state.json``). An evaluation's log (``trainer.evaluate()``, in
    training or alone) gets its balanced forwards' figures under its own prefix
    (``eval_vit_balance/vit_ms_max``, and so in the dict ``evaluate`` returns), with ``calls_total``
    and ``skipped/{reason}`` counting that evaluation's forwards alone. Reporting integrations
    (``report_to``: W&B, TensorBoard, MLflow...) run before callbacks passed to the Trainer; to
    have them log the metrics too, add the callback with :meth:`attach` instead::

        ViTBalanceTrainerCallback().attach(trainer)

    **Checkpoints.** The state (plain numbers: :meth:`BalancedVisionTower.state_dict`, with
    ``calibrate_cost`` the online cost fit, and the metrics' counts) rides in each checkpoint's
    ``trainer_state.json`` under ``stateful_callbacks``, written by the process that saves: every
    rank holds the same state. At the start of training every rank goes on from the state the
    Trainer resumed, with or without ``restore_callback_states_from_checkpoint``: a resumed run
    plans with the fitted model from its first step instead of fitting again, and counts on. A
    state the model's configuration cannot go on from (a cost fit of another window or per-frame
    attention) is left behind with a warning, and the fit starts afresh.

    **End of a loop.** When training, an evaluation or a prediction ends, every rank reports what
    the loop's last forward given a plan made ahead left for a next gather
    (:meth:`BalancedVisionTower.check_pending`); an evaluation or a prediction also forgets its
    clocks (:meth:`BalancedVisionTower.end_evaluation`), so the next one's ``vit_ms`` figures are
    its own forwards'. When training ends, the handle also lets go of its
    gloo twin (:meth:`BalancedVisionTower.release`): a process that trains model after model (a
    hyperparameter search's trials) holds none per run.

    Args:
        log_per_rank_loads: Log the ``load_before/rank_{r}``, ``load_after/rank_{r}`` and
            ``vit_ms/rank_{r}`` series, three per DP rank. ``None`` (default): up to 64 DP ranks
            (:data:`~lightning_vit_balance.metrics.PER_RANK_SERIES_UP_TO`), not beyond.
    """

    def __init__(self, log_per_rank_loads: bool | None = None) -> None:
        self.log_per_rank_loads = require_flag(
            "ViTBalanceTrainerCallback", "log_per_rank_loads", log_per_rank_loads, optional=True
        )
        self.metrics = BalanceMetrics(self.log_per_rank_loads)
        # The running evaluation's forwards, read at each of its steps: the handle keeps the latest
        # KEPT_STATS alone, fewer than an evaluation's forwards.
        self._evaluation = BalanceMetrics(self.log_per_rank_loads)
        self._handle: BalancedVisionTower | None = None
        self._handle_sought = False  # whether the model was searched for one (a walk of its modules)

    def attach(self, trainer: Any) -> ViTBalanceTrainerCallback:
        """Add this callback to ``trainer`` (unless it holds one already), with its metrics put in
        each training log ahead of the Trainer's reporting integrations, which then log them too.

        Returns the callback the trainer holds: this one, or the ``ViTBalanceTrainerCallback`` it
        held already (given in ``callbacks=``, or the copy a resumed Trainer restores in the place
        of its callbacks): a second one would log each figure twice, and after a resume overwrite
        the first one's window.

        Raises:
            TypeError: ``trainer`` is not a Hugging Face ``Trainer``.
        """
        handler = getattr(trainer, "callback_handler", None)
        if handler is None:
            raise TypeError(
                f"ViTBalanceTrainerCallback.attach(trainer={trainer!r}) is invalid: expected a Hugging "
                "Face transformers.Trainer (a Lightning Trainer takes ViTBalanceCallback)."
            )
        held = next((cb for cb in handler.callbacks if isinstance(cb, ViTBalanceTrainerCallback)), None)
        if held is None:
            trainer.add_callback(self)
            held = self
            self._keep_stats_of(getattr(trainer, "model", None))  # added after on_init_end
        if not any(isinstance(callback, _MetricsFirst) for callback in handler.callbacks):
            # The callbacks run in list order: first of all. A Trainer that restores callback
            # states replaces this callback by a copy at the end; the helper finds that one.
            handler.callbacks.insert(0, _MetricsFirst(trainer))
        return held

    def state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` keeps (Hugging Face's ``ExportableState``)."""
        balancer = self._handle.state_dict() if self._handle is not None else {}
        attributes = {"balancer_state": balancer, "metric_counts": self.metrics.state_dict()}
        return {"args": {"log_per_rank_loads": self.log_per_rank_loads}, "attributes": attributes}

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._keep_stats_of(kwargs.get("model"))

    def _keep_stats_of(self, model: Any, required: bool = False) -> None:
        """Read ``model``'s handle from here on: its forwards' stats are kept from now (so an
        evaluation before any training logs its forwards too), for this callback to read."""
        self._handle, self._handle_sought = _handle_of(model, required=required), True
        if self._handle is not None:
            self._handle.pop_stats()

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._keep_stats_of(kwargs.get("model"), required=True)
        assert self._handle is not None  # required: _handle_of raised otherwise
        saved = _resumed_attributes(state.stateful_callbacks, type(self).__name__)
        warn = warn_at_user if state.is_world_process_zero else _quiet
        # A fresh run's state holds this callback's own state of a moment ago (the last run's, with
        # one callback for several runs: a hyperparameter search's trials, each with a new model):
        # nothing to go on from, the counts start at zero and the cost fit as the handle's.
        resumed = state.global_step > 0
        self._count_on(saved.get("metric_counts") if resumed else None, warn)
        balancer = saved.get("balancer_state") if resumed else None
        if not balancer or balancer == self._handle.state_dict():
            return  # nothing saved, or what the handle holds already (not a mapping: warned below)
        source = "ViTBalanceTrainerCallback: the checkpoint's balancer state"
        continue_fit(self._handle.load_state_dict, balancer, source, warn)

    def _count_on(self, counts: Any, warn: Callable[[str], None]) -> None:
        """Start the metrics afresh, counting on from a resumed checkpoint's ``counts``."""
        self.metrics = BalanceMetrics(self.log_per_rank_loads)
        if counts is None:
            return
        try:
            self.metrics.load_state_dict(counts)
        except ValueError as error:
            warn(f"ViTBalanceTrainerCallback: the checkpoint's metric counts are not used ({error}).")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._handle is not None:
            try:
                self._handle.check_pending()  # the last step's forward: no later gather reads it
            finally:
                self._handle.release()  # the gloo twin: a process running trial after trial holds none
                self._handle.pop_stats()  # release stops keeping; an evaluate() after training reads on

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_evaluation(kwargs.get("model"))  # its log has its figures already

    def on_predict(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._end_evaluation(kwargs.get("model"))  # a prediction logs nothing

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not self._handle_sought:  # added with add_callback after the Trainer's start: from now on
            self._keep_stats_of(kwargs.get("model"))
        self._read_evaluation()

    def _read_evaluation(self) -> BalanceMetrics:
        """The running evaluation's (or prediction's) forwards, with those since its last step."""
        if self._handle is not None:
            # Training's stay for their step's end: a callback ahead of this one may evaluate there.
            for stats in self._handle.pop_stats(training=False):
                self._evaluation.add(stats)
        return self._evaluation

    def _end_evaluation(self, model: Any) -> None:
        """At an evaluation's or a prediction's end, check its last forward and forget its clocks
        and forwards, so the next one reports its own forwards alone."""
        # Every rank evaluates and predicts (the Trainer's loaders pad), so every rank checks. The
        # Trainer's model names the handle: a callback added after the Trainer's start (attach,
        # add_callback) saw no on_init_end, and evaluate may run before any training.
        handle = _handle_of(model, required=False) or self._handle
        self._evaluation = BalanceMetrics(self.log_per_rank_loads)  # what no log took (a prediction's)
        if handle is not None:
            handle.check_pending()
            handle.end_evaluation()
            handle.pop_stats(training=False)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Forwards between steps are not training's; an evaluation between them is over (one that
        # raised and was caught left its forwards here: none of the next one's).
        self._evaluation = BalanceMetrics(self.log_per_rank_loads)
        if self._handle is not None:
            self._handle.pop_stats()

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._handle is not None:
            self._handle.drop_text_only_grads()  # a step of text alone: the plain model's None

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._handle is not None:
            for stats in self._handle.pop_stats(training=True):  # every micro-batch of the step
                self.metrics.add(stats)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.publish(state, logs)

    def publish(self, state: TrainerState, logs: dict[str, Any] | None) -> None:
        """Put the window's metrics into a training log (one with ``"loss"``) and start the next
        window, or an evaluation's forwards into its log (see :func:`_evaluation_prefix`); and into
        the log history's entry of that log. Nothing when there were no calls."""
        if logs is None:
            return
        if "loss" in logs:
            metrics, marker = self.metrics.metrics(), "loss"
            self.metrics.reset_window()
        else:
            prefix = _evaluation_prefix(logs)
            if prefix is None or self._handle is None:
                return
            evaluation = self._read_evaluation()
            self._evaluation = BalanceMetrics(self.log_per_rank_loads)
            metrics = {f"{prefix}_{key}": value for key, value in evaluation.metrics().items()}
            marker = f"{prefix}_runtime"
        if not metrics:
            return
        logs.update(metrics)
        latest = state.log_history[-1] if state.log_history else None
        if isinstance(latest, dict) and latest.get("step") == state.global_step and marker in latest:
            latest.update(metrics)


class _MetricsFirst(TrainerCallback):
    """Runs first in ``on_log``: the trainer's :class:`ViTBalanceTrainerCallback` publishes there,
    before the reporting integrations read the log."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)  # the trainer holds this callback

    def on_log(self, args: Any, state: TrainerState, control: Any, logs: Any = None, **kwargs: Any) -> None:
        trainer = self._trainer()
        callbacks = trainer.callback_handler.callbacks if trainer is not None else ()
        for callback in callbacks:
            if isinstance(callback, ViTBalanceTrainerCallback):
                callback.publish(state, logs)
                return


def _evaluation_prefix(logs: dict[str, Any]) -> str | None:
    """The metric prefix of an evaluation's log (``eval``, ``eval_{dataset}``, or the
    ``metric_key_prefix`` given): the Trainer's speed figures, ``{prefix}_runtime`` with
    ``{prefix}_samples_per_second``, are in each (a ``compute_metrics`` key ending in ``_runtime``
    is not); None for other logs (the run's summary has ``train_runtime``)."""
    speed = "_samples_per_second"
    prefixes = [key.removesuffix(speed) for key in logs if key.endswith(speed) and key != "train" + speed]
    found = [prefix for prefix in prefixes if f"{prefix}_runtime" in logs]
    return found[0] if len(found) == 1 else None


def _quiet(message: str) -> None:
    """Every rank decides alike; rank 0 alone says so."""


def _handle_of(model: Any, required: bool) -> BalancedVisionTower | None:
    """The handle balancing the Trainer's ``model`` (DDP-style wrappers included: the tower is
    found among its submodules), or None when not ``required``."""
    handle, cause = None, None
    if isinstance(model, nn.Module):
        try:
            handle = BalancedVisionTower.of(model)
        except ValueError as error:  # no vision tower, or several
            cause = error
    if handle is None and required and cause is not None:
        raise ValueError(
            f"ViTBalanceTrainerCallback: the Trainer's model ({type(model).__name__}) must hold one "
            f"vision tower, the balanced one it logs ({cause}). A second model of the loop (a "
            "reference model, a teacher) goes outside the model given to the Trainer, as TRL keeps "
            "its reference model: its own handle balances it."
        ) from cause
    if handle is None and required:
        raise ValueError(
            f"ViTBalanceTrainerCallback: the Trainer's model ({type(model).__name__}) has no balanced "
            "vision tower: call balance_vision_tower(model) before Trainer(model=model, ...)."
        )
    return handle


def _resumed_attributes(stateful_callbacks: Any, name: str) -> Mapping[str, Any]:
    """The attributes saved under ``name`` in a TrainerState's ``stateful_callbacks`` (empty when none)."""
    entry = stateful_callbacks.get(name) if isinstance(stateful_callbacks, Mapping) else None
    if isinstance(entry, list):  # several callbacks of one class: the first is ours
        entry = entry[0] if entry else None
    attributes = entry.get("attributes") if isinstance(entry, Mapping) else None
    return attributes if isinstance(attributes, Mapping) else {}
