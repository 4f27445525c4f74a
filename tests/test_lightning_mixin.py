"""ViTBalanceMixin: when it balances, where its group and config come from, what it records."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import io
import pickle
import time
import types
import warnings
import weakref
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
import torch.distributed as dist
from equivalence import measured_around_an_evaluation
from lightning.pytorch.callbacks import BatchSizeFinder, EarlyStopping, LearningRateFinder, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer import setup as trainer_setup
from lightning.pytorch.trainer.states import TrainerStatus
from lightning_fit_script import quiet_trainer
from multirank import caught, launched_by_torchrun, reinit_default_group, world
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset
from towers import CHANNELS, PerImageTower, TensorTower

import lightning_vit_balance.prepared as prepared_module
from lightning_vit_balance import (
    OutputLayout,
    ViTBalanceCallback,
    ViTBalanceConfig,
    ViTBalanceMixin,
    ViTBalancer,
)
from lightning_vit_balance.lightning.mixin import (
    _TWIN_HOLDERS,
    _counts_its_batches,
    _loop_balances,
    _predict_balances,
    _PredictLengths,
    _ref,
    _release_ended_runs,
    _State,
)


class CountingTower(TensorTower):
    """Counts its calls and the images it saw, to tell direct calls from balanced ones."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.seen: list[int] = []

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        self.seen.append(int(grid_thw.shape[0]))
        return super().forward(pixel_values, grid_thw)


class MixinFirst(ViTBalanceMixin, L.LightningModule):
    def __init__(self, config: ViTBalanceConfig | dict | None = None) -> None:
        super().__init__()
        if config is not None:
            self.vit_balance_config = config
        self.visual = CountingTower()
        self.group_lookups = 0

    def configure_vit_balance_group(self) -> Any:
        self.group_lookups += 1
        return super().configure_vit_balance_group()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pixel_values, grid_thw = _images(batch_idx % 3 + 1)
        loss = self.encode_images(self.visual, pixel_values, grid_thw).pow(2).mean()
        loss = loss + self.encode_images(self.visual, *_images(1)).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(3, 1)))


with warnings.catch_warnings(record=True) as _defined:
    warnings.simplefilter("always")

    class LightningFirst(L.LightningModule, ViTBalanceMixin):
        def __init__(self) -> None:
            super().__init__()
            self.visual = CountingTower()


def test_lightning_first_in_the_bases_warns_that_the_hooks_are_shadowed() -> None:
    """``encode_images`` works in either order, the mixin's Lightning hooks only when it comes
    first: a class listing LightningModule first is told so when it is defined."""
    (warned,) = [str(w.message) for w in _defined]
    assert [w.filename for w in _defined] == [__file__]  # the class statement
    assert warned.startswith("LightningFirst lists LightningModule before ViTBalanceMixin"), warned
    hooks = (
        "on_before_batch_transfer, on_before_optimizer_step, on_predict_start, on_save_checkpoint, "
        "on_load_checkpoint, teardown"
    )
    assert hooks in warned, warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Subclass(MixinFirst):
            pass

    assert caught == []


def _images(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor([(1, 2 * (i % 2 + 1), 2) for i in range(count)]).reshape(count, 3)
    rows = int(grid.prod(dim=1).sum())
    return torch.randn(rows, CHANNELS, generator=torch.Generator().manual_seed(seed)), grid


def test_without_a_trainer_it_calls_the_vit_directly_in_either_base_order() -> None:
    """One process: the ViT is called directly, and the call is recorded as the engine records its
    own (``single-rank``: this rank's load read from the CPU grid, nothing moved)."""
    for module in (MixinFirst(), LightningFirst()):
        pixel_values, grid = _images(3)
        out = module.encode_images(module.visual, pixel_values, grid)
        torch.testing.assert_close(out, module.visual(pixel_values, grid), rtol=0, atol=0)
        assert module.visual.seen == [3, 3]
        assert module.resolved_vit_balance_config() == ViTBalanceConfig()
        stats = module.last_vit_balance_stats
        assert stats is not None and (stats.reason, stats.applied, stats.num_ranks) == (
            "single-rank",
            False,
            1,
        )
        assert (stats.num_images, stats.total_patches, stats.imbalance_before) == (
            3,
            pixel_values.shape[0],
            0.0,
        )
        engine = ViTBalancer()
        engine(module.visual, pixel_values, grid)
        assert stats == engine.last_stats
        assert module.pop_vit_balance_stats() == [stats]
        module.eval()  # eval mode without vit_balance_evaluation: not a call that would balance
        module.encode_images(module.visual, pixel_values, grid)
        assert module.pop_vit_balance_stats() == []


def test_flag_attributes_given_as_strings_are_refused() -> None:
    """``vit_balance_evaluation = "false"`` (from an environment variable, say) balanced evaluation
    calls: a rank evaluating alone then waited in a collective."""
    module = MixinFirst()
    module.eval()
    module.vit_balance_evaluation = "false"
    with pytest.raises(
        ValueError, match=r"MixinFirst.vit_balance_evaluation='false' is invalid: expected a bool"
    ):
        module.encode_images(module.visual, *_images(1, seed=0))


def test_a_foreign_balancer_entry_in_a_checkpoint_is_left_with_a_warning() -> None:
    """A resumed fit leaves an entry of keys no balancer saves (a later version's, an edited one)
    as it leaves a saved fit that cannot go on, with a warning, where it had gone unnoticed (the
    fit lost, the entry saved again); loading it by hand refuses it."""
    module = MixinFirst()
    foreign = {"cost_calibrator": None, "format_version": 2}
    with pytest.warns(
        UserWarning, match=r"'vit_balance' entry is not used .*\['format_version'\].* starts afresh"
    ):
        module.on_load_checkpoint({"vit_balance": foreign})
    assert module.vit_balance_state_dict() == {}
    with pytest.raises(
        ValueError, match=r"load_vit_balance_state_dict: state has the keys \['format_version'\]"
    ):
        module.load_vit_balance_state_dict(foreign)


def test_config_attribute_forms() -> None:
    assert MixinFirst({"trigger_threshold": 0.5}).resolved_vit_balance_config() == ViTBalanceConfig(
        trigger_threshold=0.5
    )
    config = ViTBalanceConfig(solver="seed")
    assert MixinFirst(config).resolved_vit_balance_config() is config
    with pytest.raises(TypeError, match=r"MixinFirst.vit_balance_config='seed' is invalid"):
        MixinFirst("seed").resolved_vit_balance_config()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"solver='magic'"):
        MixinFirst({"solver": "magic"}).resolved_vit_balance_config()
    # Any mapping (a config system's, OmegaConf's DictConfig), not only a dict; unknown fields named.
    proxy = types.MappingProxyType({"trigger_threshold": 0.5})
    assert MixinFirst(proxy).resolved_vit_balance_config() == ViTBalanceConfig(trigger_threshold=0.5)
    with pytest.raises(ValueError, match=r"MixinFirst.vit_balance_config has unknown fields \['bogus'\]"):
        MixinFirst({"bogus": 1}).resolved_vit_balance_config()


def test_single_device_fit_looks_the_group_up_once_per_fit_and_calls_directly(tmp_path: Path) -> None:
    module = MixinFirst()
    callback = ViTBalanceCallback()

    def run() -> None:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=CSVLogger(tmp_path),
            log_every_n_steps=1,
            callbacks=[
                callback,
                ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="vit_balance/imbalance_after", mode="min"),
                EarlyStopping(
                    monitor="vit_balance/imbalance_after", mode="min", check_on_train_epoch_end=True
                ),
            ],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module)

    run()
    assert module.group_lookups == 1  # 6 calls, one lookup
    assert len(module.visual.seen) == 6
    run()
    assert module.group_lookups == 2  # a new fit looks again
    # One device: nothing balanced, every call recorded as single-rank, so the keys are logged (and
    # the README's monitors of them work) as on many devices.
    assert (callback.calls_total, callback.applied_total) == (6, 0)
    assert callback.skipped_total["single-rank"] == 6
    logged = (tmp_path / "lightning_logs" / "version_1" / "metrics.csv").read_text()
    assert "vit_balance/imbalance_after" in logged and "vit_balance/skipped/single-rank" in logged
    assert list((tmp_path / "ckpt").glob("*.ckpt"))  # the monitored key was there to save by


@pytest.mark.parametrize("finder", ["lr", "batch size"])
def test_the_callback_records_the_fit_after_a_finders_search(tmp_path: Path, finder: str) -> None:
    """Lightning's LearningRateFinder and BatchSizeFinder search in on_fit_start with the Trainer's
    callbacks set aside, then the same fit trains with them: its calls are recorded and logged (the
    mixin had decided at the search's first call that no callback drained its records, for the
    whole fit), the search's are not."""
    module = MixinFirst()
    module.batch_size = 1
    callback = ViTBalanceCallback()
    search = (
        LearningRateFinder(min_lr=0.01, max_lr=0.011, num_training_steps=2, update_attr=False)
        if finder == "lr"
        else BatchSizeFinder(mode="power", steps_per_trial=1, max_trials=1)
    )
    monitor = EarlyStopping(monitor="vit_balance/imbalance_after", mode="min")
    callbacks = [search, callback, monitor]
    trainer = quiet_trainer(
        str(tmp_path), "", devices=1, max_epochs=1, callbacks=callbacks, default_root_dir=tmp_path
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)  # EarlyStopping raised where the key was never logged
    assert len(module.visual.seen) > 6  # the search's calls, then the fit's
    assert (callback.calls_total, callback.skipped_total["single-rank"]) == (6, 6)  # the fit's alone
    assert "vit_balance/imbalance_after" in trainer.callback_metrics


class WorldGroup(MixinFirst):
    def configure_vit_balance_group(self) -> Any:
        return dist.group.WORLD


@pytest.mark.usefixtures("one_rank_world")
def test_cached_group_never_travels_with_copies_or_pickles() -> None:
    module = WorldGroup()
    module.encode_images(module.visual, *_images(2))
    assert module._vit_balance_state.group is dist.group.WORLD
    with pytest.raises(Exception):  # noqa: B017 - what a cached group would do to a pickle
        pickle.dumps(dist.group.WORLD)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert clone._vit_balance_state.group is None
        torch.testing.assert_close(
            clone.encode_images(clone.visual, *_images(2)), module.visual(*_images(2)), rtol=0, atol=0
        )


def test_a_loaded_cost_fit_travels_with_copies_and_pickles() -> None:
    """A cost fit loaded in the main process reaches a ``ddp_spawn`` worker (the module pickled) and
    a deep copy: it is plain numbers. It was dropped with the groups, so workers fitted afresh."""
    from lightning_vit_balance import CostCalibrator

    calibrator = CostCalibrator(warmup_steps=0)
    for step in range(4):
        calibrator.observe([[16, 64 * (1 + step)], [4]], [1.0 + step, 0.1])
    state = {"cost_calibrator": calibrator.state_dict()}
    module = WorldGroup(ViTBalanceConfig(calibrate_cost=True))
    module.load_vit_balance_state_dict(state)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert clone.vit_balance_state_dict() == module.vit_balance_state_dict() == state
    assert WorldGroup().vit_balance_state_dict() == {}


# ---------------------------------------------------------------------------- two ranks, no Trainer


def _two_rank_encode(enabled: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    module = MixinFirst(ViTBalanceConfig(enabled=enabled))
    module.vit_balance_group = dist.group.WORLD  # explicit group: no Trainer needed
    # Rank 0 holds four images, rank 1 one: the plan moves images.
    pixel_values, grid = _images(4 if rank == 0 else 1, seed=rank)
    pixel_values.requires_grad_(True)
    out = module.encode_images(module.visual, pixel_values, grid)
    out.pow(2).sum().backward()
    direct = module.visual(pixel_values.detach(), grid)
    stats = module.last_vit_balance_stats
    return {
        "equal": bool(torch.allclose(out, direct, rtol=1e-5, atol=1e-6)),
        "seen": module.visual.seen[:-1],
        "stats": None if stats is None else (stats.applied, stats.reason, stats.num_ranks),
        "queued": len(module.pop_vit_balance_stats()),
        "lookups": module.group_lookups,
        "grad": [p.grad.clone() for p in module.visual.parameters()],
    }


def _groups_set_anew(store: str) -> tuple[list[tuple[str, list[int]] | None], str]:
    """A module without a Trainer, its ``vit_balance_group`` set anew: to the ranks [0, 1] of 3
    (rank 2, alone in its group, encodes directly), then to the world of a default group destroyed
    and initialised again. Each call balances over the group set then, as the direct call."""
    rank = dist.get_rank()
    module = MixinFirst()
    module.vit_balance_group = dist.group.WORLD
    pair = dist.new_group([0, 1])
    seen = []
    for round_ in range(3):
        if round_ == 1:
            module.vit_balance_group = pair if rank < 2 else None
        elif round_ == 2:
            reinit_default_group(store)
            module.vit_balance_group = dist.group.WORLD
        pixel_values, grid = _images(4 if rank == 0 else 1, seed=rank + round_)
        out = module.encode_images(module.visual, pixel_values, grid)
        torch.testing.assert_close(out, module.visual(pixel_values, grid))  # the same rows: exact
        balancer = module._vit_balance_state_object().balancer  # None: this run balances nothing
        stats = module.last_vit_balance_stats
        ranks = None if balancer is None else dist.get_process_group_ranks(balancer.group)
        seen.append(None if balancer is None else (stats.reason, ranks))
    refused = ""
    pair = dist.new_group([0, 1])
    if rank == 2:  # new_group's placeholder where it leaves the rank out (an int): named, refused
        module.vit_balance_group = pair
        with pytest.raises(ValueError, match=r"vit_balance_group\) is a group that does not hold") as error:
            module.encode_images(module.visual, *_images(1))
        refused = str(error.value)
    return seen, refused


def test_without_a_trainer_the_group_set_on_the_module_is_read_again(tmp_path: Path) -> None:
    """Without a Trainer nothing marks a run, so the group was read once for the module's life: a
    group set anew was ignored (ranks 0 and 1 waited for rank 2 until the timeout) and a default
    group made again raised "not registered" on every rank."""
    with world(3) as w:
        results = w.run(_groups_set_anew, str(tmp_path / "store"), timeout=90)
        w.close()  # its ranks are in a world of the test's own (see reinit_default_group)
    world_of_3 = ("applied", [0, 1, 2])
    seen = [calls for calls, _ in results]
    assert seen[0] == [world_of_3, ("applied", [0, 1]), world_of_3], results
    assert seen[1] == seen[0], results
    assert seen[2] == [world_of_3, None, world_of_3], results  # alone: directly, not recorded
    assert "(global rank 2)" in results[2][1], results


def _plans_from_unreadable_batches() -> dict[str, Any]:
    """Plans made ahead from a batch that is not a mapping (rank 1) for a call that encodes images;
    then for a step that encodes none (every rank); then from dicts under other keys than
    ``vit_balance_prepare_keys`` (every rank)."""
    rank = dist.get_rank()
    module = MixinFirst(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
    module.vit_balance_group = dist.group.WORLD
    pixel_values, grid = _images(3, seed=rank)
    batch = {"pixel_values": pixel_values, "image_grid_thw": grid}
    module.prepare_vit_balance((pixel_values, grid) if rank == 1 else batch)
    try:
        module.encode_images(module.visual, pixel_values, grid)
        error = ""
    except ValueError as err:
        error = str(err)
    no_images = module.prepare_vit_balance((pixel_values, grid))  # a step that encodes no image
    ticket = module.prepare_vit_balance({"images": pixel_values, "grids": grid})  # read as text-only
    try:
        module.encode_images(module.visual, pixel_values, grid)
        text_only_error = ""
    except ValueError as err:
        text_only_error = str(err)
    return {
        "error": error,
        "planned": [sum(map(len, plan.plan.patch_counts)) for plan in (no_images, ticket)],
        "text_only_error": text_only_error,
    }


def test_plans_made_ahead_from_unreadable_batches_say_so() -> None:
    """A batch that is not a mapping cannot be read by name: it is planned without images (a step
    that encodes none works), and a call that encodes images fails on every rank, naming the
    batch and the keys, instead of a ticket the user never held. A dict under other keys plans as
    text-only too, and the call that then encodes images fails on every rank (a step planned
    without images checks its calls), naming the keys the plan was read by."""
    with world(2) as w:
        results = w.run(_plans_from_unreadable_batches, timeout=60)
    for result in results:
        assert "The balanced ViT call failed: rank 1:" in result["error"], result
        assert "the batch is a tuple, not a mapping" in result["error"], result
        assert "'pixel_values'/'image_grid_thw'" in result["error"], result
        assert result["planned"] == [0, 0]
        message = result["text_only_error"]
        assert "holds 0 images on this rank" in message and "(vit_balance_prepare_keys)" in message, result
        # A CombinedLoader's batch keeps each loader's batch under its own key: those are named.
        assert "the batch holds none of them, only 'images', 'grids'" in message, result


def _plans_from_keys_that_do_not_fit() -> list[str]:
    """``vit_balance_prepare_keys`` written flat (every rank); a batch whose grid is under another
    key than the one named (rank 1)."""
    rank = dist.get_rank()
    module = MixinFirst(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
    module.vit_balance_group = dist.group.WORLD
    pixel_values, grid = _images(3, seed=rank)
    messages = []
    for keys, grid_key in ((("pixel_values", "image_grid_thw"), "image_grid_thw"), (None, "grid_thw")):
        if keys is not None:
            module.vit_balance_prepare_keys = keys
        try:
            module.prepare_vit_balance(
                {"pixel_values": pixel_values, grid_key if rank == 1 else "image_grid_thw": grid}
            )
            messages.append("no error")
        except ValueError as error:
            messages.append(f"{error} {' '.join(getattr(error, '__notes__', []))}")
        module.__dict__.pop("vit_balance_prepare_keys", None)  # the class's own again
    return messages


def _plan_made_ahead_with_settings_apart() -> tuple[str, list[str]]:
    """A plan made ahead where rank 1's configuration differs: the error and its notes."""
    rank = dist.get_rank()
    module = MixinFirst(ViTBalanceConfig(trigger_threshold=0.3 if rank == 1 else 0.0))
    module.vit_balance_group = dist.group.WORLD
    pixel_values, grid = _images(3, seed=rank)
    with pytest.raises(ValueError) as raised:
        module.prepare_vit_balance({"pixel_values": pixel_values, "image_grid_thw": grid})
    return str(raised.value), list(getattr(raised.value, "__notes__", []))


def test_settings_apart_in_a_plan_made_ahead_are_not_blamed_on_the_batch() -> None:
    """The note naming the batch's keys had followed an error about settings, pointing at the batch."""
    with world(2) as w:
        for message, notes in w.run(_plan_made_ahead_with_settings_apart, timeout=60):
            assert "the balancing settings differ between ranks: trigger_threshold (ranks [1]" in message
            assert notes == [], notes


def test_plans_made_ahead_from_keys_that_do_not_fit_name_them() -> None:
    """Flat keys raised ``too many values to unpack``; a grid missing under its key said only that
    ``grid_thw is not a torch.Tensor``."""
    with world(2) as w:
        results = w.run(_plans_from_keys_that_do_not_fit, timeout=60)
    for rank, (flat, missing) in enumerate(results):
        flat_keys = "vit_balance_prepare_keys=('pixel_values', 'image_grid_thw') is invalid"
        assert f"{flat_keys}: expected (pixels key, grid key) pairs" in flat, flat
        assert "rank 1: grid_thw is None, not a torch.Tensor" in missing, missing
        assert "made ahead from the batch's 'pixel_values'/'image_grid_thw', 'pixel_values_videos'" in missing
        held = "'pixel_values', 'grid_thw'" if rank == 1 else "'pixel_values', 'image_grid_thw'"
        assert f"The batch on this rank holds {held}." in missing, missing


def test_without_a_trainer_the_calls_queue_for_the_loop_boundedly() -> None:
    """Every balanced call of a step is queued for ``pop_vit_balance_stats`` (a loop's own
    ``BalanceMetrics``); the latest ``KEPT_STATS`` at most when nothing reads them."""
    from lightning_vit_balance.hf import KEPT_STATS

    module = MixinFirst()
    stats = [mock.Mock(name=f"call {k}") for k in range(KEPT_STATS + 3)]
    with mock.patch.object(MixinFirst, "_vit_balance_runner", return_value=(None, None)):
        module._vit_balance_refresh(module._vit_balance_state_object())
    for call in stats[:2]:
        module._vit_balance_keep(call)
    assert module.pop_vit_balance_stats() == stats[:2] and module.pop_vit_balance_stats() == []
    for call in stats:
        module._vit_balance_keep(call)
    assert module.pop_vit_balance_stats() == stats[3:]


def _per_image_outputs() -> dict[str, Any]:
    """encode_images with an output layout naming rows per image, then without one."""
    rank = dist.get_rank()
    module = MixinFirst(ViTBalanceConfig(trigger_threshold=0.0))
    module.vit_balance_group = dist.group.WORLD
    torch.manual_seed(0)
    tower = PerImageTower()
    pixel_values, grid = _images(4 if rank == 0 else 1, seed=rank)
    layout = {"pooled": "image", "queries": "image", "sizes": "image"}
    out = module.encode_images(tower, pixel_values, grid, output_layout=layout)
    direct = tower(pixel_values, grid)
    for key, value in direct.items():
        torch.testing.assert_close(out[key], value, rtol=1e-5, atol=1e-6)  # fp32, other batch mates
    image_out, video_out = module.encode_visual(tower, (pixel_values, grid), None, output_layout=layout)
    for key, value in direct.items():
        torch.testing.assert_close(image_out[key], value, rtol=1e-5, atol=1e-6)
        assert video_out[key].shape == (0, *value.shape[1:])
    stats = module.last_vit_balance_stats
    try:
        module.encode_images(tower, pixel_values, grid)
    except ValueError as error:
        return {"applied": stats is not None and stats.applied, "unnamed": str(error)}
    return {"applied": stats is not None and stats.applied, "unnamed": None}


def test_a_direct_call_drops_the_outputs_its_layout_names_drop() -> None:
    """As a balanced call does: the output type does not depend on whether the call balances."""
    torch.manual_seed(0)
    module, tower = MixinFirst(), PerImageTower()
    pixel_values, grid = _images(2)
    out = module.encode_images(tower, pixel_values, grid, output_layout={"tokens": "drop"})
    assert out["tokens"] is None and out["pooled"].shape == (2, 24)
    assert module.encode_images(tower, pixel_values, grid)["tokens"].shape == (3, 24)


def test_encode_images_and_encode_visual_take_an_output_layout() -> None:
    with world(2) as w:
        results = w.run(_per_image_outputs)
    assert [r["applied"] for r in results] == [True, True]
    unnamed = results[0]["unnamed"]
    assert unnamed == results[1]["unnamed"] and "as many as its batch's images" in unnamed


def _without_a_group_on_two_ranks() -> Any:
    """Many ranks, no group given (balancing turned off): a direct call, recorded by none."""
    module = MixinFirst()
    module.encode_images(module.visual, *_images(2, seed=dist.get_rank()))
    return module.last_vit_balance_stats


def _calibrating_through_a_schedule(change_every_step: bool, ahead: bool) -> dict[str, Any]:
    """Worker: a calibrating module without a Trainer over 10 calls, its configuration changed
    before every call or never, each call planned in it or ``ahead`` (``prepare_vit_balance``);
    the fit's counters and the calls with measured ViT times."""
    rank = dist.get_rank()
    base = ViTBalanceConfig(calibrate_cost=True, trigger_threshold=0.0)
    module = MixinFirst(base)
    module.vit_balance_group = dist.group.WORLD
    measured = 0
    for step in range(10):
        if change_every_step:  # a schedule: a configuration not seen before at every call
            module.vit_balance_config = dataclasses.replace(base, min_gain=1e-4 * step)
        pixel_values, grid = _images(1 + (step + rank) % 4, seed=step)
        if ahead:
            module.prepare_vit_balance({"pixel_values": pixel_values, "image_grid_thw": grid})
        module.encode_images(module.visual, pixel_values, grid).sum().backward()
        measured += min(module.last_vit_balance_stats.vit_ms, default=-1.0) >= 0
    state = module.vit_balance_state_dict()["cost_calibrator"]
    return {
        "observed": state["steps_observed"],
        "rows": sum(map(len, state["history"])),
        "measured": measured,
    }


def _training_around_an_evaluation_of_its_own_configuration() -> str:
    """Worker: a module balancing evaluation too, through :func:`measured_around_an_evaluation`."""
    rank = dist.get_rank()
    training = ViTBalanceConfig(calibrate_cost=True, trigger_threshold=0.0)
    module = MixinFirst(training)
    module.vit_balance_group, module.vit_balance_evaluation = dist.group.WORLD, True

    def step(index: int, config: ViTBalanceConfig, in_training: bool) -> tuple[float, ...]:
        module.vit_balance_config = config
        module.train(in_training)
        output = module.encode_images(module.visual, *_images(1 + (index + rank) % 4, seed=index))
        if in_training:
            output.sum().backward()
        return module.last_vit_balance_stats.vit_ms

    return measured_around_an_evaluation(training, 2, step)


class _SleepingTower(CountingTower):
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)
        return super().forward(pixel_values, grid_thw)


def _two_towers_through_a_schedule() -> list[tuple[float, float]]:
    """Worker: each step, a configuration not seen before, then a quick tower's call and a
    sleeping tower's (another layout): per step, the largest ViT time each call reported."""
    rank = dist.get_rank()
    base = ViTBalanceConfig(calibrate_cost=True, trigger_threshold=0.0)
    module = MixinFirst(base)
    module.vit_balance_group, module.slow = dist.group.WORLD, _SleepingTower()
    reported = []
    for step in range(4):
        module.vit_balance_config = dataclasses.replace(base, min_gain=1e-4 * step)
        images = _images(1 + (step + rank) % 3, seed=step)
        module.encode_images(module.visual, *images).sum().backward()
        quick = max(module.last_vit_balance_stats.vit_ms, default=-1.0)
        module.encode_images(module.slow, *images, output_layout=OutputLayout(merge_size=2)).sum().backward()
        reported.append((quick, max(module.last_vit_balance_stats.vit_ms, default=-1.0)))
    return reported


def test_a_configuration_schedule_keeps_the_cost_fit_and_the_measured_times() -> None:
    """A configuration new at every call made a balancer that went on from the fit as from a
    checkpoint (its warm-up again, a new clock): no call was ever fitted or reported, with plans
    made in the call or ahead. A configuration of its own for evaluation leaves the training
    calls' clock to the training balancer, and a tower never reports another tower's time."""
    with world(2) as w:
        runs = {ahead: w.run(_calibrating_through_a_schedule, True, ahead) for ahead in (False, True)}
        steady = w.run(_calibrating_through_a_schedule, False, False)
        around = w.run(_training_around_an_evaluation_of_its_own_configuration)
        towers = w.run(_two_towers_through_a_schedule)
    # The rows kept are not compared between runs: the too-fast screen drops a step's rows against
    # a model fitted to wall-clock times, so how many it drops varies from run to run (CI saw 13
    # against 14). It drops rows from at most every other step, so more than one row a step stays.
    counters = [{key: r[key] for key in ("observed", "measured")} for r in steady]
    for scheduled in runs.values():
        assert [{key: r[key] for key in ("observed", "measured")} for r in scheduled] == counters, (
            scheduled,
            steady,
        )
        assert all(r["rows"] > r["observed"] for r in scheduled + steady), (scheduled, steady)
    assert counters == [{"observed": 9, "measured": 9}] * 2, counters
    assert around == ["T0 T1 T1 V0 V1 T1 T1 T1"] * 2, around
    # Two towers through a schedule go on from no balancer (-1: not measured), never from the
    # other tower's: the sleeping tower's 200 ms never shows as the quick one's.
    for reports in towers:
        assert all(quick < 100.0 and (slow < 0 or slow >= 200.0) for quick, slow in reports), reports


def test_explicit_group_balances_across_two_ranks() -> None:
    with world(2) as w:
        balanced = w.run(_two_rank_encode, True)
        direct = w.run(_two_rank_encode, False)
        assert w.run(_without_a_group_on_two_ranks) == [None, None]  # not a one-rank call
    for rank in range(2):
        assert balanced[rank]["equal"] and direct[rank]["equal"]
        assert balanced[rank]["stats"] == (True, "applied", 2)
        assert direct[rank]["stats"] is None  # disabled: the ViT is called directly
        # Without a Trainer, queued for the loop's own reader (BalanceMetrics), a bounded queue.
        assert balanced[rank]["queued"] == 1
        assert balanced[rank]["lookups"] == 1
    # Balancing moved images: the ranks encoded other batches than their own ...
    assert [b["seen"] for b in balanced] != [d["seen"] for d in direct]
    assert sum(sum(b["seen"]) for b in balanced) == 5
    # ... with the same gradients, summed over ranks as DDP would (per-image maths is identical;
    # only the batch composition differs, so fp32 rounding may differ in the last bits).
    for p_balanced, p_direct in zip(
        [sum(g) for g in zip(*(b["grad"] for b in balanced))],
        [sum(g) for g in zip(*(d["grad"] for d in direct))],
    ):
        torch.testing.assert_close(p_balanced, p_direct, rtol=1e-5, atol=1e-6)


class FabricVLM(MixinFirst):
    """Encodes the batch it is given, in training and validation steps (called through Fabric)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.encode_images(self.visual, *batch).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.encode_images(self.visual, *batch).pow(2).mean()


def _fabric_steps(model: Any, fabric: Any, optimizer: Any, steps: range) -> list[float]:
    """Training steps of a Fabric loop; rank r holds 4r + step + 1 images, so images move."""
    losses, rank = [], dist.get_rank()
    for step in steps:
        loss = model.training_step(_images(4 * rank + step + 1, seed=10 * rank + step), step)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _evaluate(model: Any, count: int) -> float:
    """A validation step in eval mode without gradients, as a Fabric loop makes it."""
    model.eval()
    with torch.no_grad():
        loss = model.validation_step(_images(count), 0).item()
    model.train()
    return loss


def _fabric_loop(enabled: bool) -> dict[str, Any]:
    """A Fabric DDP loop on the pool's ranks (as under ``torchrun``): two training steps, rank 0
    validating alone, a third step, then validation on every rank with and without
    ``vit_balance_evaluation``."""
    with launched_by_torchrun():
        fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy="ddp")
        fabric.launch()
        module = FabricVLM(ViTBalanceConfig(enabled=enabled, trigger_threshold=0.0, min_gain=0.0))
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.5))
        losses = _fabric_steps(model, fabric, optimizer, range(2))
        trained = module.last_vit_balance_stats
        if dist.get_rank() == 0:  # samples checked on rank 0 alone: no collective to wait in
            _evaluate(model, 3)
        alone = module.last_vit_balance_stats
        losses += _fabric_steps(model, fabric, optimizer, range(2, 3))
        third = module.last_vit_balance_stats
        evaluated = [_evaluate(model, 1 + 3 * dist.get_rank())]
        unbalanced = module.last_vit_balance_stats
        module.vit_balance_evaluation = True
        evaluated.append(_evaluate(model, 1 + 3 * dist.get_rank()))
        balanced = module.last_vit_balance_stats
    return {
        "losses": losses,
        "evaluated": evaluated,
        "weights": [p.detach().clone() for p in module.visual.parameters()],
        "applied": [s is not None and s.applied for s in (trained, third, balanced)],
        "kept": [alone is trained, unbalanced is third, balanced is not third],
        "seen": module.visual.seen,
    }


def test_fabric_loop_balances_training_and_lets_a_rank_evaluate_alone() -> None:
    """Fabric (DDP, 2 ranks): training steps balanced with the direct loop's losses and weights;
    rank 0 validating alone encodes directly instead of waiting in a collective the other rank
    never joins; evaluation on every rank is balanced once ``vit_balance_evaluation`` says so."""
    with world(2) as w:
        balanced = w.run(_fabric_loop, True, timeout=120)
        direct = w.run(_fabric_loop, False, timeout=120)
    for rank in range(2):
        assert balanced[rank]["applied"] == [True, True, True]
        assert direct[rank]["applied"] == [False, False, False]  # disabled: nothing recorded
        assert balanced[rank]["kept"] == [True, True, True]  # the lone and the plain evaluation: direct
        # Per-image maths is identical, only the batches' composition differs (fp32 rounding), and
        # three SGD steps carry it on: the direct loop's losses and weights to fp32's last digits.
        torch.testing.assert_close(balanced[rank]["losses"], direct[rank]["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            balanced[rank]["evaluated"], direct[rank]["evaluated"], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(balanced[rank]["weights"], direct[rank]["weights"], rtol=1e-5, atol=1e-6)
    # Balanced steps moved images; the lone validation ran on rank 0's own tower only.
    assert [b["seen"] for b in balanced] != [d["seen"] for d in direct]
    assert len(balanced[0]["seen"]) == len(balanced[1]["seen"]) + 1


def _fabric_resume(path: str) -> dict[str, Any]:
    """A Fabric DDP loop with ``calibrate_cost``: four steps, ``fabric.save`` with the balancer's
    state next to the model, then a new module loaded with ``fabric.load`` goes on for two steps."""
    with launched_by_torchrun():
        fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy="ddp")
        fabric.launch()
        states = []
        for steps in (range(4), range(4, 6)):
            module = FabricVLM(ViTBalanceConfig(calibrate_cost=True, trigger_threshold=0.0))
            model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.5))
            if states:
                remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
                module.load_vit_balance_state_dict(remainder["vit_balance"])
            _fabric_steps(model, fabric, optimizer, steps)
            states.append(module.vit_balance_state_dict())
            fabric.save(path, {"model": model, "optimizer": optimizer, "vit_balance": states[-1]})
    return {"saved": states[0]["cost_calibrator"], "continued": states[1]["cost_calibrator"]}


def test_fabric_checkpoints_carry_the_online_cost_fit(tmp_path: Path) -> None:
    with world(2) as w:
        first, second = w.run(_fabric_resume, str(tmp_path / "fabric.ckpt"), timeout=120)
    assert first == second  # fitted from every rank's gathered figures
    # 4 calls: 3 carried the previous call's times, 2 of them warm-up; resumed, 2 calls more: 1
    # observation (a new balancer warms up again), the fit's rows go on.
    assert first["saved"]["steps_observed"] == 3 and len(first["saved"]["history"]) == 1
    assert first["continued"]["steps_observed"] == 4
    assert first["continued"]["history"] == first["saved"]["history"]


def _fabric_prepared(prepare: bool) -> dict[str, Any]:
    """A Fabric DDP loop whose batches are planned on the host with ``prepare_vit_balance`` (or
    not) before each training step; then a plan asked for in eval mode."""
    rank = dist.get_rank()
    with launched_by_torchrun():
        fabric = L.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy="ddp")
        fabric.launch()
        module = FabricVLM(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
        module.vit_balance_prepare_keys = (("pixel_values", "image_grid_thw"),)  # encode_images: images only
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.5))
        losses, prepared, collectives = [], [], []
        for step in range(3):
            pixel_values, grid_thw = _images(4 * rank + step + 1, seed=10 * rank + step)
            if prepare:
                batch = {"pixel_values": pixel_values, "image_grid_thw": grid_thw}
                prepared.append(module.prepare_vit_balance(batch) is not None)
            loss = model.training_step((pixel_values, grid_thw), step)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            collectives.append(module.last_vit_balance_stats.collectives)
        model.eval()
        batch = {"pixel_values": pixel_values, "image_grid_thw": grid_thw}
        in_eval = module.prepare_vit_balance(batch)
        module.vit_balance_evaluation = True  # every rank evaluates: plans are made in eval mode too
        evaluation = [module.prepare_vit_balance(batch) is not None]
        with torch.no_grad():
            evaluation.append(model.validation_step((pixel_values, grid_thw), 0).item())
            evaluation.append(module.visual(pixel_values, grid_thw).pow(2).mean().item())
        evaluation.append(module.last_vit_balance_stats.collectives)
    return {
        "losses": losses,
        "prepared": prepared,
        "collectives": collectives,
        "in_eval": in_eval,
        "evaluation": evaluation,
    }


def test_fabric_loop_plans_before_the_forward() -> None:
    """``prepare_vit_balance`` in a loop without a Trainer: each step's balanced call takes the plan
    made on the host (3 collectives instead of 4: no metadata gather in the forward), with the
    losses of the loop that plans in the forward; in eval mode nothing is planned, unless
    ``vit_balance_evaluation`` says every rank evaluates: then the evaluation call takes its plan."""
    with world(2) as w:
        prepared = w.run(_fabric_prepared, True, timeout=120)
        planned_in_call = w.run(_fabric_prepared, False, timeout=120)
    for rank in range(2):
        assert prepared[rank]["prepared"] == [True] * 3
        assert prepared[rank]["collectives"] == [3] * 3 and planned_in_call[rank]["collectives"] == [4] * 3
        # The same plans, batches and operations: the same losses to the last bit.
        assert prepared[rank]["losses"] == planned_in_call[rank]["losses"]
        assert prepared[rank]["in_eval"] is None
        made, balanced_loss, direct_loss, made_collectives = prepared[rank]["evaluation"]
        assert made and made_collectives == 3  # the trips and the status gather: no metadata gather
        assert balanced_loss == pytest.approx(direct_loss, rel=1e-6)  # fp32 sums in another order


class SamplesOnRankZero(L.Callback):
    """Encodes an image on rank 0 alone in hooks of the fit's loops (sample logging), noting whether
    each call left the module's last stats alone (a direct call) and the stats of the step before."""

    def __init__(self) -> None:
        self.direct: list[bool] = []
        self.steps: list[Any] = []

    def _sample(self, pl_module: Any) -> None:
        self.steps.append(pl_module.last_vit_balance_stats)
        if pl_module.global_rank == 0:
            with torch.no_grad():
                pl_module.encode_images(pl_module.visual, *_images(3))
            self.direct.append(pl_module.last_vit_balance_stats is self.steps[-1])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._sample(pl_module)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._sample(pl_module)


class StepsAndSamples(FabricVLM):
    """Balanced training and validation steps (rank 1 holds three images more than rank 0) over
    even loaders."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(_images(3 * self.global_rank + batch_idx + 1, seed=batch_idx), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().validation_step(_images(3 * self.global_rank + 1, seed=batch_idx), batch_idx)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 1)))


def _fit_with_samples_on_rank_zero(out: str) -> dict[str, Any]:
    with launched_by_torchrun():
        samples = SamplesOnRankZero()
        module = StepsAndSamples(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
        # Lightning's DistributedSampler on both loaders: validation balances in its step.
        settings = {"callbacks": [samples], "logger": False, "use_distributed_sampler": True}
        trainer = quiet_trainer(out, "", strategy="ddp", max_steps=2, num_sanity_val_steps=0, **settings)
        trainer.fit(module)
    return {"direct": samples.direct, "applied": [s is not None and s.applied for s in samples.steps]}


def test_hooks_outside_the_steps_encode_directly(tmp_path: Path) -> None:
    """Under a Trainer, only the loops' step hooks balance: rank 0 logging samples alone from a
    callback's ``on_train_batch_end`` and ``on_validation_epoch_end`` (the fit's loops are running
    there) encodes directly instead of waiting in a collective the other rank never joins."""
    with world(2) as w:
        first, second = w.run(_fit_with_samples_on_rank_zero, str(tmp_path), timeout=120)
    # Two training steps and one validation epoch, each step balanced; rank 0's samples direct.
    assert first["applied"] == second["applied"] == [True, True, True]
    assert first["direct"] == [True, True, True] and second["direct"] == []


def test_which_trainer_hooks_balance() -> None:
    """Under a training loop: the step balances, another hook does not, and where Lightning keeps
    no running hook's name (another release) the loop decides alone, as before the hook rule."""
    module = MixinFirst()
    trainer = mock.Mock(training=True)
    with mock.patch.object(MixinFirst, "_vit_balance_runner", return_value=(trainer, None)):
        answers = {}
        for hook in ("training_step", "on_train_batch_end", None):
            module._current_fx_name = hook
            answers[hook] = module._vit_balance_loop_balances(module.visual, ahead=False)
        answers["ahead"] = module._vit_balance_loop_balances(module.visual, ahead=True)
        del module._current_fx_name
        answers["unnamed"] = module._vit_balance_loop_balances(module.visual, ahead=False)
    assert answers == {
        "training_step": True,
        "on_train_batch_end": False,
        None: False,
        "ahead": True,
        "unnamed": True,
    }


class PlannedSteps(FabricVLM):
    """Training and validation batches collated on the host (rank r holds 3r + index + 1 images)
    and planned in ``on_before_batch_transfer``; each step notes its call's stats and whether it
    encoded what the tower gives directly."""

    vit_balance_prepare_keys = (("pixel_values", "image_grid_thw"),)

    def __init__(self) -> None:
        super().__init__(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0, plan_ahead=True))
        self.calls: list[tuple[str, bool, int, bool]] = []

    def _step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        embeds = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
        stats = self.last_vit_balance_stats
        exact = torch.allclose(embeds, self.visual(batch["pixel_values"], batch["image_grid_thw"]))
        stage = "sanity" if self.trainer.sanity_checking else self.trainer.state.stage.value
        self.calls.append((stage, stats.prepare_seconds > 0, stats.collectives, exact))
        return embeds.pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, batch_idx)

    def _loader(self) -> Any:
        def collate(indices: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            index = int(indices[0][0])
            pixel_values, grid_thw = _images(3 * self.global_rank + index + 1, seed=index)
            return {"pixel_values": pixel_values, "image_grid_thw": grid_thw}

        return torch.utils.data.DataLoader(TensorDataset(torch.arange(4.0)), collate_fn=collate)

    def train_dataloader(self) -> Any:
        return self._loader()

    def val_dataloader(self) -> Any:
        return self._loader()


class PlanningData(L.LightningDataModule):
    """Plans each batch in its own ``on_before_batch_transfer``: Lightning then runs the datamodule's
    hook instead of the module's, and a plan made ahead is asked for there."""

    def __init__(self, module: PlannedSteps, plans: bool = True) -> None:
        super().__init__()
        self.module = module
        self.plans = plans

    def train_dataloader(self) -> Any:
        return self.module._loader()

    def val_dataloader(self) -> Any:
        return self.module._loader()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.plans:
            self.module.prepare_vit_balance(batch)
        return batch


class ExampleOnRankZero(L.Callback):
    """Runs the batch hooks on an example batch, on rank 0 alone, after a training batch (within the
    loop's method) and when training ends: what an export (``to_onnx``, ``to_torchscript``) or a
    logger's ``log_graph`` does there."""

    def _example(self, trainer: L.Trainer, pl_module: PlannedSteps) -> None:
        if trainer.is_global_zero:
            pixel_values, grid = _images(2, seed=0)
            example = pl_module._on_before_batch_transfer(
                {"pixel_values": pixel_values, "image_grid_thw": grid}
            )
            pl_module._apply_batch_transfer_handler(example)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: PlannedSteps, *args: Any) -> None:
        self._example(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: PlannedSteps) -> None:
        self._example(trainer, pl_module)


def _planned_fit(out: str, kind: str = "planned") -> tuple[list[tuple[str, bool, int, bool]], list[str]]:
    """The calls of a 2-step fit (``kind``: ``PlannedSteps``, ``IteratedSteps``, ``UnplannedSteps``
    (``"no-super"``), or ``PlannedSteps`` given a ``PlanningData`` that plans, or that does not:
    ``"datamodule-silent"``), and the warnings the mixin told."""
    with launched_by_torchrun(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kinds = {"iterated": IteratedSteps, "no-super": UnplannedSteps}
        module = kinds.get(kind, PlannedSteps)()
        # Lightning's DistributedSampler on both loaders (2 batches per rank): validation balances.
        settings = {
            "logger": False,
            "callbacks": [ExampleOnRankZero()],
            "use_distributed_sampler": True,
            "num_sanity_val_steps": 2 if kind == "iterated" else 1,
        }
        trainer = quiet_trainer(out, "", strategy="ddp", max_steps=2, **settings)
        datamodule = PlanningData(module, kind == "datamodule") if kind.startswith("datamodule") else None
        trainer.fit(module, datamodule=datamodule)
    return module.calls, [str(w.message) for w in caught if "plan_ahead=True, but" in str(w.message)]


class UnplannedSteps(PlannedSteps):
    """An override of the batch hook that does not call ``super()``: no plan is made ahead."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


def test_plan_ahead_plans_the_validation_steps_too(tmp_path: Path) -> None:
    """``plan_ahead`` under a Trainer plans every batch of a loop whose steps balance: the training
    steps, and the sanity check's and validation's steps on ``DistributedSampler`` loaders. Each
    call takes the plan made before the forward (3 collectives: no metadata gather) and returns
    the direct call's outputs. So does a plan a datamodule's own ``on_before_batch_transfer`` asks
    for (Lightning runs it instead of the module's); one that does not ask is told of, once. The
    batch hooks run on an example input, on rank 0 alone (an export after a training batch, and when
    training ends), plan nothing: rank 0 waited alone in the gather of a plan."""
    with world(2) as w:
        ranks = w.run(_planned_fit, str(tmp_path), timeout=120)
        ranks += w.run(_planned_fit, str(tmp_path / "datamodule"), "datamodule", timeout=120)
        silent = w.run(_planned_fit, str(tmp_path / "silent"), "datamodule-silent", timeout=120)
        no_super = w.run(_planned_fit, str(tmp_path / "no-super"), "no-super", timeout=120)
    for calls, told in ranks:
        assert [stage for stage, *_ in calls] == ["sanity", "train", "train", "validate", "validate"]
        assert all(prepared and collectives == 3 and exact for _, prepared, collectives, exact in calls)
        assert told == []
    for rank, (calls, told) in enumerate(silent):
        assert not any(prepared for _, prepared, *_ in calls) and all(exact for *_, exact in calls), calls
        assert len(told) == (1 if rank == 0 else 0), told  # rank_zero_warn
        assert all("PlanningData defines on_before_batch_transfer" in message for message in told), told
    # The module's own override that skips super(): told too (it planned nothing, silently).
    for rank, (calls, told) in enumerate(no_super):
        assert not any(prepared for _, prepared, *_ in calls) and all(exact for *_, exact in calls), calls
        assert len(told) == (1 if rank == 0 else 0), told
        assert all("UnplannedSteps must call super().on_before_batch_transfer" in m for m in told), told


class IteratedSteps(PlannedSteps):
    """Training steps that take ``dataloader_iter`` (Lightning calls no ``on_before_batch_transfer``
    for them; the second plans its batch itself, in the step), and a validation step that encodes
    nothing for its second batch: the plan made for that batch is not taken by its step. The batch
    hooks are overridden as users do, without ``super()``, and with one dataloader's arguments."""

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        if batch_idx == 1:
            self.prepare_vit_balance(batch)
        return self._step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        return self._step(batch, batch_idx) if batch_idx == 0 else None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ended = batch_idx

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ended = batch_idx


def test_a_plan_its_step_did_not_take_goes_to_no_other_step(tmp_path: Path) -> None:
    """The sanity check's second batch was planned and not encoded: the next training step (no plan
    of its own) took that plan, warned that its batch did not match, and every rank failed at the
    following gather. A plan is kept for the loop's batch it was made for: the first step that takes
    ``dataloader_iter`` plans in its call (4 collectives), the second takes the plan it made itself,
    the others their own plans."""
    with world(2) as w:
        ranks = w.run(_planned_fit, str(tmp_path), "iterated", timeout=120)
    for calls, _ in ranks:
        assert [stage for stage, *_ in calls] == ["sanity", "train", "train", "validate"], calls
        assert [(prepared, collectives) for _, prepared, collectives, _ in calls] == [
            (True, 3),
            (False, 4),
            (True, 3),
            (True, 3),
        ], calls
        assert all(exact for *_, exact in calls)


class ClockedSteps(PlannedSteps):
    """Rank 0 works 0.15 s longer after each training batch (logging samples, say): with a time
    ``val_check_interval`` Lightning checks each rank's own clock, and the ranks validate after
    different training batches."""

    def _step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        before = self.last_vit_balance_stats
        embeds = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
        stage = "sanity" if self.trainer.sanity_checking else self.trainer.state.stage.value
        balanced = self.last_vit_balance_stats is not before
        direct = self.visual(batch["pixel_values"], batch["image_grid_thw"])
        # Same ops on the same rows in batches of other sizes: fp32 agrees to a few ulps.
        exact = torch.allclose(embeds, direct, rtol=1e-5, atol=1e-6)
        self.calls.append((stage, balanced, self.global_step, exact))
        return embeds.pow(2).mean()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 0:
            time.sleep(0.15)


def _clocked_fit(out: str) -> tuple[list[tuple[str, bool, int, bool]], list[str]]:
    with launched_by_torchrun(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = ClockedSteps()
        settings = {"logger": False, "callbacks": [], "use_distributed_sampler": True}
        interval = datetime.timedelta(seconds=0.3)
        trainer = quiet_trainer(out, "", strategy="ddp", max_steps=6, val_check_interval=interval, **settings)
        trainer.fit(module)
    return module.calls, [str(w.message) for w in caught if "val_check_interval is a time" in str(w.message)]


@pytest.mark.skipif(
    not hasattr(trainer_setup, "_parse_time_interval_seconds"),
    reason="Lightning < 2.6: no time val_check_interval",
)
def test_validation_on_each_ranks_own_clock_encodes_directly(tmp_path: Path) -> None:
    """A time ``val_check_interval``: the ranks validated after different training batches, and a
    balanced validation call waited for the other rank's training step until the group's timeout.
    Such a fit's validation encodes directly (told once, on rank 0); its training still balances,
    and its sanity check too (every rank runs it before training)."""
    with world(2) as w:
        ranks = w.run(_clocked_fit, str(tmp_path), timeout=120)
    for rank, (calls, told) in enumerate(ranks):
        assert all(balanced for stage, balanced, *_ in calls if stage in ("train", "sanity")), calls
        validated = [balanced for stage, balanced, *_ in calls if stage == "validate"]
        assert validated and not any(validated), calls
        assert all(exact for *_, exact in calls), calls
        assert len(told) == (1 if rank == 0 else 0), told


class UnevenEpochs(ClockedSteps):
    """Rank r's training loader gives 3 + r batches an epoch (shards of their own, no
    ``DistributedSampler``), its validation loader a ``DistributedSampler``'s even share: with
    ``max_steps`` the ranks validate at their own epochs' ends, rank 0 after steps 3 and 6, rank 1
    after 4 and 8."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass

    def train_dataloader(self) -> Any:
        loader = self._loader()
        shard = TensorDataset(torch.arange(3.0 + self.global_rank))
        return DataLoader(shard, collate_fn=loader.collate_fn)

    def val_dataloader(self) -> Any:
        loader = self._loader()
        sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(loader.dataset, sampler=sampler, collate_fn=loader.collate_fn)


def _uneven_epochs_fit(
    out: str, plan_ahead: bool, **validation: Any
) -> tuple[list[tuple[str, bool, int, bool]], list[str]]:
    with launched_by_torchrun(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = UnevenEpochs()
        module.vit_balance_config = dataclasses.replace(module.vit_balance_config, plan_ahead=plan_ahead)
        settings = {"logger": False, "callbacks": [], "use_distributed_sampler": False}
        trainer = quiet_trainer(out, "", strategy="ddp", max_steps=8, **validation, **settings)
        trainer.fit(module)
    return module.calls, [str(w.message) for w in caught if "training epochs differ" in str(w.message)]


def test_ranks_whose_training_epochs_differ_validate_directly(tmp_path: Path) -> None:
    """Training loaders of 3 and 4 batches and validation at each epoch's end: rank 0's balanced
    validation call met rank 1's training step, and the fit failed at the group's timeout. The
    ranks' epoch lengths are gathered once, at the first training plan or call; such a fit's validation
    encodes directly (told once, on rank 0, with the lengths), its training and sanity check still
    balance. Validation every N batches of the fit (``check_val_every_n_epoch=None``) is counted
    alike on every rank and stays balanced (planned in the calls, the lengths gathered there)."""
    with world(2) as w:
        ranks = w.run(_uneven_epochs_fit, str(tmp_path / "epochs"), True, timeout=120)
        counted = w.run(
            _uneven_epochs_fit,
            str(tmp_path / "steps"),
            False,
            val_check_interval=3,
            check_val_every_n_epoch=None,
        )
    for rank, (calls, told) in enumerate(ranks):
        assert all(balanced for stage, balanced, *_ in calls if stage in ("train", "sanity")), calls
        validated = [step for stage, balanced, step, _ in calls if stage == "validate" and not balanced]
        assert validated == ([3, 3, 6, 6] if rank == 0 else [4, 4, 8, 8]), calls
        assert all(exact for *_, exact in calls), calls
        lengths = "the ranks' training epochs differ in length (3, 4 batches, by rank)"
        assert [message.startswith(lengths) for message in told] == ([True] if rank == 0 else []), told
    for calls, told in counted:
        validated = [(step, balanced) for stage, balanced, step, _ in calls if stage == "validate"]
        assert validated == [(3, True), (3, True), (6, True), (6, True)], calls
        assert not told and all(exact for *_, exact in calls), calls


class LastBatchReordered(PlannedSteps):
    """Training and test steps of plans made ahead; the last one on rank 0 passes its grid rows
    reordered (same shape, other values), as read on a device: compared there, and read at the
    next gather."""

    def _step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 1 and self.global_rank == 0:
            batch = {**batch, "image_grid_thw": batch["image_grid_thw"].roll(1, 0)}
        return super()._step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, batch_idx)

    def test_dataloader(self) -> Any:
        return self._loader()


def _reordered_last_batch(out: str, entry: str) -> str:
    with launched_by_torchrun(), mock.patch.object(prepared_module, "_read_on_host", lambda tensor: False):
        # The fit validates nothing: its training's last call is the run's last.
        fit_only = {"max_epochs": 1, "limit_val_batches": 0, "num_sanity_val_steps": 0}
        trainer = quiet_trainer(
            out,
            "",
            strategy="ddp",
            logger=False,
            callbacks=[],
            use_distributed_sampler=True,
            **(fit_only if entry == "fit" else {}),
        )
        with caught(ValueError) as outcome:
            if entry == "fit":
                trainer.fit(LastBatchReordered())
            else:
                trainer.test(LastBatchReordered())
    return outcome.message


def test_a_run_reports_its_last_calls_mismatch_when_it_ends(tmp_path: Path) -> None:
    """A grid compared on the device is read at the next gather; after a run's last call there is
    none, and ``trainer.test`` returned rank 0's last outputs for other images than its own, with
    no error. The mixin reports such a mismatch when the run ends, on every rank: a fit's too,
    whose DDP wrapper the strategy takes off before the module's teardown (the check was skipped
    there, the wrapper being part of the run's key)."""
    with world(2) as w:
        for entry in ("test", "fit"):
            ranks = w.run(_reordered_last_batch, str(tmp_path / entry), entry, timeout=120)
            expected = "rank 0: an earlier call given a prepared plan passed a grid_thw"
            assert all(expected in r for r in ranks), (entry, ranks)


def test_plans_made_ahead_go_to_the_steps() -> None:
    """A plan made before the step is the step's: a call from another hook of the loop (a sharded
    ViT's, say) leaves it alone; without a Trainer the next call takes it. In evaluation, a module
    whose drop-in towers balance no evaluation forward plans nothing."""
    module = MixinFirst()
    ticket = object()
    state = module._vit_balance_state_object()
    trainer = mock.Mock(training=False)
    with mock.patch.object(MixinFirst, "_vit_balance_runner", return_value=(trainer, None)):
        module._current_fx_name = "validation_step"
        module._vit_balance_keep_ticket(ticket)
        module._current_fx_name = "on_validation_batch_end"
        assert module._vit_balance_take_ticket() is None and state.ticket is ticket
        module._current_fx_name = "validation_step"
        assert module._vit_balance_take_ticket() is ticket and state.ticket is None
        assert module._vit_balance_towers_balance()  # encode_images: the loop decides
        tower = mock.Mock(installed=True, evaluation=False)
        with mock.patch.object(MixinFirst, "_vit_balance_towers", (tower,)):
            assert not module._vit_balance_towers_balance()
            tower.evaluation = True
            assert module._vit_balance_towers_balance()
            trainer.training, tower.evaluation = True, False
            assert module._vit_balance_towers_balance()
    state.ticket = ticket
    assert module._vit_balance_take_ticket() is ticket  # no Trainer: the caller's own loop


def _sharded_evaluation(sharded: str | None) -> dict[str, Any]:
    """No Trainer, eval mode: a tower whose parameters FSDP2 shards (the tower a unit, or only a
    module of it) is balanced (each of its calls is a collective anyway), a plain one encodes
    directly; a tower sharded after a call made directly before is balanced from then on."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    module = MixinFirst(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
    module.vit_balance_group = dist.group.WORLD
    module.eval()
    pixel_values, grid = _images(4 if rank == 0 else 1, seed=rank)
    with torch.no_grad():
        module.encode_images(module.visual, pixel_values, grid)
    assert module.last_vit_balance_stats is None  # not yet sharded: direct
    if sharded is not None:
        fully_shard(module.visual if sharded == "tower" else module.visual.merger)
    with torch.no_grad():
        out = module.encode_images(module.visual, pixel_values, grid)
        direct = module.visual(pixel_values, grid)
    stats = module.last_vit_balance_stats
    return {
        "equal": bool(torch.allclose(out, direct, rtol=1e-5, atol=1e-6)),
        "applied": stats and stats.applied,
    }


def test_without_a_trainer_evaluation_balances_where_the_tower_is_sharded() -> None:
    with world(2) as w:
        assert w.run(_sharded_evaluation, "tower") == [{"equal": True, "applied": True}] * 2
        # Its class stays the tower's: only a walk of its modules tells.
        assert w.run(_sharded_evaluation, "merger") == [{"equal": True, "applied": True}] * 2
        assert w.run(_sharded_evaluation, None) == [{"equal": True, "applied": None}] * 2


class TornDown(MixinFirst):
    """Records that the mixin's ``teardown`` hands on to the next ``teardown`` in line."""

    def __init__(self) -> None:
        super().__init__()
        self.stages: list[str] = []

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        self.stages.append(stage)


def _two_rank_teardown() -> dict[str, Any]:
    rank = dist.get_rank()
    module = TornDown()
    module.vit_balance_group = dist.group.WORLD
    images = _images(4 if rank == 0 else 1, seed=rank)
    module.encode_images(module.visual, *images)
    held = module._vit_balance_state.balancer is not None and module._vit_balance_state.group is not None
    module.teardown("fit")
    state = module._vit_balance_state
    released = state.balancer is None and state.group is None and state.host_group is None
    # The last stats stay readable; the next call (a new run) makes its balancer again.
    kept = module.last_vit_balance_stats is not None
    again = module.encode_images(module.visual, *images)
    return {
        "held": held,
        "released": released,
        "kept": kept,
        "stages": module.stages,
        "again": bool(torch.allclose(again, module.visual(*images), rtol=1e-5, atol=1e-6)),
        "rebuilt": module._vit_balance_state.balancer is not None,
    }


def test_teardown_lets_go_of_the_runs_process_groups() -> None:
    # A balancer holding the gloo group until interpreter shutdown aborted ddp_spawn workers now
    # and then at exit (the HF drop-in ddp_spawn fit: 5 of 31 runs aborted before, none of 24 after).
    with world(2) as w:
        results = w.run(_two_rank_teardown)
    for result in results:
        assert result == {
            "held": True,
            "released": True,
            "kept": True,
            "stages": ["fit"],
            "again": True,
            "rebuilt": True,
        }


def _checkpoint_round_trip(module: MixinFirst, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``module.on_save_checkpoint`` into ``checkpoint``, through a ``weights_only`` load."""
    module.on_save_checkpoint(checkpoint)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _two_rank_checkpoints() -> dict[str, Any]:
    rank = dist.get_rank()
    calibrating = ViTBalanceConfig(calibrate_cost=True)
    images = [_images(4 - 3 * rank + step % 2, seed=step) for step in range(4)]
    module = MixinFirst(calibrating)
    module.vit_balance_group = dist.group.WORLD
    for pixel_values, grid_thw in images:
        module.encode_images(module.visual, pixel_values, grid_thw)
    saved = _checkpoint_round_trip(module, {"epoch": 0})
    # Saved after the run (Trainer.save_checkpoint after fit): the state outlives the run's balancer.
    module.teardown("fit")
    after_run = _checkpoint_round_trip(module, {"epoch": 0})
    resumed = MixinFirst(calibrating)
    resumed.vit_balance_group = dist.group.WORLD
    resumed.on_load_checkpoint(saved)
    for pixel_values, grid_thw in images[:2]:  # the first call carries no time yet
        resumed.encode_images(resumed.visual, pixel_values, grid_thw)
    continued = _checkpoint_round_trip(resumed, {})
    # A tower priced with a windowed term fits other terms: the state is left behind, with a warning.
    windowed = MixinFirst(ViTBalanceConfig(calibrate_cost=True, cost_windowed=1.0, cost_window_patches=4))
    windowed.vit_balance_group = dist.group.WORLD
    windowed.on_load_checkpoint(saved)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        windowed.encode_images(windowed.visual, *images[0])
    plain = MixinFirst()
    plain.vit_balance_group = dist.group.WORLD
    plain.encode_images(plain.visual, *images[0])
    return {
        "saved": saved["vit_balance"]["cost_calibrator"],
        "after_run": after_run == saved,
        "continued": continued["vit_balance"]["cost_calibrator"],
        "warned": [str(w.message) for w in caught if "saved balancer state" in str(w.message)],
        "windowed_steps": _checkpoint_round_trip(windowed, {})["vit_balance"]["cost_calibrator"][
            "steps_observed"
        ],
        "plain": _checkpoint_round_trip(plain, {}),
    }


def test_checkpoints_carry_the_online_cost_fit() -> None:
    with world(2) as w:
        first, second = w.run(_two_rank_checkpoints)
    # Every rank fed its calibrator the same gathered figures: rank 0's checkpoint is every rank's.
    assert first == second
    saved, continued = first["saved"], first["continued"]
    # 4 calls: 3 carried the previous call's times, 2 of them warm-up, 1 step of rows kept.
    assert saved["steps_observed"] == 3 and len(saved["history"]) == 1
    assert first["after_run"]
    # Resumed: 2 more calls, 1 observation (a new process warms up again), the rows go on.
    assert continued["steps_observed"] == 4 and continued["history"] == saved["history"]
    assert len(first["warned"]) == 1 and "window_patches=4" in first["warned"][0]
    assert first["windowed_steps"] == 0
    assert first["plain"] == {}


class _WithATeacher(WorldGroup):
    """A module holding another with the mixin (a teacher), whose checkpoint hooks Lightning does
    not call."""

    def __init__(self) -> None:
        super().__init__(ViTBalanceConfig(calibrate_cost=True))
        self.teacher = WorldGroup(ViTBalanceConfig(calibrate_cost=True))
        self.second = WorldGroup(ViTBalanceConfig(calibrate_cost=True))


def test_checkpoints_carry_a_nested_modules_cost_fit_by_its_name() -> None:
    """The teacher's online cost fit was left out of the Trainer's checkpoints, so a resumed fit
    restarted it; saved by its name in the module, it goes on, and an entry no module here takes is
    left behind with a warning."""
    from lightning_vit_balance import CostCalibrator

    calibrator = CostCalibrator(warmup_steps=0)
    for step in range(4):
        calibrator.observe([[16, 64 * (1 + step)], [4]], [1.0 + step, 0.1])
    state = {"cost_calibrator": calibrator.state_dict()}
    fresh: dict[str, Any] = {}
    _WithATeacher().on_save_checkpoint(fresh)
    assert fresh == {}  # nothing fitted anywhere: no entries
    module = _WithATeacher()
    module.teacher.load_vit_balance_state_dict(state)
    module.load_vit_balance_state_dict(state)
    checkpoint: dict[str, Any] = {}
    module.on_save_checkpoint(checkpoint)
    # The module's own under its key; of the nested ones, only the one with a fit.
    assert checkpoint == {"vit_balance": state, "vit_balance_nested": {"teacher": state}}
    resumed = _WithATeacher()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every entry is taken
        resumed.on_load_checkpoint(checkpoint)
    assert resumed.teacher.vit_balance_state_dict() == state == resumed.vit_balance_state_dict()
    assert resumed.second.vit_balance_state_dict() == {}
    # An entry that is no balancer's state is left behind, as the module's own would be.
    with pytest.warns(UserWarning, match="'vit_balance_nested' entry 'teacher' is not used .*starts afresh"):
        refused = _WithATeacher()
        refused.on_load_checkpoint({"vit_balance_nested": {"teacher": {"format": 2}}})
    assert refused.teacher.vit_balance_state_dict() == {}
    for name in ("student", ""):  # no such module, or the module itself (its entry is its own key)
        with pytest.warns(UserWarning, match=f"'vit_balance_nested' entry '{name}' is not used"):
            unused = _WithATeacher()
            unused.on_load_checkpoint({"vit_balance_nested": {name: state}})
        assert unused.vit_balance_state_dict() == {}


def test_nested_modules_are_drained_and_checked_in_the_order_of_their_first_calls() -> None:
    """Pending checks are collectives, and records feed the same metrics on every rank: the order
    is that of the nested modules' first balanced calls (the same on every rank), not of their
    addresses (a weak set's order, which differed between ranks), and the module's own come first
    in the records and last in the checks."""
    module = _WithATeacher()
    state = module._vit_balance_state_object()
    for nested in (module.second, module.teacher, module.second):
        state.nested[nested] = None
    for owner, stats in ((module, "own"), (module.teacher, "teacher"), (module.second, "second")):
        owner._vit_balance_state_object().records.append(stats)  # type: ignore[arg-type]
    assert module.pop_vit_balance_stats() == ["own", "second", "teacher"]
    checked: list[str] = []
    names = {id(module): "own", id(module.teacher): "teacher", id(module.second): "second"}
    with (
        mock.patch.object(WorldGroup, "_vit_balance_run_ends", return_value=True),
        mock.patch.object(
            WorldGroup, "check_vit_balance_pending", lambda self: checked.append(names[id(self)])
        ),
    ):
        module.teardown("fit")
    assert checked == ["second", "teacher", "own"]
    assert list(module._vit_balance_state_object().nested) == []  # released: the next run registers anew


def test_a_nested_module_takes_its_predict_batches_from_the_trainers_module() -> None:
    """The Trainer's module gathers every rank's predict batches at the run's start (its
    ``on_predict_start``, which Lightning calls on that module only): a nested teacher had none, so
    it never balanced in predict."""
    module = _WithATeacher()
    lengths = object()
    module._vit_balance_state_object().predict_lengths = lengths  # type: ignore[assignment]
    trainer = mock.Mock(training=False, validating=False, predicting=True)
    trainer.strategy.lightning_module = module
    seen = []
    with (
        mock.patch.object(WorldGroup, "_vit_balance_runner", return_value=(trainer, None)),
        mock.patch("lightning_vit_balance.lightning.mixin._loop_balances", lambda t, e, p: seen.append(p)),
    ):
        module.teacher._vit_balance_loop_balances(module.teacher.visual, ahead=True)
    assert seen == [lengths]


def test_fabric_module_asks_fabrics_strategy_once() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1)
    module = MixinFirst()
    fabric.setup(module)
    for count in (1, 2):
        module.encode_images(module.visual, *_images(count))
    assert module.group_lookups == 1
    # The lookup is keyed on the Fabric object it ran under (single device: no group).
    assert module._vit_balance_state.fit_key[0]() is fabric
    assert module._vit_balance_state.group is None
    assert module.visual.seen == [1, 2]


# ---------------------------------------------------------------------------- which loops balance


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        yield from torch.zeros(2, 1)


def _loader(kind: str) -> Any:
    data = TensorDataset(torch.zeros(4, 1))
    if kind == "distributed":  # what Lightning injects on several devices (rank 0 of 2 here)
        return DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=0, shuffle=False))
    return DataLoader(_Stream()) if kind == "iterable" else DataLoader(data)


class LoopProbe(MixinFirst):
    """Notes, in every loop, whether encode_images would balance there (given several ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.balances: dict[str, set[bool]] = {}

    def _probe(self, loop: str) -> None:
        self.balances.setdefault(loop, set()).add(_loop_balances(self.trainer))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._probe("train")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._probe("sanity" if self.trainer.sanity_checking else self.trainer.state.fn.value)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._probe("test")

    def predict_step(self, batch: Any, batch_idx: int) -> None:
        self._probe("predict")


def test_only_loops_where_every_rank_makes_the_same_calls_balance(tmp_path: Path) -> None:
    module = LoopProbe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader("plain"), _loader("distributed"))
        assert module.balances == {"train": {True}, "sanity": {True}, "fit": {True}}
        # The same Trainer validating other loaders judges those, not the fit's.
        for kind, expected in (("plain", False), ("iterable", False), ("distributed", True)):
            module.balances = {}
            trainer.validate(module, _loader(kind), verbose=False)
            trainer.test(module, _loader(kind), verbose=False)
            assert module.balances == {"validate": {expected}, "test": {expected}}, kind
        # Several loaders balance only where every one draws evenly: one plain loader among them
        # draws its own batches on each rank, which would wait on each other in a gather.
        module.balances = {}
        trainer.validate(module, [_loader("distributed"), _loader("plain")], verbose=False)
        assert module.balances == {"validate": {False}}
        # Predict balances the batches every rank runs, as every rank's lengths gathered at the run's
        # first batch tell: on one device nothing is gathered (see the next test).
        module.balances = {}
        trainer.predict(module, _loader("distributed"))
        assert module.balances == {"predict": {False}}
    assert _loop_balances(trainer) is False  # no loop running: nothing promised


class _BatchesOfTwo(torch.utils.data.Sampler[list[int]]):
    def __init__(self) -> None:
        self.batches = [[0, 1], [2, 3]]

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_predict_balances_the_batches_every_rank_runs() -> None:
    from lightning.pytorch.overrides.distributed import (
        UnrepeatedDistributedSamplerWrapper,
        _IndexBatchSamplerWrapper,
    )

    data = TensorDataset(torch.zeros(5, 1))
    unrepeated = UnrepeatedDistributedSamplerWrapper(
        torch.utils.data.SequentialSampler(data), num_replicas=2, rank=0
    )
    # The lengths count the batches where a DistributedSampler splits the samples, also as Lightning's
    # predict loader holds it (in its batch sampler, wrapped to record the indices); not a custom one's.
    assert _counts_its_batches(_loader("distributed"))
    as_predicted = _IndexBatchSamplerWrapper(torch.utils.data.BatchSampler(unrepeated, 1, drop_last=False))
    assert _counts_its_batches(DataLoader(data, batch_sampler=as_predicted))
    for loader in (_loader("plain"), _loader("iterable"), DataLoader(data, batch_sampler=_BatchesOfTwo())):
        assert not _counts_its_batches(loader)

    # Two loaders run in turn: rank 0 has 3 and 2 batches, rank 1 has 2 and 1.
    combined = object.__new__(L.pytorch.utilities.combined_loader.CombinedLoader)
    current = mock.Mock(completed=0)
    loop = mock.Mock(_combined_loader=combined, batch_progress=mock.Mock(current=current))
    trainer = mock.Mock(predict_loop=loop, num_predict_batches=[3, 2])
    gathered = _PredictLengths(weakref.ref(combined), ((3, 2), (2, 1)))
    answers = []
    for position in range(5):
        current.completed = position
        answers.append(_predict_balances(trainer, gathered))
    assert answers == [True, True, False, True, False]
    current.completed = 0
    assert not _predict_balances(trainer, None)  # nothing gathered
    other = object.__new__(L.pytorch.utilities.combined_loader.CombinedLoader)
    assert not _predict_balances(
        trainer, _PredictLengths(weakref.ref(other), ((3, 2), (2, 1)))
    )  # another run's
    trainer.num_predict_batches = [float("inf"), 2]
    assert not _predict_balances(trainer, gathered)  # a length Lightning does not know


class _Runner:
    """Stands for a Trainer (its status), a strategy or a wrapped module in a run key."""

    def __init__(self, status: TrainerStatus = TrainerStatus.RUNNING) -> None:
        self.state = types.SimpleNamespace(status=status)


def test_a_reused_trainers_ended_run_lets_its_twin_go_and_a_nested_modules_keeps_it() -> None:
    """As a run starts, the twins of runs that ended without their teardown go: a run the same
    Trainer ran before (another wrapped module), or whose Trainer raised. A module nested in the
    running one (Lightning attaches its Trainer to child LightningModules too) is in the same run:
    releasing its twin would make each module's next call build its own again, call after call."""
    trainer, strategy, fitted_before, fitting = _Runner(), _Runner(), _Runner(), _Runner()
    interrupted = _Runner(TrainerStatus.INTERRUPTED)
    keys = {
        "starting": (trainer, strategy, fitting),
        "nested": (trainer, strategy, fitting),
        "before": (trainer, strategy, fitted_before),
        "another_trainer": (_Runner(), strategy, fitted_before),
        "raised": (interrupted, strategy, fitted_before),
        "no_runner": (None, None, None),  # a module given a group of its own, no Trainer or Fabric
    }
    states = {}
    for name, objects in keys.items():
        states[name] = _State()
        states[name].fit_key = (*(_ref(o) for o in objects), None, None)
        _TWIN_HOLDERS.add(states[name])
    try:
        _release_ended_runs(states["starting"], trainer)
        held = {name for name, state in states.items() if state in _TWIN_HOLDERS}
        assert held == {"starting", "nested", "another_trainer", "no_runner"}
        assert states["before"].fit_key is None and states["nested"].fit_key is not None
        _release_ended_runs(states["starting"], None)  # a Fabric run starting: no Trainer to compare
        assert {name for name, state in states.items() if state in _TWIN_HOLDERS} == held
    finally:
        for state in states.values():
            _TWIN_HOLDERS.discard(state)
