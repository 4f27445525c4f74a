"""Fine-tune a Hugging Face Qwen2.5-VL model through ``model(**batch)``, ViT work balanced across ranks.

The first half of this file is the code a Qwen-VL user already has: a model, a dataset of
documents, videos, photos and text-only samples, a collator that gives what the processor gives
(``input_ids`` with vision placeholder tokens, ``pixel_values``, ``image_grid_thw``,
``pixel_values_videos``, ``video_grid_thw``, ...), and a LightningModule whose step is
``self.model(**batch).loss``. Balancing adds three lines, marked ``# <-- vit balance``: the
mixin, ``self.balance_vision_tower(self.model)`` and the callback. DDP then also runs with
``find_unused_parameters=False``, although some ranks get text-only batches.

The second half measures: it trains twice on 2 ``ddp_spawn`` CPU ranks with the same seed and
data, once as plain Hugging Face (balancing disabled: the model runs unpatched, and plain HF + DDP
needs ``find_unused_parameters=True`` when a rank has no images) and once balanced, and prints
the step time of the slowest rank, the imbalance, what moved and the losses of both runs side by
side.

    python examples/hf_qwen_finetune.py              # both runs, about a minute on 2 cores
    python examples/hf_qwen_finetune.py --steps 3    # a smoke run

The model is a tiny random Qwen2.5-VL built from a config (nothing is downloaded); with a real
checkpoint, ``from_pretrained`` and the processor replace :func:`tiny_qwen2_5_vl` and
:func:`collate`. Needs the ``hf`` extra (``pip install lightning-vit-balance[hf]``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from tiny_vlm import output_dir, positive_int, seed_int

from lightning_vit_balance import ViTBalanceCallback, ViTBalanceConfig, ViTBalanceMixin

__all__ = ["MixedVisionDataset", "QwenVLFinetune", "collate", "main", "tiny_qwen2_5_vl"]

# ------------------------------------------------------------------------------------ the user's code

VOCAB = 256
IMAGE, VIDEO, VISION_START, VISION_END = 252, 253, 254, 255  # special token ids of the tiny vocabulary
PATCH, TEMPORAL_PATCH, MERGE = 14, 2, 2
CHANNELS = 3 * TEMPORAL_PATCH * PATCH * PATCH  # values per row of pixel_values: 1176


def tiny_qwen2_5_vl(seed: int = 0) -> torch.nn.Module:
    """A randomly initialised small Qwen2.5-VL (stands in for ``from_pretrained``)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 0, "eos_token_id": 1,
            # transformers 5 reads this as rope_parameters; 4.x wants "type" next to the sections.
            "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 64,
            "patch_size": PATCH, "temporal_patch_size": TEMPORAL_PATCH, "spatial_merge_size": MERGE,
            "window_size": 112, "fullatt_block_indexes": [3],
        },
        image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


class MixedVisionDataset(torch.utils.data.Dataset):
    """Samples as a Qwen-VL fine-tuning set has them: multi-page documents, videos, photos, text.

    Sample ``i`` depends only on ``(seed, i)``. Sizes are in patches (multiples of the merge size).
    """

    KINDS = (("document", 0.25), ("video", 0.2), ("photo", 0.25), ("text", 0.3))

    def __init__(self, num_samples: int, seed: int = 0, text_len: int = 16) -> None:
        self.num_samples, self.seed, self.text_len = num_samples, seed, text_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        weights = torch.tensor([weight for _, weight in self.KINDS])
        kind = self.KINDS[int(torch.multinomial(weights, 1, generator=gen))][0]

        def side(low: int, high: int) -> int:
            return MERGE * int(torch.randint(low, high + 1, (1,), generator=gen))

        images, videos = [], []
        if kind == "document":
            pages = int(torch.randint(2, 5, (1,), generator=gen))
            images = [(1, side(16, 22), side(12, 16)) for _ in range(pages)]
        elif kind == "video":
            videos = [(int(torch.randint(3, 6, (1,), generator=gen)), side(6, 8), side(8, 10))]
        elif kind == "photo":
            images = [(1, side(6, 10), side(6, 10))]
        # A learnable text: an arithmetic sequence whose start and step depend on the sample.
        start, step = (int(v) for v in torch.randint(0, VOCAB - 4, (2,), generator=gen))
        text = ((start + (step | 1) * torch.arange(self.text_len)) % (VOCAB - 4)).tolist()
        pixels = {
            key: torch.randn(sum(t * h * w for t, h, w in grids), CHANNELS, generator=gen)
            for key, grids in (("images", images), ("videos", videos))
        }
        return {"images": images, "videos": videos, "text": text, "pixels": pixels}


def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What a Qwen-VL processor and collator give: vision placeholders in the text, pixel rows, grids.

    Keys of absent modalities are left out, as the processor leaves them out.
    """
    rows = []
    for sample in samples:
        ids, types = [], []
        for key, token, code in (("images", IMAGE, 1), ("videos", VIDEO, 2)):
            for t, h, w in sample[key]:
                count = t * h * w // MERGE**2  # one placeholder per merged token
                ids += [VISION_START, *[token] * count, VISION_END]
                types += [0, *[code] * count, 0]
        rows.append((ids + sample["text"], types + [0] * len(sample["text"])))
    length = max(len(ids) for ids, _ in rows)
    batch: dict[str, Any] = {
        "input_ids": torch.zeros(len(rows), length, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), length, dtype=torch.long),
        "mm_token_type_ids": torch.zeros(len(rows), length, dtype=torch.int32),
    }
    for i, (ids, types) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = 1
        batch["mm_token_type_ids"][i, : len(ids)] = torch.tensor(types, dtype=torch.int32)
    # Learn the text only: no loss on vision placeholders and padding.
    batch["labels"] = batch["input_ids"].masked_fill(
        (batch["mm_token_type_ids"] != 0) | (batch["attention_mask"] == 0), -100
    )
    for key, pixels_key, grid_key in (
        ("images", "pixel_values", "image_grid_thw"),
        ("videos", "pixel_values_videos", "video_grid_thw"),
    ):
        grids = [grid for sample in samples for grid in sample[key]]
        if grids:
            batch[pixels_key] = torch.cat([sample["pixels"][key] for sample in samples])
            batch[grid_key] = torch.tensor(grids, dtype=torch.long)
    return batch


class QwenVLFinetune(ViTBalanceMixin, L.LightningModule):  # <-- vit balance (the mixin)
    """Fine-tunes a Qwen-VL model on ``model(**batch).loss``."""

    def __init__(self, vit_balance_config: ViTBalanceConfig | None = None, lr: float = 1e-3) -> None:
        super().__init__()
        self.vit_balance_config = vit_balance_config
        self.lr = lr
        self.model = tiny_qwen2_5_vl()
        self.balance_vision_tower(self.model)  # <-- vit balance

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def make_trainer(
    steps: int, log_dir: str, callbacks: list[Callback], find_unused_parameters: bool = False
) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(start_method="spawn", find_unused_parameters=find_unused_parameters),
        max_steps=steps,
        callbacks=[ViTBalanceCallback(), *callbacks],  # <-- vit balance
        logger=CSVLogger(log_dir, name="", version=""),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


# ------------------------------------------------------------------------------------ measuring

WARMUP_STEPS = 2  # first steps pay one-off allocation costs; left out of the means
# Losses of the two runs must agree within this: balancing changes only where an image is encoded,
# so matrix products over other row groups and DDP's sums add float32 numbers in another order
# (~1e-7 relative each); over a few AdamW steps that stays orders of magnitude below 1e-3, while a
# misplaced image token moves the loss by far more.
LOSS_TOLERANCE = 1e-3


class StepRecorder(Callback):
    """Per step and rank: wall time and training-thread CPU time of the step, loss, balancer stats.

    The CPU time is the training thread's own (``time.thread_time``): gloo's communication threads
    poll while a rank waits, so the process's CPU time would count waiting as work.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.records: dict[str, list[float]] = {}
        self._started = (0.0, 0.0)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)  # one core per rank, so ranks do not steal each other's time

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        dist.barrier()  # every rank starts the step together: the slowest one sets the pace
        self._started = (time.perf_counter(), time.thread_time())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        wall, cpu = time.perf_counter() - self._started[0], time.thread_time() - self._started[1]
        stats = pl_module.last_vit_balance_stats
        values = {
            "wall": wall,
            "cpu": cpu,
            "loss": float(outputs["loss"]),
        }
        if stats is not None:
            values.update(
                applied=float(stats.applied),
                imbalance_before=stats.imbalance_before,
                imbalance_after=stats.imbalance_after,
                moved_patches=float(stats.moved_patches),
                bytes_sent=float(stats.bytes_sent),
                collectives=float(stats.collectives),
            )
        for key, value in values.items():
            self.records.setdefault(key, []).append(value)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = Path(self.out_dir) / f"rank_{trainer.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.records))


def run(label: str, balanced: bool, args: argparse.Namespace) -> list[dict[str, list[float]]]:
    """One 2-rank fit; each rank's records."""
    out = Path(args.output) / label
    L.seed_everything(args.seed, verbose=False)
    # Balanced: the drop-in's default configuration (the tower's cost model, videos by temporal step).
    module = QwenVLFinetune(None if balanced else ViTBalanceConfig(enabled=False))
    loader = torch.utils.data.DataLoader(
        MixedVisionDataset(args.steps * 2 * args.batch_size, seed=args.seed),
        batch_size=args.batch_size,
        collate_fn=collate,
    )
    # Plain HF + DDP needs find_unused_parameters=True as soon as a rank has no images.
    trainer = make_trainer(
        args.steps, str(out), [StepRecorder(str(out))], find_unused_parameters=not balanced
    )
    trainer.fit(module, loader)
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(2)]


def _mean(values: Sequence[float]) -> float:
    tail = values[WARMUP_STEPS:] if len(values) > WARMUP_STEPS else values
    return statistics.fmean(tail) if tail else math.nan


def summarize(
    plain: list[dict[str, list[float]]], balanced: list[dict[str, list[float]]]
) -> dict[str, float]:
    def slowest(records: list[dict[str, list[float]]], key: str) -> list[float]:
        return [max(values) for values in zip(*(r[key] for r in records))]

    first = balanced[0]
    loss_diff = max(abs(a - b) for p, q in zip(plain, balanced) for a, b in zip(p["loss"], q["loss"]))
    summary = {
        "step_ms_plain": 1000 * _mean(slowest(plain, "wall")),
        "step_ms_balanced": 1000 * _mean(slowest(balanced, "wall")),
        "cpu_ms_plain": 1000 * _mean(slowest(plain, "cpu")),
        "cpu_ms_balanced": 1000 * _mean(slowest(balanced, "cpu")),
        "imbalance_before": statistics.fmean(first["imbalance_before"]),
        "imbalance_after": statistics.fmean(first["imbalance_after"]),
        "applied_steps": sum(first["applied"]),
        "steps": float(len(first["applied"])),
        "moved_patches_per_step": statistics.fmean(first["moved_patches"]),
        "collectives_per_forward": statistics.fmean(first["collectives"]),
        "moved_mib": sum(sum(r["bytes_sent"]) for r in balanced) / 2**20,
        "loss_max_abs_diff": loss_diff,
        "final_loss_plain": statistics.fmean(r["loss"][-1] for r in plain),
        "final_loss_balanced": statistics.fmean(r["loss"][-1] for r in balanced),
    }
    summary["step_speedup"] = summary["step_ms_plain"] / summary["step_ms_balanced"]
    summary["cpu_speedup"] = summary["cpu_ms_plain"] / summary["cpu_ms_balanced"]
    return summary


def _print(s: dict[str, float], args: argparse.Namespace) -> None:
    def row(name: str, left: str, right: str, note: str = "") -> None:
        print(f"  {name:<42}{left:>16}{right:>16}  {note}")

    print(
        f"\nSummary (2 CPU ranks, {args.steps} steps of {args.batch_size} samples per rank; means over "
        + (f"steps {WARMUP_STEPS + 1}..):" if args.steps > WARMUP_STEPS else "every step, warm-up included):")
    )
    row("", "plain HF", "balanced")
    row("DDP find_unused_parameters", "True (needed)", "False")
    row(
        "training step, slowest rank (wall)",
        f"{s['step_ms_plain']:.0f} ms",
        f"{s['step_ms_balanced']:.0f} ms",
        f"speed-up {s['step_speedup']:.2f}x",
    )
    row(
        "training step, busiest rank (thread CPU)",
        f"{s['cpu_ms_plain']:.0f} ms",
        f"{s['cpu_ms_balanced']:.0f} ms",
        f"speed-up {s['cpu_speedup']:.2f}x",
    )
    row(
        "ViT load imbalance (max/mean - 1)",
        f"{s['imbalance_before']:.2f}",
        f"{s['imbalance_after']:.2f}",
        "mean over steps",
    )
    row("steps where images moved", "0", f"{s['applied_steps']:.0f}/{s['steps']:.0f}")
    row("patches moved / step", "0", f"{s['moved_patches_per_step']:.0f}")
    row("balanced exchanges / forward", "-", "1", f"{s['collectives_per_forward']:.1f} collectives (forward)")
    row("bytes moved (both ranks, all steps)", "0", f"{s['moved_mib']:.1f} MiB")
    row("final loss (mean over ranks)", f"{s['final_loss_plain']:.4f}", f"{s['final_loss_balanced']:.4f}")
    verdict = "MATCH" if s["loss_max_abs_diff"] <= LOSS_TOLERANCE else "MISMATCH"
    print(
        f"  losses: max |difference| over all steps and ranks = {s['loss_max_abs_diff']:.1e} "
        f"(tolerance {LOSS_TOLERANCE:g}): {verdict}"
    )
    print(
        "  Thread CPU time counts each rank's own work, not its waiting, so it holds when other programs\n"
        "  share the cores; the wall-clock row also moves with the machine's load."
    )


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=positive_int, default=10, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=positive_int, default=2, help="samples per rank per step")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument(
        "--output", type=output_dir, default="demo_output/hf_qwen_finetune", help="logs and records"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    started = time.perf_counter()
    print("Fine-tuning a tiny Qwen2.5-VL on 2 CPU ranks: documents, videos, photos and text-only samples.")
    runs = {}
    for label, balanced in (("plain", False), ("balanced", True)):
        print(f"- training {'with' if balanced else 'without'} ViT balancing ...", flush=True)
        runs[label] = run(label, balanced, args)
    summary = summarize(runs["plain"], runs["balanced"])
    _print(summary, args)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return summary


if __name__ == "__main__":
    main()
