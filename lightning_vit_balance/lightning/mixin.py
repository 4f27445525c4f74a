"""ViTBalanceMixin: ``self.encode_images(vit, pixel_values, grid_thw)`` for LightningModules."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import itertools
import math
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler, _IndexBatchSamplerWrapper
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from lightning_vit_balance.balancer import (
    BalanceStats,
    PreparedPlan,
    ViTBalancer,
    checked_state,
    refuse_in_a_loader_worker,
)
from lightning_vit_balance.callsite import warn_on_rank_zero
from lightning_vit_balance.config import ViTBalanceConfig, require_flag
from lightning_vit_balance.cost import CostModel
from lightning_vit_balance.eager import eager, eager_frame
from lightning_vit_balance.encoding import INVALID_INPUT, parameters_sharded
from lightning_vit_balance.exchange import current_group, gather_host_values, require_member
from lightning_vit_balance.hf import (
    GRIDS_KEY,
    KEPT_STATS,
    BalancedVisionTower,
    continue_fit,
    direct_call_stats,
    encode_visual,
    key_names,
    rows_to_plan,
    unreadable_batch,
)
from lightning_vit_balance.host_group import gathers_on, owned_host_group, release_host_group
from lightning_vit_balance.lightning.callback import ViTBalanceCallback
from lightning_vit_balance.lightning.strategy import dp_group_from_strategy, tensor_parallel_size
from lightning_vit_balance.outputs import OutputLayout, without_dropped
from lightning_vit_balance.recompute import in_backward_pass

__all__ = ["ViTBalanceMixin"]

#: Where a checkpoint keeps the balancer's state (:meth:`ViTBalancer.state_dict`).
CHECKPOINT_KEY = "vit_balance"
#: Where a checkpoint keeps the balancer states of modules with the mixin nested in the Trainer's
#: (a teacher), by their names in it: Lightning calls the checkpoint hooks of its module only.
NESTED_CHECKPOINT_KEY = "vit_balance_nested"
#: Balancers a module keeps at once, one per configuration and output layout its calls take; past
#: these the least recently used is let go (a configuration changed at every step, say).
KEPT_BALANCERS = 4


def _shared(values: list[Any]) -> Any:
    """The value every item of ``values`` equals, or None (none, or some differ)."""
    return values[0] if values and values.count(values[0]) == len(values) else None


#: What marks a run (``ViTBalanceMixin._vit_balance_run_key``): references to its objects.
_RunKey = tuple[Callable[[], object] | None, ...]


def _ref(obj: object) -> Callable[[], object] | None:
    """A weak reference to ``obj`` for a run key; one that holds it where it cannot be referred to
    weakly (``dist.new_group``'s placeholder on the ranks it leaves out is an int, which the group
    check then names)."""
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _draws_evenly(loader: object) -> bool:
    """Whether every rank draws the same number of batches from ``loader``.

    A :class:`~torch.utils.data.DistributedSampler` (Lightning's injected one, or the user's)
    gives every rank the same number of samples, padding or dropping the remainder; Lightning's
    predict sampler (``UnrepeatedDistributedSampler``) does not pad, and a custom batch sampler,
    an iterable dataset or no sampler at all promise nothing.
    """
    if not isinstance(loader, DataLoader):
        return False
    sampler, batches = loader.sampler, loader.batch_sampler
    return (
        isinstance(sampler, DistributedSampler)
        and not isinstance(sampler, UnrepeatedDistributedSampler)
        and (batches is None or type(batches) is BatchSampler)
    )


def _counts_its_batches(loader: object) -> bool:
    """Whether ``loader``'s length is the number of batches it yields on this rank, its samples
    split over the ranks by a :class:`~torch.utils.data.DistributedSampler` (Lightning's predict
    sampler, ``UnrepeatedDistributedSampler``, included: it does not pad, so the ranks' lengths
    differ by a batch at most). A custom batch sampler's length may be an estimate. Lightning wraps
    a predict loader's batch sampler to record the indices it draws, and puts its sampler there."""
    if not isinstance(loader, DataLoader):
        return False
    batches = loader.batch_sampler
    if isinstance(batches, _IndexBatchSamplerWrapper):
        batches = batches._batch_sampler
    if batches is None:
        return isinstance(loader.sampler, DistributedSampler)
    return type(batches) is BatchSampler and isinstance(batches.sampler, DistributedSampler)


#: The Trainer's hooks in which every rank makes the same calls: the loops' steps (predict's within
#: the batches every rank runs, see :func:`_predict_balances`). A call from another hook (a
#: callback's ``on_train_epoch_end`` that logs samples on rank 0, say) is direct, unless the ViT's
#: parameters are sharded (:func:`_sharded`).
_STEP_HOOKS = frozenset({"training_step", "validation_step", "test_step", "predict_step"})


class _BatchCodes(NamedTuple):
    """The code of Lightning's loop methods that move a batch to the device through the batch hooks
    and run its step (training, evaluation), and of the module's methods that run those hooks (the
    loops call them, and so do exports on an example input)."""

    loops: frozenset[Any]
    transfers: frozenset[Any]


@functools.cache
def _loop_batch_codes() -> _BatchCodes | None:
    """See :class:`_BatchCodes`; None where this Lightning has other methods."""
    try:
        from lightning.pytorch.core.module import LightningModule
        from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
        from lightning.pytorch.loops.prediction_loop import _PredictionLoop
        from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

        steps = (_TrainingEpochLoop.advance, _EvaluationLoop._evaluation_step, _PredictionLoop._predict_step)
        loops = {step.__code__ for step in steps}
        hooks = (LightningModule._on_before_batch_transfer, LightningModule._apply_batch_transfer_handler)
        return _BatchCodes(frozenset(loops), frozenset(hook.__code__ for hook in hooks))
    except (ImportError, AttributeError):
        return None


def _moving_a_loop_batch(depth: int = 64) -> bool:
    """Whether a Lightning loop's batch runs the hook running now (its transfer, its step): Lightning
    also calls the batch hooks outside its loops, on an example input (``to_onnx``,
    ``to_torchscript``, a logger's ``log_graph``, the model summary), on rank 0 alone where it
    exports or logs there, from a callback's batch-end hook too, within the loop's method: the
    batch hooks' caller tells. True where the loops' methods are unknown (as before this check)."""
    codes = _loop_batch_codes()
    if codes is None:
        return True
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in codes.loops:
            return True
        caller = frame.f_back
        if frame.f_code in codes.transfers and caller is not None:
            # The loops run the first hook themselves and the second through their strategy's
            # batch_to_device; an export runs both itself.
            if caller.f_code in codes.loops:
                return True
            if caller.f_code.co_name != "batch_to_device":
                return False
        frame = caller
    return False


def _loop_batch(trainer: Any) -> tuple[int, bool, int] | None:
    """Which batch the Trainer's running loop is at: its batch progress (by identity: progress
    values compare equal across loops), whether it is the sanity check, and the batches it has
    completed (counted after a batch's end hooks: the same from the hooks that move the batch to
    the device, the module's or a datamodule's, through its step). None outside the loops."""
    loop = getattr(trainer, "_active_loop", None)
    loop = getattr(loop, "epoch_loop", loop)  # a fit's training steps run in its epoch loop
    progress = getattr(loop, "batch_progress", None)
    if progress is None:
        return None
    return id(progress), bool(getattr(trainer, "sanity_checking", False)), progress.total.completed


def _loop_balances(
    trainer: Any,
    epoch_lengths: tuple[int, ...] | None = None,
    predict_lengths: _PredictLengths | None = None,
) -> bool:
    """Whether the Trainer's running loop makes the same ``encode_images`` calls on every rank.

    Training does (DDP needs the same steps on every rank anyway); validation, its sanity check
    and test do when every dataloader of the loop draws evenly (:func:`_draws_evenly`, true for
    Lightning's default sampler), except a fit's validation on each rank's own clock
    (:func:`_own_clock`; ``epoch_lengths``: every rank's, where gathered); predict does for the
    batches every rank runs (:func:`_predict_balances`; ``predict_lengths``: gathered at the
    run's start, with ``vit_balance_predict``); outside a loop nothing is promised.
    Without a Trainer, see :func:`_own_loop_balances`.
    """
    if trainer.training:
        return True
    if trainer.predicting:
        return _predict_balances(trainer, predict_lengths)
    if not (trainer.sanity_checking or trainer.validating or trainer.testing):
        return False
    if trainer.validating and _own_clock(trainer, epoch_lengths):
        return False
    # The running evaluation loop's own loaders: `trainer.val_dataloaders` would give a previous
    # fit's loaders during `trainer.validate()`.
    combined = getattr(trainer._active_loop, "_combined_loader", None)
    loaders = getattr(combined, "flattened", None)
    return bool(loaders) and all(_draws_evenly(loader) for loader in loaders)


class _PredictLengths(NamedTuple):
    """Every rank's batch count of each predict dataloader (``lengths[rank][dataloader]``), gathered
    at a predict run's start, and that run's loaders (which a later run replaces)."""

    loader: weakref.ref
    lengths: tuple[tuple[int, ...], ...]


def _predict_loaders(trainer: Any) -> Any:
    """The running predict loop's combined loader where every rank's lengths tell which batches
    every rank runs, else None: each dataloader counts its batches (:func:`_counts_its_batches`),
    no rank may have none (Lightning raises then, unless the module or datamodule allows it:
    such a rank would skip the run), and the loop hands each batch to the batch hooks (not a
    ``predict_step`` taking ``dataloader_iter``, whose batches the loop does not count)."""
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

    loop = trainer.predict_loop
    combined = getattr(loop, "_combined_loader", None)
    loaders = getattr(combined, "flattened", None)
    if not loaders or not all(_counts_its_batches(loader) for loader in loaders):
        return None
    allowed = "allow_zero_length_dataloader_with_multiple_devices"
    if any(getattr(holder, allowed, False) for holder in (trainer.lightning_module, trainer.datamodule)):
        return None
    return None if isinstance(getattr(loop, "_data_fetcher", None), _DataLoaderIterDataFetcher) else combined


def _predict_balances(trainer: Any, gathered: _PredictLengths | None) -> bool:
    """Whether every rank runs the predict loop's current batch: Lightning's predict sampler does not
    pad, so a rank may run a batch more of a dataloader than another. The loop runs its loaders in
    turn; a batch is every rank's where its index within its loader is below every rank's length
    of that loader. The batches past it, on some ranks only, encode directly."""
    loop = trainer.predict_loop
    if gathered is None or gathered.loader() is not getattr(loop, "_combined_loader", None):
        return False
    position = loop.batch_progress.current.completed  # this batch's, counted over the loaders in turn
    for index, length in enumerate(trainer.num_predict_batches):
        if not math.isfinite(length):
            return False
        if position < length:
            return position < min(lengths[index] for lengths in gathered.lengths)
        position -= int(length)
    return False


def _own_clock(trainer: Any, epoch_lengths: tuple[int, ...] | None) -> str | None:
    """Why the fit validates at each rank's own moment, None where every rank validates after the
    same training batch. Lightning decides on every rank apart: by its own clock where
    ``val_check_interval`` is a time, and by its own epoch's position (its end, a fraction of it,
    every N of its batches) unless ``check_val_every_n_epoch=None``, which counts the fit's batches
    alike on every rank. Ranks validating apart make a balanced validation call wait, until the
    timeout, for ranks still training. ``epoch_lengths``: every rank's training epoch length in
    batches (:func:`_epoch_lengths`), None where not gathered."""
    if trainer.state.fn != TrainerFn.FITTING:
        return None
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        return "val_check_interval is a time: Lightning decides on each rank's own clock when to validate"
    if epoch_lengths and len(set(epoch_lengths)) > 1 and trainer.check_val_every_n_epoch is not None:
        shown = ", ".join("unknown" if length < 0 else str(length) for length in epoch_lengths[:8])
        more = ", ..." if len(epoch_lengths) > 8 else ""
        return (
            f"the ranks' training epochs differ in length ({shown}{more} batches, by rank), and "
            "Lightning validates at each rank's own position in its epoch"
        )
    return None


def _training_data_set_up(trainer: Any) -> bool:
    """Whether the fit's training loop has set up its data (its epoch length is known): a sharded
    ViT's balanced calls in ``setup``, ``configure_model`` or ``on_fit_start`` come before, with
    ``trainer.training`` set already. False where this Lightning keeps its loader elsewhere."""
    return trainer.training and getattr(trainer.fit_loop, "_combined_loader", None) is not None


def _epoch_lengths(trainer: Any, group: Any) -> tuple[int, ...]:
    """Every rank's training epoch length in batches (-1 for an unknown one), in rank order: one
    gather over ``group``'s host twin, once per fit, at its first balanced training call or plan
    (every rank's first training batch: the ranks' later epochs may begin at different steps)."""
    return tuple(row[0] for row in _gathered_batch_counts([trainer.num_training_batches], group))


def _gathered_batch_counts(counts: list[float], group: Any) -> tuple[tuple[int, ...], ...]:
    """Every rank's ``counts`` (Lightning's numbers of batches, -1 for an unknown, infinite one),
    ``[rank][count]``: one gather over ``group``'s host twin."""
    mine = [int(count) if math.isfinite(count) else -1 for count in counts]
    return tuple(map(tuple, gather_host_values(mine, group).tolist()))


def _same_run(old: _RunKey | None, new: _RunKey) -> bool:
    """Whether run keys (``ViTBalanceMixin._vit_balance_run_key``) name the same objects."""
    if old is None:
        return False
    return all(
        (was is None and now is None) or (was is not None and now is not None and was() is now())
        for was, now in zip(old, new)
    )


def _entry_point(trainer: Any) -> object:
    """The Trainer's running entry point (``TrainerFn``: fit, validate, test, predict), or None."""
    return None if trainer is None else trainer.state.fn


def _some_keys(batch: Mapping[Any, Any]) -> str:
    """A mapping's first keys, for a message: a batch of several loaders (``CombinedLoader``) holds
    each loader's batch under its own key, where a plan made ahead finds none of its keys."""
    names = [repr(key) for key in itertools.islice(batch, 8)]
    more = ", ..." if len(batch) > 8 else ""
    return f"{', '.join(names)}{more}" if names else "no keys"


def _prepare_keys(owner: str, keys: object) -> tuple[tuple[str, str], ...]:
    """``owner``'s ``vit_balance_prepare_keys``, checked to be ``(pixels key, grid key)`` pairs (the
    same on every rank: all raise alike, before the plan's gather)."""
    pairs = isinstance(keys, (tuple, list)) and all(
        isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(key, str) for key in pair)
        for pair in keys
    )
    if not pairs:
        raise ValueError(
            f"{owner}.vit_balance_prepare_keys={keys!r} is invalid: expected (pixels key, grid "
            "key) pairs, one per modality, such as (('pixel_values', 'image_grid_thw'),)."
        )
    return tuple((pixels, grid) for pixels, grid in keys)  # type: ignore[union-attr]


def _own_loop_balances(training: bool, evaluation: bool, vit: object) -> bool:
    """Without a Trainer (Fabric, or a plain module with an explicit group), whether a call of
    ``vit`` made in the caller's own loop is balanced.

    Training calls are (the module in train mode): a training loop makes the same steps on every
    rank, as DDP needs anyway. Evaluation calls (the module in eval mode) are balanced when the
    caller says every rank makes them (``evaluation``), or where ``vit``'s parameters are sharded
    (:func:`_sharded`). Otherwise they encode directly, so that an evaluation on some ranks only
    (samples logged on rank 0) does not wait in a collective the other ranks never join.
    """
    return training or evaluation or _sharded(vit)


def _sharded(vit: object) -> bool:
    """Whether ``vit``'s parameters are sharded (FSDP, ZeRO-3): each call of it is a collective
    then, which every rank makes or the plain model would hang too, and a text-only rank must join
    it (balanced, it runs the tower too). Walked at each call, not kept: a tower may be sharded
    after an earlier call (FSDP on its blocks keeps the tower's class)."""
    return isinstance(vit, torch.nn.Module) and parameters_sharded(vit)


#: The Lightning hooks the mixin implements; each must come before LightningModule's in the MRO.
_MIXIN_HOOKS = (
    "on_before_batch_transfer",
    "on_before_optimizer_step",
    "on_predict_start",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "teardown",
)


def _shadowed_hooks(cls: type) -> list[str]:
    """The mixin's hooks that a Lightning class ahead of :class:`ViTBalanceMixin` in ``cls``'s MRO
    defines too: calls (``super()`` ones included) then stop there, never reaching the mixin's."""
    mro = cls.__mro__
    ahead = mro[: mro.index(ViTBalanceMixin)]
    lightning = [
        klass for klass in ahead if klass.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
    ]
    return [name for name in _MIXIN_HOOKS if any(name in vars(klass) for klass in lightning)]


def _allow_configs_in_checkpoints() -> None:
    """Let ``weights_only`` checkpoint loading rebuild the package's configuration types.

    A module that calls ``save_hyperparameters()`` keeps its ``ViTBalanceConfig`` (or a
    ``CostModel``) in the checkpoint's hyperparameters. Both are frozen dataclasses of plain
    numbers, strings and bools, and ``ViTBalanceConfig`` unpickles through its own checks, so
    allowing them cannot run arbitrary code. Idempotent (torch keeps a set).
    """
    torch.serialization.add_safe_globals([ViTBalanceConfig, CostModel])


#: The modules' states that hold a gloo twin, weakly (see :func:`_release_ended_runs`).
_TWIN_HOLDERS: weakref.WeakSet[_State] = weakref.WeakSet()


def _release_ended_runs(starting: _State, trainer: object) -> None:
    """Release the twins of runs that ended without their teardown, as ``starting``'s run (of
    ``trainer``, None under Fabric) starts: those whose Trainer raised (Lightning calls no module
    ``teardown`` after an exception) or now runs another run (a Trainer reused after a failure is
    no longer ``INTERRUPTED``). A module nested in the running one, which Lightning attaches to
    the same Trainer, is in the same run and keeps its twin.

    A module kept alive (a sweep that keeps a failed trial's exception holds it through the
    traceback) would otherwise hold its twin, ``P + 3`` open files and three threads, for the life
    of the process (one per such trial). Runs of Fabric, which tells no status, are left to
    :func:`~lightning_vit_balance.host_group.owned_host_group` (modules gone)."""
    for holder in list(_TWIN_HOLDERS):
        runner = holder.fit_key[0]() if holder.fit_key and holder.fit_key[0] is not None else None
        if holder is starting or runner is None:
            continue
        # The runner, its strategy and the module it wraps (Lightning wraps anew at every run).
        reused = runner is trainer and not _same_run(holder.fit_key[:3], (starting.fit_key or ())[:3])
        if reused or getattr(getattr(runner, "state", None), "status", None) == TrainerStatus.INTERRUPTED:
            holder.release()


class _State:
    """What the mixin keeps between calls. Never copied or pickled with the module.

    Process groups and balancers belong to one run of processes: a deep copy of the module (EMA,
    checkpoint callbacks) or the pickle that ``ddp_spawn`` sends to its workers starts afresh.
    """

    def __init__(self) -> None:
        self.fit_key: _RunKey | None = None
        #: The Trainer's entry point (fit, validate, test, predict) when the key was taken.
        self.fit_entry: object = None
        self.group: dist.ProcessGroup | None = None
        self.group_size = 1
        #: The latest call's balancer, the last of ``balancers``: this run's, one per configuration
        #: and output layout its calls took (a drop-in tower's and encode_images' in one step).
        self.balancer: ViTBalancer | None = None
        self.balancers: list[tuple[ViTBalanceConfig, OutputLayout | None, ViTBalancer]] = []
        #: The tower the latest balancer was taken for, and the one the latest plan made ahead
        #: went to (encode_images, encode_visual), weakly (None: not known).
        self.latest_tower: Callable[[], object] | None = None
        self.planned_tower: Callable[[], object] | None = None
        self.records: collections.deque[BalanceStats] = collections.deque(maxlen=KEPT_STATS)
        self.last_stats: BalanceStats | None = None
        self.ticket: PreparedPlan | None = None
        #: The loop's batch the ticket was made for (see ViTBalanceMixin._vit_balance_keep_ticket).
        self.ticket_batch: tuple[int, bool, int] | None = None
        #: Whether the batch the ticket was made from carried the drop-in's collator's grids.
        self.ticket_collated = False
        self.told_own_clock = False
        #: Whether a call was told that the Trainer's module, this one's parent, lacks the mixin.
        self.told_plain_parent = False
        #: Every rank's training epoch length, gathered at this fit's first balanced training call
        #: or plan (None before it): ranks whose epochs differ validate apart (see _own_clock).
        self.epoch_lengths: tuple[int, ...] | None = None
        #: Every rank's predict batch counts, gathered at a predict run's start (see
        #: _predict_balances), None where not gathered.
        self.predict_lengths: _PredictLengths | None = None
        #: Whether a plan was ever made ahead, and whether why none was made was told (once, see
        #: _vit_balance_tell_unplanned).
        self.planned_ahead = False
        self.told_unplanned = False
        #: Whether the mixin's on_before_batch_transfer ran for a loop's batch in this run.
        self.batch_hook_ran = False
        self.host_group: dist.ProcessGroup | None = None
        #: Modules with the mixin nested in this one (a teacher) that balanced in this run, weakly,
        #: in the order of their first balanced calls (the same on every rank: the pending checks
        #: are collectives): the Trainer calls this module's hooks only, so it drains their
        #: records, checks and releases them.
        self.nested: weakref.WeakKeyDictionary[ViTBalanceMixin, None] = weakref.WeakKeyDictionary()
        #: A balancer state the next balancer starts from: a loaded checkpoint's, or the last
        #: run's (what a checkpoint saved between runs keeps).
        self.carried: Mapping[str, Any] | None = None

    def kept_balancer(self, config: ViTBalanceConfig, layout: OutputLayout | None) -> ViTBalancer | None:
        """The balancer kept for ``config`` and ``layout``, now the latest (it takes what the one
        before left to tell at its next gather), or None where none is kept."""
        for index, (kept, kept_layout, balancer) in enumerate(self.balancers):
            if kept == config and kept_layout == layout:
                del self.balancers[index]
                self.keep_balancer(config, layout, balancer)
                return balancer
        return None

    def keep_balancer(
        self, config: ViTBalanceConfig, layout: OutputLayout | None, balancer: ViTBalancer
    ) -> None:
        """Make ``balancer`` the latest, for ``config`` and ``layout``; the least recently used
        beyond :data:`KEPT_BALANCERS` is let go."""
        if self.balancer is not None and self.balancer is not balancer:
            balancer._take_pending(self.balancer)
        kept = self.balancers[max(0, len(self.balancers) + 1 - KEPT_BALANCERS) :]
        self.balancers = [*kept, (config, layout, balancer)]
        self.balancer = balancer

    def forget_balancers(self) -> None:
        """Let go of the run's balancers: the next call's starts from the carried state."""
        self.balancer, self.balancers = None, []

    def balancer_state(self) -> Mapping[str, Any] | None:
        """What a checkpoint keeps now: the balancer's state, else the one carried to the next."""
        return self.balancer.state_dict() if self.balancer is not None else self.carried

    def release(self) -> None:
        """Forget the run: its groups, balancer and pending plan (the next call starts afresh), and
        destroy its gloo twin (its sockets and threads: a process running many fits would
        otherwise hold one twin per fit); the last stats are kept, and the balancer's state is
        carried to the next run's."""
        last_stats, carried = self.last_stats, self.balancer_state()
        release_host_group(self.host_group)
        _TWIN_HOLDERS.discard(self)
        self.__init__()  # type: ignore[misc]
        self.last_stats, self.carried = last_stats, carried

    def __getstate__(self) -> dict[str, Any]:
        # Groups, sockets and the balancer stay in this process; the balancer's state (plain
        # numbers: a loaded checkpoint's cost fit) goes along, as into a ddp_spawn worker.
        return {"carried": self.balancer_state()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.carried = state.get("carried")

    def __deepcopy__(self, memo: dict[int, Any]) -> _State:
        copied = _State()
        copied.carried = copy.deepcopy(self.balancer_state(), memo)
        return copied


class _TowerRefs:
    """A module's drop-in handles, held weakly: a handle lives as long as the model it is installed
    on (whose patched forward holds it), so a model replaced since (a sweep, a ``configure_model``
    loading one per fit) is not kept alive by the module, nor is a handle removed since. Copies and
    pickles of the module hold the live handles themselves, which travel with the models that
    hold them (one deep copy or pickle shares them)."""

    def __init__(self, towers: tuple[BalancedVisionTower, ...] = ()) -> None:
        self._refs = tuple(weakref.ref(tower) for tower in towers)

    def live(self) -> tuple[BalancedVisionTower, ...]:
        found = (ref() for ref in self._refs)
        return tuple(tower for tower in found if tower is not None and tower.installed)

    def __getstate__(self) -> dict[str, Any]:
        return {"towers": self.live()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["towers"])  # type: ignore[misc]


class _ModuleTowerBalance(BalancedVisionTower):
    """A Hugging Face model's tower balanced with a LightningModule's group, configuration and stats.

    The group and configuration are looked up at each training forward (the strategy's group
    exists only once the fit runs), as for ``encode_images``; stats go where ``encode_images``
    puts them, so :class:`ViTBalanceCallback` logs them.
    """

    #: Set while :meth:`prepare` plans the next forward: the settings of that forward, not a call here.
    _planning_ahead = False

    def __init__(self, model: torch.nn.Module, module: ViTBalanceMixin, evaluation: bool) -> None:
        super().__init__(model, evaluation=evaluation)
        self.module = module

    def __deepcopy__(self, memo: dict[int, Any]) -> _ModuleTowerBalance:
        # A copy of the model alone (a reference model made from the policy) balances with this
        # module, instead of holding a copy of the whole module and every other model in it; a copy
        # of the module itself, its models with it, balances with that copy (the memo holds it).
        memo.setdefault(id(self.module), self.module)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def settings(self) -> tuple[ViTBalanceConfig, Any] | None:
        settings = self.module._vit_balance_settings(self.tower, ahead=self._planning_ahead)
        return None if settings is None else (self.balancing_config(settings[0]), settings[1])

    @property
    def config(self) -> ViTBalanceConfig | None:
        """Always None: the module's ``vit_balance_config`` balances this tower (see
        :meth:`balancing_config`), not a configuration of the handle's own."""
        return None

    @config.setter
    def config(self, value: ViTBalanceConfig | None) -> None:
        # Set on the handle, it would be ignored without a word: the module's settings apply.
        if value is not None:
            raise AttributeError(
                f"handle.config={value!r} is not used for a tower balanced through "
                "ViTBalanceMixin.balance_vision_tower: its module's configuration applies. Set "
                "self.vit_balance_config instead (to change a setting and keep the tower's default: "
                "self.vit_balance_config = dataclasses.replace(handle.default_config(), ...))."
            )

    def balancing_config(self, config: ViTBalanceConfig) -> ViTBalanceConfig:
        """The configuration this tower's calls balance with, where the module's settings give
        ``config``: :meth:`_tower_default`, else ``config`` (said once where it drops what the
        tower's default derives, see ``_own_config``)."""
        return self._tower_default() or self._own_config(config)

    def _tower_default(self) -> ViTBalanceConfig | None:
        """The tower's default configuration where the module has no ``vit_balance_config`` (it
        prices images by the tower's own shape, as the engine's balance_vision_tower does), else
        None: the module's configuration."""
        return self.default_config() if getattr(self.module, "vit_balance_config", None) is None else None

    def record(self, stats: BalanceStats) -> None:
        self.module._vit_balance_keep(stats)

    def encoded_directly(self, parts: tuple[tuple[Any, Any], ...]) -> None:
        # Counted where encode_images counts its direct calls (one device in a balancing loop),
        # priced as settings() would price them.
        self.module._vit_balance_keep_direct(self.tower, parts, self._tower_default())

    def prepared_plan(self) -> PreparedPlan | None:
        ticket = self.module._vit_balance_take_ticket()
        if ticket is not None and ticket.holds_images and ticket.dtype != self.pixel_dtype:
            # Made for rows of another dtype: towers of several dtypes plan the batch's own rows,
            # for a tower of the batch's dtype. Kept for that tower's call; this one plans in its
            # call (the same towers on every rank: all decide alike).
            self.module._vit_balance_state_object().ticket = ticket
            return None
        return ticket

    def plan_waiting(self) -> bool:
        # The module's plan made ahead from a batch the collator made (its plan_ahead hook's): the
        # collator's grids (handle.plan_ahead) would otherwise plan the batch again.
        return self.module._vit_balance_ticket_waiting()

    def _named(self, ticket: PreparedPlan, source: str) -> PreparedPlan:
        # The module keeps the plan its calls take (see prepare), not this handle.
        named = dataclasses.replace(ticket, source=source)
        state = self.module._vit_balance_state_object()
        if state.ticket is ticket:
            state.ticket = named
        return named

    def _layout_balancer(
        self, config: ViTBalanceConfig, group: Any, layout: OutputLayout | None
    ) -> ViTBalancer:
        # The module's balancer (the one its plan-ahead hook prepared with), built with this
        # tower's output layout: the merge Muse Spark's or Kimi-K2.5's outputs are split by.
        return self.module._vit_balance_balancer(config, group, layout, self.tower)

    def prepare(self, batch: Mapping[str, Any]) -> PreparedPlan | None:
        # For the next forward, from wherever it is asked for (a Trainer's hook before the step).
        self._planning_ahead = True
        try:
            ticket = super().prepare(batch)
        finally:
            self._planning_ahead = False
        # The module's calls take the module's plan (as its plan_ahead hook makes it).
        self._ticket = None
        collated = isinstance(batch, Mapping) and batch.get(GRIDS_KEY) is not None
        self.module._vit_balance_keep_ticket(ticket, collated)
        return ticket

    def state_dict(self) -> dict[str, Any]:
        # The module's balancer calibrates (its checkpoints keep this state too).
        return self.module.vit_balance_state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.module.load_vit_balance_state_dict(state)


class ViTBalanceMixin:
    """Gives a LightningModule ``self.encode_images(vit, pixel_values, grid_thw)``.

    Example::

        class MyVLM(ViTBalanceMixin, L.LightningModule):
            def __init__(self, vit_balance_config: ViTBalanceConfig | None = None):
                super().__init__()
                self.save_hyperparameters()
                self.vit_balance_config = vit_balance_config
                self.visual = ...

            def training_step(self, batch, batch_idx):
                embeds = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
                ...

    The configuration is the attribute ``vit_balance_config`` (absent means
    ``ViTBalanceConfig()``), so it can be a typed ``__init__`` argument that LightningCLI fills from
    YAML (LightningCLI records it in ``hparams`` as a dict of fields, which is accepted too). The
    mixin has no ``__init__``. List it before ``LightningModule`` in the bases: its Lightning hooks
    (``on_before_batch_transfer``, the checkpoint hooks, ``teardown``) run only then, and a class
    listing ``LightningModule`` first warns when it is defined (``encode_images`` works either way).

    The data-parallel group is looked up once per fit (or once per Fabric setup) with
    :meth:`configure_vit_balance_group`. Every balanced call's
    :class:`~lightning_vit_balance.BalanceStats` is kept in :attr:`last_vit_balance_stats`, and,
    while a :class:`~lightning_vit_balance.ViTBalanceCallback` is attached to the Trainer, queued
    for it (see :meth:`pop_vit_balance_stats`).

    Which Lightning loops balance (every rank must make the same calls there): the training
    step, and the validation (its sanity check included) and test steps when their dataloaders
    use a ``DistributedSampler``, as Lightning injects by default, and, with
    :attr:`vit_balance_predict`, the predict step in the batches every rank runs (Lightning's
    predict sampler does not pad, so a rank may run a batch more of a dataloader: every rank's
    batch counts, gathered at the run's start, tell). Other predict calls, evaluation on
    other loaders (an iterable dataset, ``use_distributed_sampler=False``, a custom batch
    sampler), other hooks (a callback logging samples on rank 0) and calls outside a loop encode
    directly: same outputs, nothing exchanged, nothing to hang on. Without a Trainer (Fabric),
    calls with the module in train mode balance, and those in eval mode only with
    :attr:`vit_balance_evaluation` set or the ViT's parameters sharded.

    Checkpoints: ``save_hyperparameters()`` may keep the ``ViTBalanceConfig`` (or a
    ``CostModel``) in ``hparams``. Defining a class that uses this mixin allows both types under
    the default ``weights_only`` loading, so ``Trainer.fit(ckpt_path=...)`` and
    ``load_from_checkpoint`` work, also in a fresh or spawned process. With ``calibrate_cost`` the
    online cost fit is saved under ``checkpoint["vit_balance"]`` and a resumed fit goes on from it
    (:meth:`on_save_checkpoint`, :meth:`on_load_checkpoint`).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Here rather than at import: nothing changes for programs that never define such a
        # module, and every program that loads its checkpoints defines the class first (a fresh
        # process for load_from_checkpoint, a ddp_spawn worker unpickling the module).
        _allow_configs_in_checkpoints()
        shadowed = _shadowed_hooks(cls)
        if shadowed:
            warn_on_rank_zero(
                f"{cls.__qualname__} lists LightningModule before ViTBalanceMixin in its bases, so "
                f"LightningModule's {', '.join(shadowed)} run instead of the mixin's: plan_ahead plans "
                "nothing, checkpoints lose the calibrate_cost fit, a fit's end keeps its gloo twin, a "
                "drop-in tower's steps of text alone step it with zero gradients and vit_balance_predict "
                "balances nothing. "
                f"List ViTBalanceMixin first: class {cls.__name__}(ViTBalanceMixin, LightningModule).",
                UserWarning,
            )

    def _vit_balance_state_object(self) -> _State:
        state = self.__dict__.get("_vit_balance_state")
        if state is None:
            state = _State()
            # Plain attribute: nn.Module.__setattr__ registers no module, parameter or buffer here.
            object.__setattr__(self, "_vit_balance_state", state)
        return state

    def resolved_vit_balance_config(self) -> ViTBalanceConfig:
        """The module's ``vit_balance_config`` attribute, ``ViTBalanceConfig()`` when absent.

        A mapping (e.g. hyperparameters loaded back as a dict) is turned into the dataclass.
        """
        config = getattr(self, "vit_balance_config", None)
        if config is None:
            return ViTBalanceConfig()
        if isinstance(config, ViTBalanceConfig):
            return config
        if isinstance(config, Mapping):  # a dict, or a config system's mapping (OmegaConf's DictConfig)
            fields = [field.name for field in dataclasses.fields(ViTBalanceConfig)]
            unknown = sorted(str(key) for key in config if key not in fields)
            if unknown:
                raise ValueError(
                    f"{type(self).__name__}.vit_balance_config has unknown fields {unknown}: expected "
                    f"fields among {sorted(fields)}."
                )
            return ViTBalanceConfig(**dict(config))
        raise TypeError(
            f"{type(self).__name__}.vit_balance_config={config!r} is invalid: expected a "
            f"ViTBalanceConfig, a mapping of its fields, or None."
        )

    def _vit_balance_runner(self) -> tuple[Any, Any]:
        """(trainer, fabric) this module is attached to; ``None`` for what it is not."""
        fabric = self.__dict__.get("_fabric")
        if fabric is not None:
            return None, fabric
        return self.__dict__.get("_trainer"), None

    def configure_vit_balance_group(self) -> dist.ProcessGroup | None:
        """The process group to balance over; ``None`` calls the ViT directly.

        Called once per fit, and again where the attribute ``vit_balance_group`` is set to another
        group or the default process group is initialised anew (without a Trainer or Fabric, nothing
        else marks a run). The default returns the attribute ``vit_balance_group`` when it is set,
        else :func:`~lightning_vit_balance.dp_group_from_strategy` of the Trainer's (or Fabric's)
        strategy, else ``None`` (not attached to either). Override it, or set
        ``vit_balance_group``, for strategies the adapter does not know. Prefer the override
        when the module is copied or pickled (``ddp_spawn``): a process group does not pickle.
        """
        group = getattr(self, "vit_balance_group", None)
        if group is not None:
            return group
        trainer, fabric = self._vit_balance_runner()
        runner = fabric if fabric is not None else trainer
        if runner is None:
            return None
        return dp_group_from_strategy(runner.strategy)

    def _vit_balance_run_key(self) -> _RunKey:
        """What marks the run of processes this module runs in now (see :func:`_same_run`)."""
        trainer, fabric = self._vit_balance_runner()
        runner = fabric if fabric is not None else trainer
        strategy = None if runner is None else runner.strategy
        # Lightning wraps the module anew (DDP, FSDP, DeepSpeed engine) at every fit, so the
        # wrapper's identity marks a new fit; the runner and strategy mark a new Trainer.
        model = getattr(strategy, "model", None) if trainer is not None else None
        # The group set on the module and the default group mark a run too: without a Trainer or
        # Fabric nothing else does (a group set anew, a default group destroyed and made again).
        chosen = getattr(self, "vit_balance_group", None)
        return (_ref(runner), _ref(strategy), _ref(model), _ref(chosen), _ref(current_group()))

    def _vit_balance_refresh(self, state: _State) -> None:
        key = self._vit_balance_run_key()
        if _same_run(state.fit_key, key):
            return
        trainer, _ = self._vit_balance_runner()
        group = self.configure_vit_balance_group()
        size = 1
        if group is not None and dist.is_available() and dist.is_initialized():
            require_member(group, "configure_vit_balance_group() (or vit_balance_group)")
            size = dist.get_world_size(group)
        state.fit_key = key
        state.fit_entry = _entry_point(trainer)
        state.group = group
        state.group_size = size
        state.epoch_lengths = state.predict_lengths = None
        release_host_group(state.host_group)  # a run that ended without its teardown (an exception)
        _release_ended_runs(state, trainer)
        state.host_group = owned_host_group(group, state) if group is not None else None
        if state.host_group is not None:
            _TWIN_HOLDERS.add(state)
        state.records = collections.deque(maxlen=KEPT_STATS)
        if state.carried is None:
            state.carried = state.balancer_state()
        state.forget_balancers()
        running = self._vit_balance_running_module()
        if running is not self and isinstance(running, ViTBalanceMixin):
            running._vit_balance_state_object().nested[self] = None

    @eager_frame
    def encode_images(
        self,
        vit: Any,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        output_layout: OutputLayout | Mapping[str, str] | None = None,
    ) -> Any:
        """Run ``vit(pixel_values, grid_thw)``, balanced across the data-parallel ranks.

        Balances when ``vit_balance_config.enabled``, the group from
        :meth:`configure_vit_balance_group` has more than one rank, and the running Lightning loop
        makes the same calls on every rank: the training step, validation and test steps on
        ``DistributedSampler`` loaders, and with :attr:`vit_balance_predict` the predict step in
        the batches every rank runs (see the class docstring); without a Trainer (Fabric), in
        train mode, and in eval mode with :attr:`vit_balance_evaluation` or a sharded ``vit``.
        Calls the ViT directly otherwise (one device, balancing disabled, other predict calls,
        uneven evaluation loaders, other hooks, a rank evaluating alone). Where it balances,
        every rank of the group must call it the same number of times, as with any collective.

        Args:
            vit: Called as ``vit(pixel_values, grid_thw)``; returns a tensor, tuple/list, dict or
                Hugging Face ``ModelOutput``.
            pixel_values: ``[sum(T*H*W), C]`` patch rows of this rank's images.
            grid_thw: ``[n_images, 3]`` ``(T, H, W)`` of each image.
            output_layout: Kinds of the ViT's outputs where their rows do not tell, and its merge
                size where it declares none (see :class:`~lightning_vit_balance.OutputLayout`):
                ``{"pooled": "image"}`` for an output with a row per image. The same on every rank.

        Returns:
            The same structure and values as ``vit(pixel_values, grid_thw)`` on this rank.

        In a compiled step (``trainer.fit(torch.compile(model))``) the balanced call runs eagerly,
        a graph break, and calls ``vit`` as it is passed; a direct call is compiled with the step.
        """
        layout = OutputLayout.of(output_layout)
        settings = self._vit_balance_settings(vit)
        if settings is None:  # compiled with the module when it is
            output = vit(pixel_values, grid_thw)
            self._vit_balance_keep_direct(vit, ((pixel_values, grid_thw),))
            return without_dropped(output, layout)
        return self._vit_balance_call(
            settings,
            lambda balancer, ticket: balancer(vit, pixel_values, grid_thw, prepared=ticket),
            layout,
            vit,
        )

    @eager
    def _vit_balance_call(
        self,
        settings: tuple[ViTBalanceConfig, Any],
        encode: Callable[..., Any],
        layout: OutputLayout | None = None,
        tower: object = None,
    ) -> Any:
        """``encode(balancer, prepared_plan)``, the balanced call of :meth:`encode_images` or
        :meth:`encode_visual` on ``tower``, by the balancer of ``layout``: eager in a compiled module."""
        balancer = self._vit_balance_balancer(*settings, layout, tower)
        ticket = self._vit_balance_take_ticket()
        if ticket is not None:  # the tower the next plan made ahead is likely made for
            self._vit_balance_state_object().planned_tower = _ref(tower)
        output = encode(balancer, ticket)
        if not in_backward_pass():  # a recomputation is its forward call again
            self._vit_balance_keep(balancer.last_stats)
        return output

    @eager
    def _vit_balance_settings(
        self, vit: object = None, *, ahead: bool = False
    ) -> tuple[ViTBalanceConfig, Any] | None:
        """``(config, group)`` when a call of ``vit`` should balance (as :meth:`encode_images`
        decides), else None. ``ahead``: for a plan made before the step (in
        ``on_before_batch_transfer``), for the step's calls."""
        found = self._vit_balance_in_loop(vit, ahead)
        if found is None:
            return None
        config, state = found
        if state.group is None or state.group_size < 2:
            return None
        return config, state.group

    def _vit_balance_in_loop(self, vit: object, ahead: bool) -> tuple[ViTBalanceConfig, _State] | None:
        """The configuration and this run's state (its group looked up) where balancing is on and
        the running loop makes such a call on every rank, whatever the group's size; else None."""
        config = self.resolved_vit_balance_config()
        if not config.enabled or not self._vit_balance_loop_balances(vit, ahead):
            return None
        state = self._vit_balance_state_object()
        self._vit_balance_refresh(state)
        return config, state

    def _vit_balance_loop_balances(self, vit: object, ahead: bool) -> bool:
        """Whether every rank makes this call of ``vit`` (or, ``ahead``, the step's calls)."""
        trainer, _ = self._vit_balance_runner()
        if trainer is not None:
            state = self._vit_balance_state_object()
            lengths = state.epoch_lengths
            # A nested module's predict batches are its running module's, which gathered them.
            running = self._vit_balance_running_module()
            owner = running if isinstance(running, ViTBalanceMixin) else self
            balances = _loop_balances(trainer, lengths, owner._vit_balance_state_object().predict_lengths)
            cause = _own_clock(trainer, lengths) if not balances and trainer.validating else None
            if cause is not None:
                self._vit_balance_tell_own_clock(cause)
            return balances and (ahead or self._vit_balance_in_step() or _sharded(vit))
        training = bool(getattr(self, "training", True))
        evaluation = require_flag(
            type(self).__name__, "vit_balance_evaluation", self.vit_balance_evaluation, attribute=True
        )
        return _own_loop_balances(training, evaluation, vit)

    def _vit_balance_tell_own_clock(self, cause: str) -> None:
        state = self._vit_balance_state_object()
        if state.told_own_clock:
            return
        state.told_own_clock = True
        rank_zero_warn(
            f"{cause}, so ranks validate after different training batches, and a balanced "
            "validation call would wait for ranks still training. This fit's validation encodes "
            "directly (its training still balances); to balance it, validate every N batches of the "
            "fit: val_check_interval=N with check_val_every_n_epoch=None.",
            category=UserWarning,
        )

    def _vit_balance_balancer(
        self, config: ViTBalanceConfig, group: Any, layout: OutputLayout | None = None, tower: object = None
    ) -> ViTBalancer:
        """The module's balancer for this fit, configuration and output layout (its verbose lines
        go through ``rank_zero_info``), kept for the fit's later calls with them: a step may call
        towers of other layouts or configurations (a drop-in tower and :meth:`encode_images`), and
        each balancer's clocks and cost fit go on from its own last call. One for a configuration not
        seen yet goes on from the latest one's cost fit and clocks where that one was taken for the
        same ``tower`` (as one balancer whose configuration changes: a schedule of configurations
        keeps fitting), else from its cost fit as saved (or a loaded checkpoint's): another tower's
        clock would report that tower's time as this one's.
        ``layout``: a drop-in tower's (:attr:`BalancedVisionTower.output_layout`), or the one
        :meth:`encode_images` or :meth:`encode_visual` is given."""
        state = self._vit_balance_state_object()
        host = gathers_on(state.host_group if group is state.group else None, group)
        trainer = self._vit_balance_runner()[0] if state.epoch_lengths is None else None
        if trainer is not None and _training_data_set_up(trainer):
            # Every rank's first balanced training call or plan of the fit's loop: its first batch.
            state.epoch_lengths = _epoch_lengths(trainer, host)
        balancer = state.kept_balancer(config, layout)
        if balancer is None:
            self._vit_balance_refuse_peer_fits(config)
            latest = state.balancer
            balancer = ViTBalancer(
                config, group, report=rank_zero_info, host_group=host, output_layout=layout
            )
            known = tower is not None and state.latest_tower is not None
            same_tower = latest is not None and known and state.latest_tower() is tower
            live = same_tower and balancer._go_on_from(latest, self._vit_balance_loop_name())
            # The saved state (its window's rows as plain numbers) only where the fit goes on from it.
            carried = None if live else state.balancer_state()
            state.keep_balancer(config, layout, balancer)
            state.carried = None
            if carried:
                source = "ViTBalanceMixin: the saved balancer state (from a checkpoint or an earlier run)"
                continue_fit(balancer.load_state_dict, carried, source, rank_zero_warn)
        state.latest_tower = _ref(tower)
        balancer.measure_as(self._vit_balance_loop_name())
        return balancer

    def _vit_balance_loop_name(self) -> str:
        """The loop a call belongs to, the same on every rank: the Trainer's stage (training,
        validation, its sanity check, test), or without a Trainer the module's mode. Each measures
        its calls apart (:meth:`ViTBalancer.measure_as`), so that a training step after a
        validation does not report the validation's ViT time as its own."""
        trainer = self._vit_balance_runner()[0]
        stage = getattr(getattr(trainer, "state", None), "stage", None)
        if stage is not None:
            return str(stage.value)
        return "train" if getattr(self, "training", True) else "eval"

    def _vit_balance_refuse_peer_fits(self, config: ViTBalanceConfig) -> None:
        """Refuse the online cost fit where tensor-parallel peers balance in different groups.

        Each data-parallel group would fit its own model from its own ranks' measured times, so
        peers, which hold the same images, would plan apart: a tensor-parallel ViT then mixes or
        mismatches their rows. Raised on every rank alike (one configuration, one mesh)."""
        if not config.calibrate_cost:
            return
        trainer, fabric = self._vit_balance_runner()
        runner = fabric if fabric is not None else trainer
        peers = tensor_parallel_size(runner.strategy) if runner is not None else 1
        if peers > 1:
            raise ValueError(
                f"ViTBalanceConfig.calibrate_cost=True with a tensor_parallel mesh dimension of size "
                f"{peers}: each data-parallel group would fit its own cost model from its own measured "
                "times, and tensor-parallel peers, which hold the same images, would then plan apart. "
                "Expected calibrate_cost=False with tensor parallelism; for a fitted model, fit it "
                "offline (CostModel.fit on measured timings) and give it to the config "
                "(CostModel.to_config)."
            )

    def _vit_balance_in_step(self) -> bool:
        """Whether the Trainer runs one of the loops' steps now (not another hook), or recomputes a
        training step's call in its backward pass (activation checkpointing, within the
        ``backward`` hook), which must be balanced as that call was."""
        running = self._vit_balance_running_module()
        if running is not self and not isinstance(running, ViTBalanceMixin):
            self._vit_balance_tell_plain_parent(running)
            return False
        # A Lightning without that attribute: every call counts as the step's, as before the rule.
        return getattr(running, "_current_fx_name", "training_step") in _STEP_HOOKS or in_backward_pass()

    def _vit_balance_tell_plain_parent(self, running: Any) -> None:
        """Nested in a Trainer's module without the mixin, a module's calls encode directly: that
        module's hooks would neither drain, check nor release what this one's balancing holds."""
        state = self._vit_balance_state_object()
        if not state.told_plain_parent:
            state.told_plain_parent = True
            rank_zero_warn(
                f"{type(self).__name__} (with ViTBalanceMixin) is nested in {type(running).__name__}, the "
                f"Trainer's module, which does not use ViTBalanceMixin: {type(self).__name__}'s ViT calls "
                f"encode directly, unbalanced. Mix ViTBalanceMixin into {type(running).__name__} to "
                "balance them.",
                category=UserWarning,
            )

    def _vit_balance_running_module(self) -> Any:
        """The module whose hooks the Trainer runs: this one, or the one this module is nested in
        (Lightning attaches its Trainer to child LightningModules, a teacher held by the trained
        module, but names the running hook, and calls the hooks, on the Trainer's module only)."""
        trainer, _ = self._vit_balance_runner()
        running = getattr(getattr(trainer, "strategy", None), "lightning_module", None)
        return running if isinstance(running, LightningModule) else self

    def _vit_balance_take_ticket(self) -> PreparedPlan | None:
        """The plan prepared for this batch, once: the step's first balanced call uses it.

        Under a Trainer, only a call from the step takes it: a sharded ViT's call from another hook
        (a callback generating samples after a validation step that encoded nothing) is not the
        batch the plan was made for."""
        trainer, _ = self._vit_balance_runner()
        if in_backward_pass() or (trainer is not None and not self._vit_balance_in_step()):
            return None  # a recomputation plans as its forward call did (see recompute.py)
        state = self._vit_balance_state_object()
        ticket, state.ticket = state.ticket, None
        if not (state.planned_ahead or state.told_unplanned) and trainer is not None:
            state.told_unplanned = self._vit_balance_tell_unplanned(trainer)
        if ticket is not None and trainer is not None and state.ticket_batch != _loop_batch(trainer):
            # Made for another batch, whose step did not take it: this step's batch had no
            # on_before_batch_transfer (a step taking `dataloader_iter`). Planned in the call, on
            # every rank alike (they run the same loops).
            return None
        return ticket

    def _vit_balance_ticket_waiting(self) -> bool:
        """Whether a plan made ahead from a batch the drop-in's collator made waits for this step
        (what :meth:`_vit_balance_take_ticket` would give a call of the step): not one made from
        another batch, such as the outer batch of several loaders'. Decided from what every rank's
        loader gives alike, not from the forward's own batch (a forward that plans on some ranks
        only would wait in the gather): a forward of another batch then raises at its plan."""
        state = self._vit_balance_state_object()
        if state.ticket is None or not state.ticket_collated:
            return False
        trainer, _ = self._vit_balance_runner()
        return trainer is None or state.ticket_batch == _loop_batch(trainer)

    def _vit_balance_keep_ticket(self, ticket: PreparedPlan | None, collated: bool = False) -> None:
        """Keep ``ticket`` for the step that encodes the batch it was made for: under a Trainer, the
        loop's batch at hand (moving to the device, or in its step); only that batch's step takes it.
        ``collated``: whether that batch carried the drop-in's collator's grids."""
        state = self._vit_balance_state_object()
        state.ticket = ticket
        state.ticket_collated = collated
        state.planned_ahead = True
        trainer, _ = self._vit_balance_runner()
        state.ticket_batch = _loop_batch(trainer) if trainer is not None else None

    def _vit_balance_tell_unplanned(self, trainer: Any) -> bool:
        """With ``plan_ahead`` and no plan made yet, tell why no plan is made ahead (the steps then
        plan in their calls): the datamodule defines ``on_before_batch_transfer``, which Lightning
        calls instead of the module's, which plans; or the module's never ran for a training batch
        (an override that does not call ``super()``). False: look again at a later step (a
        validation step that takes ``dataloader_iter``, in the sanity check, gets no hook)."""
        if not self.resolved_vit_balance_config().plan_ahead:
            return True
        running = self._vit_balance_running_module()
        if running is not self:
            rank_zero_warn(
                f"ViTBalanceConfig.plan_ahead=True in {type(self).__name__}, which is nested in "
                f"{type(running).__name__}: Lightning runs the batch hooks of the Trainer's module only, "
                f"so {type(self).__name__}'s calls plan in the forward. To plan them ahead, make them "
                f"through the encode_images of {type(running).__name__} (with ViTBalanceMixin and "
                "plan_ahead in its configuration), e.g. self.encode_images(self.teacher.visual, "
                "pixel_values, grid_thw).",
                category=UserWarning,
            )
            return True
        datamodule = getattr(trainer, "datamodule", None)
        if is_overridden("on_before_batch_transfer", datamodule, parent=LightningDataModule):
            rank_zero_warn(
                f"ViTBalanceConfig.plan_ahead=True, but {type(datamodule).__name__} defines "
                "on_before_batch_transfer, which Lightning calls instead of the module's, so no plan is "
                "made ahead and each step plans in its call. Plan there: "
                "self.trainer.lightning_module.prepare_vit_balance(batch).",
                category=UserWarning,
            )
            return True
        if not trainer.training:
            return False
        if not self._vit_balance_state_object().batch_hook_ran:
            rank_zero_warn(
                f"ViTBalanceConfig.plan_ahead=True, but ViTBalanceMixin.on_before_batch_transfer "
                f"has not run for this step's batch, so no plan is made ahead and each step plans "
                f"in its call: an override in {type(self).__name__} must call "
                "super().on_before_batch_transfer(batch, dataloader_idx) (a step that takes "
                "dataloader_iter gets no such hook).",
                category=UserWarning,
            )
        return True

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With ``plan_ahead``, plan the batch's ViT call while it is still on the host.

        In the loops whose steps balance (training; validation, its sanity check and test on
        ``DistributedSampler`` loaders), every rank gathers its batch's grid rows (for the keys in
        :attr:`vit_balance_prepare_keys`, images then videos) and computes the plan here, before
        the batch moves to the device, so the step's first balanced call (``encode_images``,
        ``encode_visual`` or a model given to :meth:`balance_vision_tower`) makes no metadata
        gather, no device-to-host sync and no plan. That call must encode exactly those rows
        (images followed by videos); anything else fails with a clear error, on every rank where
        the plan moves images (or with ``check_skipped_calls``), else on that rank.
        The mixin must come before ``LightningModule`` in the bases for this hook to run; an
        override of the hook must call ``super().on_before_batch_transfer``.
        """
        parent = getattr(super(), "on_before_batch_transfer", None)
        if parent is not None:
            batch = parent(batch, dataloader_idx)
        self._vit_balance_plan_ahead(batch)
        return batch

    def on_predict_start(self) -> None:
        """With :attr:`vit_balance_predict`, gather every rank's predict batch counts, which tell
        the batches every rank runs: here rather than in a batch hook, which a datamodule's
        ``on_before_batch_transfer`` replaces. An override of the hook must call
        ``super().on_predict_start``."""
        parent = getattr(super(), "on_predict_start", None)
        if parent is not None:
            parent()
        trainer = self._vit_balance_runner()[0]
        if trainer is not None and trainer.predicting:
            self._vit_balance_gather_predict_lengths(trainer)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Before each optimizer step: where no rank had images in the step, unset the gradients
        the drop-in gave the towers of models given to :meth:`balance_vision_tower`, as the plain
        model leaves them (:meth:`BalancedVisionTower.drop_text_only_grads`, which the drop-in also
        runs at the step itself where no hook did, as in a Fabric loop). An override of the hook
        must call ``super().on_before_optimizer_step``."""
        for handle in self._vit_balance_towers:
            handle.drop_text_only_grads()
        parent = getattr(super(), "on_before_optimizer_step", None)
        if parent is not None:
            parent(optimizer)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the balancer's state in the checkpoint under ``"vit_balance"``: with
        ``calibrate_cost``, the online cost fit, so a fit resumed from it plans with the fitted
        model from its first step. Modules with the mixin nested in this one (a teacher), whose
        checkpoint hooks Lightning does not call, keep theirs under ``"vit_balance_nested"``, by
        their names here. An override of the hook must call ``super().on_save_checkpoint``.
        """
        parent = getattr(super(), "on_save_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        saved = self.vit_balance_state_dict()
        if saved:
            checkpoint[CHECKPOINT_KEY] = saved
        mixed = (
            (name, m) for name, m in self.named_modules() if isinstance(m, ViTBalanceMixin) and m is not self
        )
        nested = {name: state for name, module in mixed if (state := module.vit_balance_state_dict())}
        if nested:
            checkpoint[NESTED_CHECKPOINT_KEY] = nested

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Take the balancer's state from a checkpoint (see :meth:`on_save_checkpoint`); the run's
        balancer starts from it. An override of the hook must call ``super().on_load_checkpoint``.
        """
        parent = getattr(super(), "on_load_checkpoint", None)
        if parent is not None:
            parent(checkpoint)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is not None:
            source = f"The checkpoint's {CHECKPOINT_KEY!r} entry"
            continue_fit(self.load_vit_balance_state_dict, saved, source, rank_zero_warn)
        modules = dict(self.named_modules())
        for name, nested in dict(checkpoint.get(NESTED_CHECKPOINT_KEY) or {}).items():
            source = f"The checkpoint's {NESTED_CHECKPOINT_KEY!r} entry {name!r}"
            module = modules.get(name)
            if not isinstance(module, ViTBalanceMixin) or module is self:
                rank_zero_warn(f"{source} is not used (no module with ViTBalanceMixin of that name here).")
                continue
            continue_fit(module.load_vit_balance_state_dict, nested, source, rank_zero_warn)

    def vit_balance_state_dict(self) -> dict[str, Any]:
        """The balancer's state as plain values (with ``calibrate_cost``, the online cost fit; empty
        without one), the same on every rank.

        The Trainer keeps it in its checkpoints itself (:meth:`on_save_checkpoint`). A loop without
        a Trainer keeps it next to the model and hands it back with
        :meth:`load_vit_balance_state_dict`; under Fabric::

            fabric.save(path, {"model": model, "vit_balance": module.vit_balance_state_dict()})
        """
        state = self.__dict__.get("_vit_balance_state")
        saved = state.balancer_state() if state is not None else None
        return dict(saved) if saved else {}

    def load_vit_balance_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a :meth:`vit_balance_state_dict`: the next balanced call's balancer starts from
        it. Call it on every rank before the next balanced call; under Fabric::

            remainder = fabric.load(path, {"model": model})
            module.load_vit_balance_state_dict(remainder["vit_balance"])

        Raises:
            ValueError: ``state`` is not a mapping of the balancer's state keys only.
        """
        carried = checked_state(state, "ViTBalanceMixin.load_vit_balance_state_dict")
        module_state = self._vit_balance_state_object()
        module_state.carried = carried
        module_state.forget_balancers()

    def teardown(self, stage: str) -> None:
        """At the end of a fit, validate, test or predict run: report what its last calls left to
        report (:meth:`check_vit_balance_pending`) and let go of that run's process groups.

        The balancer and the groups it holds belong to one run of processes (the next run makes
        its own). Holding them past the run kept the gloo process group alive until the interpreter
        shut down in ``ddp_spawn`` workers, where tearing it down at that point aborted a worker
        now and then ("terminate called without an active exception"). The last stats stay
        readable. An override of the hook must call ``super().teardown``.
        """
        state = self.__dict__.get("_vit_balance_state")
        if state is not None:
            # The Trainer tears down its module only: nested ones (a teacher) end with it.
            modules = [*state.nested, self]
            try:
                for module in modules:
                    if module._vit_balance_run_ends(module._vit_balance_state_object()):
                        module.check_vit_balance_pending()
            finally:
                for module in modules:
                    module._vit_balance_state_object().release()
        parent = getattr(super(), "teardown", None)
        if parent is not None:
            parent(stage)

    def _vit_balance_run_ends(self, state: _State) -> bool:
        """Whether the run whose teardown this is made the state's balancer.

        Lightning tears down after a run every rank ended, not after one that raised: a later run
        that balances nothing (predict, unless :attr:`vit_balance_predict`) would find that run's
        balancer here. The run key's wrapper cannot tell them apart, as the strategy unwraps the
        fit's module (DDP) before the module's teardown; the runner, its strategy and the entry
        point can.
        """
        if state.fit_key is None:
            return False
        trainer, _ = self._vit_balance_runner()
        same_runner = _same_run(state.fit_key[:2], self._vit_balance_run_key()[:2])
        return same_runner and state.fit_entry == _entry_point(trainer)

    def check_vit_balance_pending(self) -> None:
        """Where plans were made ahead, report what the run's last balanced calls left for a next
        call's gather (see :meth:`ViTBalancer.check_pending`): a call whose grid values, compared on
        the device, differed from its plan's. Collective: call it on every rank at the end of a loop
        that plans ahead without a Trainer (Fabric); under a Trainer the mixin calls it when a run
        ends. Nothing to do where no call took a plan made ahead since the last check.

        Raises:
            ValueError: On every rank, when a rank's call did not match the plan made for it.
        """
        state = self._vit_balance_state_object()
        if state.balancer is not None:
            state.balancer.check_pending()

    #: Without a Trainer (Fabric, or ``vit_balance_group`` set on a plain module): balance calls
    #: made with the module in eval mode too. Set it when every rank makes the same evaluation
    #: calls (a loader from ``fabric.setup_dataloaders``, whose sampler pads); unset, they encode
    #: directly, so a rank may evaluate alone, except where the ViT's parameters are sharded (FSDP,
    #: ZeRO-3), whose calls are collectives anyway. Under a Trainer its loops decide.
    vit_balance_evaluation: bool = False

    #: Under a Trainer: balance ``predict_step``'s calls in the batches every rank runs. Off by
    #: default: nothing else in a predict run makes its ranks meet, so each goes through its own
    #: batches at its own pace and only its total counts, while a balanced call makes them meet
    #: at every batch. Set it where they meet at every batch anyway: the ViT's or the model's
    #: parameters sharded (FSDP, ZeRO-3), a collective of your own in the step.
    vit_balance_predict: bool = False

    #: ``(pixel key, grid key)`` pairs of a batch that the step's balanced call encodes, in order.
    vit_balance_prepare_keys: tuple[tuple[str, str], ...] = (
        ("pixel_values", "image_grid_thw"),
        ("pixel_values_videos", "video_grid_thw"),
    )

    #: The drop-in handles :meth:`balance_vision_tower` made, held weakly (see :class:`_TowerRefs`).
    _vit_balance_tower_refs: _TowerRefs = _TowerRefs()

    @property
    def _vit_balance_towers(self) -> tuple[BalancedVisionTower, ...]:
        """The drop-in handles :meth:`balance_vision_tower` made that still balance a model: a plan
        made ahead is made for the rows their forwards pass the tower (video steps, dtype)."""
        return self._vit_balance_tower_refs.live()

    def prepare_vit_balance(self, batch: Any) -> PreparedPlan | None:
        """Plan the step's first balanced call from ``batch`` while it is still on the host.

        Under a Trainer, ``plan_ahead`` does this in :meth:`on_before_batch_transfer`. In a loop
        without one (Fabric), call it on every rank with each batch before it moves to the device
        (``fabric.setup_dataloaders(loader, move_to_device=False)``, then ``fabric.to_device(batch)``):
        the step's first balanced call (:meth:`encode_images` when :attr:`vit_balance_prepare_keys`
        name only images, :meth:`encode_visual`, or a model given to :meth:`balance_vision_tower`)
        then makes no metadata gather and no device-to-host sync. In eval mode that is with
        :attr:`vit_balance_evaluation` set (and, for a drop-in, a tower balancing evaluation).

        Returns:
            The plan, or None where the step's calls do not balance (a batch no loop runs, an
            example input for an export, say; eval mode without
            :attr:`vit_balance_evaluation`, one rank, balancing disabled): that step plans nothing.
        """
        refuse_in_a_loader_worker("prepare_vit_balance")
        if not self._vit_balance_plan_ahead(batch, asked=True):
            return None
        return self._vit_balance_state_object().ticket

    def _vit_balance_plan_ahead(self, batch: Any, asked: bool = False) -> bool:
        """Plan ``batch``'s step, where its loop balances; False (the kept plan untouched) for a
        batch that is no loop's: an example input, on one rank maybe (an export, a graph)."""
        trainer, _ = self._vit_balance_runner()
        if trainer is not None and not _moving_a_loop_batch():
            return False
        state = self._vit_balance_state_object()
        state.ticket = None
        state.batch_hook_ran = True
        settings = self._vit_balance_settings(ahead=True)
        wanted = settings is not None and (asked or settings[0].plan_ahead)
        if not wanted or not self._vit_balance_towers_balance():
            return True
        towers = self._vit_balance_towers
        keys = _prepare_keys(type(self).__name__, self.vit_balance_prepare_keys)
        # A batch that is not a mapping holds no keys to read: planned as one without images (a
        # step that encodes none works), named in the error of a call that encodes some.
        readable = isinstance(batch, Mapping)
        pixels, grid = rows_to_plan(batch if readable else {}, keys, towers)
        # The tower the plan is made for: the drop-in's, or the one the last plan made ahead went to.
        planned = state.planned_tower() if not towers and state.planned_tower is not None else None
        only = towers[0].tower if len(towers) == 1 else planned
        balancer = self._vit_balance_balancer(*self._vit_balance_towers_settings(settings), only)
        made_from = f"the plan was made ahead from the batch's {key_names(keys)} (vit_balance_prepare_keys)"
        try:
            ticket = balancer.prepare(pixels, grid)
        except ValueError as error:  # raised alike on every rank: each adds the same keys
            held = _some_keys(batch) if readable else f"a {type(batch).__name__}"
            # Only where the batch is at fault: settings that differ between ranks are not its doing.
            if str(error).startswith(INVALID_INPUT) and hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"{made_from[0].upper()}{made_from[1:]}. The batch on this rank holds {held}.")
            raise
        for tower in towers:  # their step grids (GLM-4.xV) from these rows, not read on the device
            tower._keep_host_rows(batch)
        if ticket is not None:
            # Named in the call's mismatch errors: the user never handled this plan themselves.
            source = made_from
            if not readable:
                source = f"{unreadable_batch(batch, keys)}; so it was planned without images"
            elif not any(key in batch for pair in keys for key in pair):
                source = (
                    f"{source}; the batch holds none of them, only {_some_keys(batch)}, so it was planned "
                    "without images (where the pixels sit deeper, under a key of their own (a nested "
                    "dict, the batch of one loader among several): plan_ahead=False and "
                    "self.prepare_vit_balance(batch[key]) in on_before_batch_transfer, or flatten the "
                    "batch; for one call over several loaders' batches, encode_visual's images and "
                    "videos say, prepare one mapping holding the keys of each)"
                )
            ticket = dataclasses.replace(ticket, source=source)
        self._vit_balance_keep_ticket(ticket, readable and batch.get(GRIDS_KEY) is not None)
        return True

    def _vit_balance_gather_predict_lengths(self, trainer: Any) -> None:
        """At a predict run's start, which every rank reaches: gather every rank's batch count of
        each dataloader, which tell the batches every rank runs (see :func:`_predict_balances`).
        One small host gather per predict run, with :attr:`vit_balance_predict` set and where the
        run can balance."""
        state = self._vit_balance_state_object()
        state.predict_lengths = None
        predict = require_flag(
            type(self).__name__, "vit_balance_predict", self.vit_balance_predict, attribute=True
        )
        if not predict or not self.resolved_vit_balance_config().enabled:
            return
        combined = _predict_loaders(trainer)
        if combined is None:
            return
        self._vit_balance_refresh(state)
        if state.group is None or state.group_size < 2:
            return
        rows = _gathered_batch_counts(trainer.num_predict_batches, gathers_on(state.host_group, state.group))
        state.predict_lengths = _PredictLengths(weakref.ref(combined), rows)

    def _vit_balance_towers_settings(
        self, settings: tuple[ViTBalanceConfig, Any]
    ) -> tuple[ViTBalanceConfig, Any, OutputLayout | None]:
        """The configuration, group and output layout of the balancer the step's drop-in calls
        take, so that they find the plan made ahead by their own balancer, priced as they price:
        the towers' configuration (:meth:`_ModuleTowerBalance.balancing_config`) and output layout,
        each where they share one."""
        towers = self._vit_balance_towers
        config, group = settings
        shared_config = _shared([tower.balancing_config(config) for tower in towers])
        return shared_config or config, group, _shared([tower.output_layout for tower in towers])

    def _vit_balance_towers_balance(self) -> bool:
        """Whether the step's drop-in forwards balance, as far as the towers decide: in evaluation,
        only towers given to :meth:`balance_vision_tower` with ``evaluation=True`` do. A module
        without towers (``encode_images``) leaves it to the loop."""
        trainer, _ = self._vit_balance_runner()
        training = trainer.training if trainer is not None else bool(getattr(self, "training", True))
        towers = self._vit_balance_towers
        return training or not towers or any(tower.evaluation for tower in towers)

    @eager
    def _vit_balance_keep_direct(
        self, vit: object, parts: tuple[tuple[Any, Any], ...], pricing: ViTBalanceConfig | None = None
    ) -> None:
        """Record a call made directly because the group has one rank (one device), in a loop that
        would balance it, as the engine records its own ``"single-rank"`` calls: the callback then
        logs the same keys (imbalance 0, nothing moved) on one device as on many, so monitors of
        them work there too. ``parts``: the call's ``(pixel_values, grid_thw)`` per modality;
        ``pricing``: the configuration its balanced calls would take, where not the module's."""
        found = None if in_backward_pass() else self._vit_balance_in_loop(vit, False)
        if found is None:  # not a call that would balance (a recomputation is its forward's again)
            return
        config, state = found
        distributed = dist.is_available() and dist.is_initialized()
        ranks = state.group_size if state.group is not None else (dist.get_world_size() if distributed else 1)
        if ranks > 1:
            # Many ranks: the call was direct for another reason (configure_vit_balance_group gave
            # no group: balancing turned off), recorded by none, as before.
            return
        self._vit_balance_keep(direct_call_stats(pricing or config, parts))

    def _vit_balance_keep(self, stats: BalanceStats | None) -> None:
        state = self._vit_balance_state_object()
        state.last_stats = stats
        if stats is not None and self._vit_balance_drained():
            state.records.append(stats)

    def _vit_balance_drained(self) -> bool:
        """Whether a reader drains the queued records: under a Trainer, a ViTBalanceCallback among
        its callbacks now (asked at every call: Lightning's LearningRateFinder and BatchSizeFinder
        run their search steps with the callbacks set aside, then the same fit goes on with them);
        without one (Fabric), the loop's own reader (BalanceMetrics), the latest KEPT_STATS at most."""
        trainer, _ = self._vit_balance_runner()
        return trainer is None or any(isinstance(cb, ViTBalanceCallback) for cb in trainer.callbacks)

    def balance_vision_tower(self, model: torch.nn.Module, *, evaluation: bool = True) -> BalancedVisionTower:
        """Balance a Hugging Face Qwen-VL or GLM-4.xV model's vision tower.

        Call it in ``__init__`` or ``configure_model()`` (calling it again for the same model returns
        the same handle); ``model(**batch)`` in ``training_step`` is then balanced, one exchange per
        forward for a rank's images and videos together, text-only ranks included, with the group
        and configuration :meth:`encode_images` uses. :class:`ViTBalanceCallback` logs the stats.
        With ``evaluation``, so is ``model(**batch)`` in ``validation_step``, ``test_step`` and
        ``predict_step`` where :meth:`encode_images` balances (every dataloader of the loop with a
        ``DistributedSampler``; in predict, with :attr:`vit_balance_predict`), which FSDP and ZeRO-3
        need when ranks differ in modalities; there, with the tower's parameters sharded, so is
        ``generate()``'s image encoding (call it on every rank with ``synced_gpus=True``, as
        sharding requires anyway). Otherwise ``generate()`` calls the tower directly. See
        :func:`~lightning_vit_balance.balance_vision_tower`.

        Example::

            class Finetune(ViTBalanceMixin, L.LightningModule):
                def __init__(self):
                    super().__init__()
                    self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(...)
                    self.balance_vision_tower(self.model)

                def training_step(self, batch, batch_idx):
                    return self.model(**batch).loss

        Returns:
            The handle (``last_stats``, ``calls``, ``applied_calls``, ``remove()``).
        """
        existing = BalancedVisionTower.of(model)
        if isinstance(existing, _ModuleTowerBalance) and existing.module is self:
            existing.evaluation = evaluation
            return existing
        handle = _ModuleTowerBalance(model, self, evaluation)
        object.__setattr__(self, "_vit_balance_tower_refs", _TowerRefs((*self._vit_balance_towers, handle)))
        return handle

    @eager_frame
    def encode_visual(
        self,
        vit: Any,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        videos: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_layout: OutputLayout | Mapping[str, str] | None = None,
    ) -> tuple[Any, Any]:
        """Encode this rank's images and videos with one (balanced) ViT call; split the result.

        One exchange per step for both modalities, where two :meth:`encode_images` calls would
        make two (and hang when ranks have different modalities). Balances when
        :meth:`encode_images` would. See :func:`~lightning_vit_balance.encode_visual`.

        Args:
            vit: Called as ``vit(pixel_values, grid_thw)``.
            images: ``(pixel_values [sum(T*H*W), C], grid_thw [n, 3])``, or None.
            videos: The same for videos, or None.
            output_layout: As for :meth:`encode_images`; it also tells how each output is cut
                between images and videos (``"image"``: a row per image or video).

        Returns:
            ``(image_output, video_output)``, zero rows for an absent modality; backpropagate
            through both on every rank.
        """
        layout = OutputLayout.of(output_layout)
        settings = self._vit_balance_settings(vit)
        if settings is None:  # compiled with the module when it is
            encoded = encode_visual(vit, images, videos, output_layout=layout)
            self._vit_balance_keep_direct(vit, tuple(part for part in (images, videos) if part is not None))
            return encoded
        return self._vit_balance_call(
            settings,
            lambda balancer, ticket: encode_visual(vit, images, videos, balancer=balancer, prepared=ticket),
            layout,
            vit,
        )

    @property
    def last_vit_balance_stats(self) -> BalanceStats | None:
        """Diagnostics of the latest balanced call (``None`` before the first)."""
        return self._vit_balance_state_object().last_stats

    def pop_vit_balance_stats(self) -> list[BalanceStats]:
        """Return and forget the diagnostics of the balanced calls since the last pop, oldest first
        (then those of modules with the mixin nested in this one, a teacher's, module by module).

        Under a Trainer they are queued for :class:`ViTBalanceCallback` (only while one is
        attached); without one (Fabric), for the loop's own reader: ``for stats in
        module.pop_vit_balance_stats(): metrics.add(stats)`` counts every balanced call of a step
        (``last_vit_balance_stats`` is only the latest). The latest :data:`KEPT_STATS` at most.
        """
        state = self._vit_balance_state_object()
        records = list(state.records)
        state.records.clear()
        for nested in list(state.nested):  # their calls are this step's too (a teacher's)
            records += nested.pop_vit_balance_stats()
        return records
