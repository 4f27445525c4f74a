"""ViT balancing with Hugging Face's Qwen2-VL and Qwen3-VL vision towers, unchanged.

The towers are built from tiny random configs (nothing is downloaded). With transformers 5 they
return a ``BaseModelOutputWithPooling``: ``last_hidden_state`` (one row per patch),
``pooler_output`` (one row per merged token) and, for Qwen3-VL, ``deepstack_features`` (a list of
merged-token tensors). With transformers 4.x they return the merged tokens, and Qwen3-VL a tuple
of them and the deepstack list. ``self.encode_images`` returns the same structure, with every row
back on its original rank and in its original order.

    python examples/hf_qwen_vit_balance.py --steps 4        # both towers, 2 ranks, CPU

Needs the ``hf`` extra (``pip install lightning-vit-balance[hf]``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_vit_balance import ViTBalanceCallback, ViTBalanceConfig, ViTBalanceMixin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_vit_balance import read_csv
from tiny_vlm import SyntheticVLMDataset, TinyTextDecoder, collate_vlm, output_dir, positive_int

__all__ = [
    "FAMILIES",
    "HFQwenVLM",
    "main",
    "tiny_qwen2_vl_tower",
    "tiny_qwen3_vl_tower",
    "tower_patch_dim",
    "vision_features",
]

FAMILIES = ("qwen2_vl", "qwen3_vl")
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
IN_CHANNELS = 3
OUT_DIM = 48  # width of the merged tokens (the language model's width)


def tower_patch_dim() -> int:
    """Features per flattened patch of the tiny towers: ``3 * 2 * 14 * 14``."""
    return IN_CHANNELS * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE


def tiny_qwen2_vl_tower(seed: int = 0) -> nn.Module:
    """A randomly initialised two-block Qwen2-VL vision tower."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = Qwen2VLVisionConfig(
        depth=2,
        embed_dim=32,
        hidden_size=OUT_DIM,
        num_heads=2,
        mlp_ratio=2,
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        in_channels=IN_CHANNELS,
        spatial_merge_size=2,
    )
    torch.manual_seed(seed)
    return Qwen2VisionTransformerPretrainedModel(config)


def tiny_qwen3_vl_tower(seed: int = 0) -> nn.Module:
    """A randomly initialised three-block Qwen3-VL vision tower with two deepstack layers."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        in_channels=IN_CHANNELS,
        spatial_merge_size=2,
        out_hidden_size=OUT_DIM,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0, 1],
    )
    torch.manual_seed(seed)
    return Qwen3VLVisionModel(config)


def vision_features(output: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(merged tokens [n_tokens, OUT_DIM], deepstack features)`` of a tower's output, from a
    ``ModelOutput`` (transformers 5), a tensor or a ``(merged, deepstack)`` tuple (4.x)."""
    if isinstance(output, torch.Tensor):
        return output, []
    if isinstance(output, tuple):
        return output[0], list(output[1])
    return output.pooler_output, list(getattr(output, "deepstack_features", None) or [])


class HFQwenVLM(ViTBalanceMixin, L.LightningModule):
    """A Hugging Face Qwen vision tower feeding a tiny text decoder, balanced by the mixin.

    Args:
        family: ``"qwen2_vl"`` or ``"qwen3_vl"``.
        vit_balance_config: Balancing configuration (``None``: defaults, balancing on).
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        family: Literal["qwen2_vl", "qwen3_vl"] = "qwen3_vl",
        vit_balance_config: ViTBalanceConfig | None = None,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"family={family!r} is not supported: expected one of {FAMILIES}.")
        self.vit_balance_config = vit_balance_config or ViTBalanceConfig()
        self.visual = tiny_qwen2_vl_tower() if family == "qwen2_vl" else tiny_qwen3_vl_tower()
        self.decoder = TinyTextDecoder(dim=OUT_DIM, depth=2)
        self.lr = lr

    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        grid_thw = batch["image_grid_thw"]  # [n_images, 3]
        merged, deepstack = vision_features(self.encode_images(self.visual, batch["pixel_values"], grid_thw))
        merged_per_image = (grid_thw.prod(-1) // 4).tolist()
        tokens_per_sample, first = [], 0
        for count in batch["images_per_sample"].tolist():
            tokens_per_sample.append(sum(merged_per_image[first : first + count]))
            first += count
        loss = self.decoder(merged, tokens_per_sample, batch["input_ids"], deepstack)
        self.log("train_loss", loss.detach(), prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train each tower for a few steps on 2 CPU ranks with the callback; print what happened."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=positive_int, default=4, help="training steps per tower (default 4)")
    parser.add_argument("--devices", type=positive_int, default=2, help="CPU ranks (default 2)")
    parser.add_argument(
        "--family", choices=(*FAMILIES, "both"), default="both", help="the tower to train (default both)"
    )
    parser.add_argument(
        "--output",
        type=output_dir,
        default="demo_output/hf_qwen",
        help="the CSV logs' folder (default demo_output/hf_qwen)",
    )
    args = parser.parse_args(argv)
    families = FAMILIES if args.family == "both" else (args.family,)
    results = {}
    for family in families:
        L.seed_everything(0, verbose=False)
        model = HFQwenVLM(family, ViTBalanceConfig(trigger_threshold=0.1))
        dataset = SyntheticVLMDataset(
            args.steps * 2 * args.devices, patch_dim=tower_patch_dim(), scale=0.35, seed=1
        )
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=collate_vlm)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy="ddp_spawn",
            max_steps=args.steps,
            logger=CSVLogger(args.output, name=family, version=""),
            callbacks=[ViTBalanceCallback()],
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(model, loader)
        # Each ddp_spawn worker logs on its own; read the last value of every series back from the CSV.
        metrics = read_csv(Path(args.output) / family / "metrics.csv")
        results[family] = {key: pairs[-1][1] for key, pairs in metrics.items()}
        applied = results[family].get("vit_balance/applied_total", float("nan"))
        calls = results[family].get("vit_balance/calls_total", float("nan"))
        print(
            f"{family}: balancing applied on {applied:.0f} of {calls:.0f} ViT calls, final loss "
            f"{results[family].get('train_loss', float('nan')):.4f}; logs in {args.output}/{family}"
        )
    return results


if __name__ == "__main__":
    main()
