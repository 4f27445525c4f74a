"""A Hugging Face Qwen-VL fine-tuned under Lightning's ``ModelParallelStrategy`` (FSDP2), balanced.

Run by ``test_hf_dropin.py`` on the test pool's ranks, launched as ``torchrun`` would; as a
script, the strategy's launcher starts the other rank by running this same script again. Two CPU
ranks, a ``(2, 1)`` mesh (data parallel only); ``configure_model`` makes each vision block, the
tower and each decoder layer an FSDP2 unit, then the whole model. After the last step, validation
runs ``model(**batch).loss`` in its step and ``generate()`` in a callback's hook on the same
batches (a ``DistributedSampler`` hands each rank its own, so the mixin balances them, the hook's
too as the tower is sharded: without that, a text-only rank would skip the tower's parameter
gathers). Each rank writes its training and validation losses, its generated tokens and the
drop-in's counts::

    python tests/hf_fsdp2_fit_script.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_models import generation_prompt, generation_settings, make_inputs, tiny_model

from lightning_vit_balance import ViTBalanceCallback, ViTBalanceConfig, ViTBalanceMixin

FAMILY = "qwen2_5_vl"
STEPS = 3
RANKS = 2
SGD_LR = 0.5
#: Per step, each rank's samples: a text-only rank, images next to videos; images move every step.
BATCHES: list[list[list[dict[str, Any]]]] = [
    [[{"images": [(1, 8, 8)], "videos": [(2, 4, 4)]}], [{}]],
    [[{}], [{"videos": [(2, 4, 4)]}, {"images": [(1, 4, 4)]}]],
    [[{"images": [(1, 4, 4)]}], [{"images": [(1, 8, 4), (1, 4, 4)]}]],
]


def batch_for(step: int, rank: int) -> dict[str, Any]:
    return make_inputs(FAMILY, BATCHES[step][rank], seed=2000 + 10 * step + rank)


def _first(items: list[Any]) -> Any:
    return items[0]


class ShardedFinetune(ViTBalanceMixin, L.LightningModule):
    """``self.model(**batch).loss`` with ``balance_vision_tower``; FSDP2 units in ``configure_model``."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.vit_balance_config = ViTBalanceConfig(trigger_threshold=0.0)
        self.model = tiny_model(FAMILY)
        self.handle = self.balance_vision_tower(self.model)
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.generated: list[list[list[int]]] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        inner = self.model.model
        # The tower a unit too, around its blocks: transformers 5's generate() encodes images
        # outside the model's forward, where only the tower's own unit gathers its parameters.
        for unit in [*inner.visual.blocks, inner.visual, *inner.language_model.layers, self.model]:
            fully_shard(unit, mesh=mesh)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.val_losses.append(float(self.model(**batch).loss))

    def on_train_end(self) -> None:
        stats = self.last_vit_balance_stats
        summary = {
            "losses": self.losses,
            "val_losses": self.val_losses,
            "generated": self.generated,
            "calls": self.handle.calls,
            "applied_calls": self.handle.applied_calls,
            "num_ranks": stats.num_ranks if stats is not None else None,
        }
        (Path(self.out_dir) / f"rank_{self.global_rank}.json").write_text(json.dumps(summary))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=SGD_LR)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        batches = [batch_for(step, self.global_rank) for step in range(STEPS)]
        return torch.utils.data.DataLoader(batches, batch_size=1, collate_fn=_first)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        # Item i is rank i % RANKS's batch of step i // RANKS: the sampler hands each rank its own.
        batches = [batch_for(step, rank) for step in range(STEPS) for rank in range(RANKS)]
        sampler = torch.utils.data.DistributedSampler(batches, RANKS, self.global_rank, shuffle=False)
        return torch.utils.data.DataLoader(batches, batch_size=1, sampler=sampler, collate_fn=_first)


class GenerateSamples(L.Callback):
    """Generates from each validation batch in a hook of the loop, not in its step, as sample
    logging does: on every rank (``synced_gpus``, as sharded parameters need), a different number of
    tokens on each rank. The tower's parameters are sharded, so the image encoding is balanced there
    too: a text-only rank joins the gathers."""

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: ShardedFinetune, outputs: Any, batch: Any, *args: Any
    ) -> None:
        model = pl_module.model
        settings = generation_settings(pl_module.global_rank)
        tokens = model.generate(**generation_prompt(model, batch), **settings, synced_gpus=True)
        pl_module.generated.append(tokens.tolist())


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=RANKS,
        strategy=ModelParallelStrategy(data_parallel_size=RANKS, tensor_parallel_size=1),
        max_steps=STEPS,
        callbacks=[ViTBalanceCallback(log_every_n_steps=0), GenerateSamples()],
        logger=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ShardedFinetune(out_dir))


if __name__ == "__main__":
    main(sys.argv[1])
