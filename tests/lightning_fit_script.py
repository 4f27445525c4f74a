"""A tiny VLM trained with ViTBalanceMixin and ViTBalanceCallback on 2 CPU ranks.

Imported by ``test_lightning_fit.py`` (``ddp_spawn`` fits) and run as a script for the ``ddp``
strategy, whose launcher starts the other rank by running this same script again::

    python tests/lightning_fit_script.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
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

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images = self.encode_images(self.visual, batch["pixel_values"], batch["image_grid_thw"])
        videos = self.encode_images(self.visual, batch["pixel_values_videos"], batch["video_grid_thw"])
        loss = self.head(torch.cat([images, videos])).pow(2).mean()
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # Each rank builds its own batches (the Trainer adds no DistributedSampler).
        samples = [make_sample(step, self.global_rank) for step in range(STEPS)]
        return torch.utils.data.DataLoader(samples, batch_size=1, shuffle=False, collate_fn=first)


def fit(out_dir: str, version: str, enabled: bool, strategy: str, verbose: bool = False) -> TinyVLM:
    """Train for :data:`STEPS` steps on 2 CPU ranks; metrics go to ``out_dir/version/metrics.csv``."""
    torch.set_num_threads(1)
    model = TinyVLM(ViTBalanceConfig(enabled=enabled, verbose=verbose))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=strategy,
        max_steps=STEPS,
        logger=CSVLogger(out_dir, name="", version=version),
        callbacks=[ViTBalanceCallback()],
        log_every_n_steps=1,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    return model


if __name__ == "__main__":
    # Both fits run in the same two processes: the launcher starts rank 1 once, at the first fit.
    out = sys.argv[1]
    for run_version, run_enabled in (("ddp_disabled", False), ("ddp", True)):
        trained = fit(out, run_version, run_enabled, "ddp", verbose=True)
        if trained.global_rank == 0:
            torch.save(trained.state_dict(), Path(out) / run_version / "weights.pt")
