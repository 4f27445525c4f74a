"""Hugging Face ``Trainer`` integration: the drop-in's balancer state in the Trainer's checkpoints.

Imported on first use of :class:`ViTBalanceTrainerCallback` (it imports transformers).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from lightning_vit_balance.hf import BalancedVisionTower, continue_fit

__all__ = ["ViTBalanceTrainerCallback"]


class ViTBalanceTrainerCallback(TrainerCallback, ExportableState):
    """Carries the balancer's state of a model given to ``balance_vision_tower`` through Hugging
    Face ``Trainer`` checkpoints: with ``calibrate_cost``, the online cost fit, so a run resumed
    from a checkpoint plans with the fitted model from its first step instead of fitting again
    (a warm-up and a dozen rank-steps of measurements on the initial model).

    Example::

        handle = balance_vision_tower(model, ViTBalanceConfig(calibrate_cost=True))
        trainer = Trainer(model=model, args=args, ..., callbacks=[ViTBalanceTrainerCallback()])
        trainer.train(resume_from_checkpoint=True)

    The state (plain numbers, :meth:`BalancedVisionTower.state_dict`) rides in the checkpoint's
    ``trainer_state.json`` under ``stateful_callbacks``, written by the process that saves: every
    rank holds the same state. At the start of training every rank goes on from the state the
    Trainer resumed, with or without ``restore_callback_states_from_checkpoint``. A state the
    model's configuration cannot go on from (a cost fit of another window or per-frame attention)
    is left behind with a warning, and the fit starts afresh.
    """

    def __init__(self) -> None:
        self._handle: BalancedVisionTower | None = None

    def state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` keeps (Hugging Face's ``ExportableState``)."""
        balancer = self._handle.state_dict() if self._handle is not None else {}
        return {"args": {}, "attributes": {"balancer_state": balancer}}

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._handle = _handle_of(kwargs.get("model"), required=False)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._handle = _handle_of(kwargs.get("model"), required=True)
        saved = _resumed_state(state.stateful_callbacks, type(self).__name__)
        # A fresh run holds this callback's own state of a moment ago: nothing to go on from.
        if not saved or saved == self._handle.state_dict():
            return
        source = "ViTBalanceTrainerCallback: the checkpoint's balancer state"
        continue_fit(self._handle, saved, source, _warn if state.is_world_process_zero else _quiet)


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _quiet(message: str) -> None:
    """Every rank decides alike; rank 0 alone says so."""


def _handle_of(model: Any, required: bool) -> BalancedVisionTower | None:
    """The handle balancing the Trainer's ``model`` (DDP-style wrappers included: the tower is
    found among its submodules), or None when not ``required``."""
    handle = None
    if isinstance(model, nn.Module):
        try:
            handle = BalancedVisionTower.of(model)
        except ValueError:  # no vision tower, or several
            handle = None
    if handle is None and required:
        raise ValueError(
            f"ViTBalanceTrainerCallback: the Trainer's model ({type(model).__name__}) has no balanced "
            "vision tower: call balance_vision_tower(model) before Trainer(model=model, ...)."
        )
    return handle


def _resumed_state(stateful_callbacks: Any, name: str) -> Mapping[str, Any] | None:
    """The balancer state saved under ``name`` in a TrainerState's ``stateful_callbacks``."""
    entry = stateful_callbacks.get(name) if isinstance(stateful_callbacks, Mapping) else None
    if isinstance(entry, list):  # several callbacks of one class: the first is ours
        entry = entry[0] if entry else None
    attributes = entry.get("attributes") if isinstance(entry, Mapping) else None
    saved = attributes.get("balancer_state") if isinstance(attributes, Mapping) else None
    return saved if isinstance(saved, Mapping) else None
