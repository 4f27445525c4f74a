"""A tiny VLM trained with ViTBalanceMixin and ViTBalanceCallback on 2 CPU ranks.

Imported by ``test_lightning_fit.py`` (a ``ddp_spawn`` fit), ``test_lightning_loops.py`` (fits,
resumes and predictions on the test pool's ranks, launched as ``torchrun`` would) and
``test_hf_dropin.py`` (:func:`quiet_trainer`), and run as a script for the ``ddp`` strategy,
whose launcher starts the other rank by running this same script again::

    python tests/lightning_fit_script.py OUT_DIR
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parent))

from towers import CHANNELS, TensorTower

from lightning_vit_balance import ViTBalanceCallback, ViTBalanceConfig, ViTBalanceMixin

STEPS = 4
RANKS = 2


def make_sample(step: int, rank: int) -> dict[str, torch.Tensor]:
    """What ``rank`` encodes at ``step``; the heavy rank alternates between steps.

    Images: the heavy rank has four 4x4 grids (16 patches each), the other one 2x2 grid, so the
    plan applies. Videos: the other rank holds one video heavier than all of the heavy rank's
    videos: no plan lowers the makespan, so that call skips ("no-gain").
    """
    generator = torch.Generator().manual_seed(1000 + RANKS * step + rank)
    heavy = (step + rank) % RANKS == 0
    images = [(1, 4, 4)] * 4 if heavy else [(1, 2, 2)]
    videos = [(2, 2, 2)] if heavy else [(2, 4, 4)]

    def pixels(grids: list[tuple[int, int, int]]) -> torch.Tensor:
        rows = sum(t * h * w for t, h, w in grids)
        return torch.randn(rows, CHANNELS, generator=generator)  # [sum(l_i), C]

    return {
        "pixel_values": pixels(images),
        "image_grid_thw": torch.tensor(images, dtype=torch.int64),
        "pixel_values_videos": pixels(videos),
        "video_grid_thw": torch.tensor(videos, dtype=torch.int32),
    }


def first(batch: list[Any]) -> Any:
    return batch[0]


class TinyVLM(ViTBalanceMixin, L.LightningModule):
    """Encodes images and videos in two calls per step, as a VLM does; a linear head makes a loss."""

    def __init__(self, vit_balance_config: ViTBalanceConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vit_balance_config = vit_balance_config
        torch.manual_seed(0)
        self.visual = TensorTower()
        self.head = torch.nn.Linear(24, 1)

    def step_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training step's loss: images and videos encoded in two calls, then the head."""
        images = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
        videos = self.encode_images(self.visual, batch["pixel_values_videos"], batch["video_grid_thw"])
        return self.head(torch.cat([images, videos])).pow(2).mean()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.step_loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # Each rank builds its own batches (the Trainer adds no DistributedSampler).
        samples = [make_sample(step, self.global_rank) for step in range(STEPS)]
        return torch.utils.data.DataLoader(samples, batch_size=1, shuffle=False, collate_fn=first)


class PlanAheadVLM(TinyVLM):
    """:class:`TinyVLM` whose images call is planned in ``on_before_batch_transfer`` (the step's
    first call); the videos call after it gathers and plans in the forward as usual."""

    vit_balance_prepare_keys = (("pixel_values", "image_grid_thw"),)


def fit(
    out_dir: str, version: str, enabled: bool, strategy: str, verbose: bool = False, plan_ahead: bool = False
) -> TinyVLM:
    """Train for :data:`STEPS` steps on 2 CPU ranks; metrics go to ``out_dir/version/metrics.csv``.

    ``plan_ahead``: the :class:`PlanAheadVLM` (one call per step, planned before the forward).
    """
    torch.set_num_threads(1)
    config = ViTBalanceConfig(enabled=enabled, verbose=verbose, plan_ahead=plan_ahead)
    model = PlanAheadVLM(config) if plan_ahead else TinyVLM(config)
    trainer = quiet_trainer(out_dir, version, strategy=strategy, max_steps=STEPS)
    trainer.fit(model)
    return model


class CollectBeforeExit(Callback):
    """Collects the process's garbage at its exit, before Lightning destroys the process group.

    With torch 2.13 and gloo, a process that exits with a ``DistributedDataParallel`` module still
    alive often aborts in the interpreter's finalization ("terminate called without an active
    exception", SIGABRT), whatever the package does: a plain torch script (DDP on gloo, four
    steps, ``torch.multiprocessing.spawn``) aborted in 5 of 30 runs, and in 15 of 30 without the
    backward passes. Lightning unwraps its DDP module at teardown, where reference cycles keep it
    alive; deleting it and collecting before the group's destruction made 0 aborts in 30. Registered
    in the process that trains (``setup`` runs there, after Lightning registered its own exit
    handler, so this one runs first).
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        atexit.unregister(gc.collect)  # once per process, and after any handler registered since
        atexit.register(gc.collect)


def quiet_trainer(out_dir: str, version: str, **settings: Any) -> L.Trainer:
    """A Trainer on :data:`RANKS` CPU ranks with :class:`ViTBalanceCallback`, logging every step to
    ``out_dir/version/metrics.csv``; no sampler added, no checkpoints, progress bar or summary.
    ``settings`` add to these."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": RANKS,
        "logger": CSVLogger(out_dir, name="", version=version),
        "callbacks": [ViTBalanceCallback(), CollectBeforeExit()],
        "log_every_n_steps": 1,
        "use_distributed_sampler": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**defaults, **settings})


# ---------------------------------------------------------------------------- other loops, checkpoints

#: Not the defaults, so a configuration read back from a checkpoint is told from a fresh one; the
#: locality solver does not read the refine fields, so the plans are the default ones. The online
#: cost fit keeps the initial model too: the loops' calls give it at most 8 rows, and a fit needs 12.
LOOP_CONFIG = ViTBalanceConfig(refine_iterations=7, refine_tolerance=0.01, calibrate_cost=True)
#: Samples of the two predict loaders: 5 and 3 on 2 ranks, which Lightning's predict sampler
#: splits 3 / 2 and 2 / 1 (batches of 1).
PREDICT_SAMPLES = (5, 3)


def eval_samples(count: int, offset: int) -> list[dict[str, torch.Tensor]]:
    """A dataset of ``count`` samples (the same on every rank), to split across ranks."""
    return [make_sample(offset + i, i % RANKS) for i in range(count)]


def predict_samples(count: int, offset: int) -> list[dict[str, torch.Tensor]]:
    """A predict dataset: heavy samples at even indices, light ones at odd, so that Lightning's predict
    sampler gives rank 0 of 2 the heavy ones and the balanced calls move images."""
    return [make_sample(offset + i, 0) for i in range(count)]


#: Seconds :class:`LoopVLM`'s validation ViT calls take at least.
VALIDATION_VIT_S = 0.2


class LoopVLM(TinyVLM):
    """TinyVLM that also validates (balanced: a DistributedSampler) and predicts (balanced in the
    batches every rank runs, encoded directly in the others).

    An epoch is 2 steps, with the loader rebuilt every epoch, so a checkpoint after step 2 ends an
    epoch and resuming trains on the samples of steps 2 and 3 (a loader resumed mid-epoch would
    start again from its first batch).
    """

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        first_step = 2 * self.trainer.current_epoch
        samples = [make_sample(step, self.global_rank) for step in range(first_step, first_step + 2)]
        return torch.utils.data.DataLoader(samples, batch_size=1, shuffle=False, collate_fn=first)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        before = self.last_vit_balance_stats
        # Validation's ViT takes far longer than training's (full-size images): the training
        # steps after it must not report its time as theirs (vit_balance/vit_ms_*).
        slow = self.visual.register_forward_pre_hook(lambda module, args: time.sleep(VALIDATION_VIT_S))
        try:
            images = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
        finally:
            slow.remove()
        stats = self.last_vit_balance_stats
        balanced = stats is not before and stats is not None and stats.num_ranks == RANKS
        error = (images - self.visual(batch["pixel_values"], batch["image_grid_thw"])).abs().max()
        # Reduced over the batches and the ranks: the worst of both.
        self.log("val_balanced", float(balanced), on_epoch=True, reduce_fx="min", sync_dist=True)
        self.log("val_max_error", error, on_epoch=True, reduce_fx="max", sync_dist=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        # 3 samples: the sampler pads to 2 batches per rank (use_distributed_sampler is off here).
        samples = eval_samples(3, offset=100)
        sampler = torch.utils.data.DistributedSampler(samples, shuffle=False)
        return torch.utils.data.DataLoader(samples, batch_size=1, sampler=sampler, collate_fn=first)

    def predict_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> dict[str, Any]:
        before = self.last_vit_balance_stats
        images = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
        stats = self.last_vit_balance_stats
        balanced = stats is not before and stats is not None and stats.num_ranks == RANKS
        collectives = stats.collectives if balanced and stats is not None else 0
        return {
            "images": images,
            "balanced": balanced,
            "collectives": collectives,
            "applied": balanced and stats.applied,
        }


class PredictionFiles(BasePredictionWriter):
    """Each rank saves each predict run's predictions (one per batch of 1) and their dataset indices,
    per dataloader, to ``{run}_rank_{r}.pt``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(write_interval="epoch")
        self.out_dir = Path(out_dir)
        self.run = "off"

    def write_on_epoch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        # Lightning hands one dataloader's predictions unnested; `batch_indices` has one list per loader.
        per_loader = predictions if len(batch_indices) > 1 else [predictions]
        indices = [[index for batch in loader for index in batch] for loader in batch_indices]
        record = {"predictions": [list(loader) for loader in per_loader], "indices": indices}
        torch.save(record, self.out_dir / f"{self.run}_rank_{trainer.global_rank}.pt")


def fit_with_checkpoints(out_dir: str, version: str, max_steps: int, ckpt_path: str | None = None) -> LoopVLM:
    """Fit :class:`LoopVLM` to ``max_steps``, from ``ckpt_path`` if given, checkpointing every step,
    on ranks launched and joined in a process group already (``torchrun``, or the test pool).

    The checkpoint callback monitors ``vit_balance/imbalance_after``; ``out_dir/checkpoints/last.ckpt``
    is the latest step.
    """
    torch.set_num_threads(1)
    checkpoints = ModelCheckpoint(
        dirpath=Path(out_dir) / "checkpoints",
        filename="{step}",
        monitor="vit_balance/imbalance_after",
        mode="min",
        every_n_train_steps=1,
        save_top_k=1,
        save_last=True,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy="ddp",
        max_steps=max_steps,
        logger=CSVLogger(out_dir, name="", version=version),
        callbacks=[ViTBalanceCallback(), checkpoints],
        log_every_n_steps=1,
        use_distributed_sampler=False,
        reload_dataloaders_every_n_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = LoopVLM(LOOP_CONFIG)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def predict_from_checkpoint(ckpt_path: str, out_dir: str) -> None:
    """Load :class:`LoopVLM` with default (``weights_only``) loading and predict on uneven data, on
    ranks launched and joined in a process group already: the second loader alone, without
    ``vit_balance_predict``; then with it, both loaders, again the second alone with plans made
    ahead, and from a datamodule with a batch hook of its own (the same Trainer throughout)."""
    torch.set_num_threads(1)
    model = LoopVLM.load_from_checkpoint(ckpt_path)
    config = model.vit_balance_config
    loaded = {"type": type(config).__name__, "fields": dataclasses.asdict(config)}
    (Path(out_dir) / "loaded.json").write_text(json.dumps(loaded))
    writer, balance = PredictionFiles(out_dir), ViTBalanceCallback()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy="ddp",
        logger=False,
        callbacks=[writer, balance],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loaders = [
        torch.utils.data.DataLoader(
            predict_samples(count, offset=200 + 10 * k), batch_size=1, collate_fn=first
        )
        for k, count in enumerate(PREDICT_SAMPLES)
    ]

    def predict(run: str, **data: Any) -> None:
        """One predict run; each rank saves the callback's ``last_predict_metrics`` of it as
        ``{run}_metrics_rank_{r}.json``."""
        writer.run = run
        trainer.predict(model, return_predictions=False, **data)
        saved = Path(out_dir) / f"{run}_metrics_rank_{trainer.global_rank}.json"
        saved.write_text(json.dumps(balance.last_predict_metrics))

    predict("off", dataloaders=loaders[1])  # vit_balance_predict is off by default
    model.vit_balance_predict = True
    predict("first", dataloaders=loaders)
    model.vit_balance_config = dataclasses.replace(config, plan_ahead=True)
    model.vit_balance_prepare_keys = (("pixel_values", "image_grid_thw"),)  # its steps encode images only
    predict("second", dataloaders=loaders[1])
    predict("datamodule", datamodule=BatchHookData(loaders[1]))


class BatchHookData(L.LightningDataModule):
    """A datamodule whose ``on_before_batch_transfer`` Lightning runs instead of the module's."""

    def __init__(self, loader: torch.utils.data.DataLoader) -> None:
        super().__init__()
        self.loader = loader

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self.loader

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


if __name__ == "__main__":
    # The fits run in the same two processes: the launcher starts rank 1 once, at the first fit.
    out = sys.argv[1]
    for run_version, enabled, plan_ahead in (
        ("ddp_disabled", False, False),
        ("ddp", True, False),
        ("planned", True, True),
    ):
        trained = fit(out, run_version, enabled, "ddp", verbose=not plan_ahead, plan_ahead=plan_ahead)
        if trained.global_rank == 0:
            torch.save(trained.state_dict(), Path(out) / run_version / "weights.pt")
