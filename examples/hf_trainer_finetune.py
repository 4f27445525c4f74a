"""Fine-tune a Hugging Face Qwen2.5-VL with Hugging Face's ``Trainer``, ViT work balanced across ranks.

The ``Trainer`` recipe of a Qwen-VL user (a model, a dataset, a collator, ``TrainingArguments``,
``trainer.train()``), with three lines changed, marked ``# <-- vit balance``:
``balance_vision_tower(model)`` before the ``Trainer`` is built; the collator given as
``handle.plan_ahead(collate)``, which keeps each batch's grids on the host for the forward to plan
from (the ``Trainer`` hands the model batches already on the device, whose grids it would otherwise
read back: a device-to-host sync in every forward on GPUs); and
``ViTBalanceTrainerCallback().attach(trainer)``, which puts the ``vit_balance/*`` metrics in every
training log (ahead of ``report_to``'s integrations: W&B, TensorBoard...) and the balancer's state
in every checkpoint. At the end rank 0 prints what the logs say (the imbalance before and after,
the slowest and the mean rank's measured ViT time, what moved) and draws the dashboard from the
run's ``trainer_state.json``::

    torchrun --nproc_per_node 2 examples/hf_trainer_finetune.py            # 2 CPU ranks (or GPUs)
    torchrun --nproc_per_node 2 examples/hf_trainer_finetune.py --steps 4  # a smoke run

The tiny random model, the dataset of documents, videos, photos and text-only samples and the
collator are those of ``examples/hf_qwen_finetune.py`` (the Lightning version of this recipe);
with a real checkpoint, ``from_pretrained`` and the processor replace them. Run without
``torchrun`` it trains on one rank, where there is nothing to balance. Needs the ``hf`` extra
(``pip install lightning-vit-balance[hf]``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_qwen_finetune import MixedVisionDataset, collate, tiny_qwen2_5_vl
from plot_vit_balance import main as draw_dashboard
from tiny_vlm import output_dir, positive_int

from lightning_vit_balance import ViTBalanceTrainerCallback, balance_vision_tower

__all__ = ["main", "summarize"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Run it with torchrun --nproc_per_node 2 (or more): alone it has nothing to balance.",
    )
    parser.add_argument("--steps", type=positive_int, default=20, help="optimizer steps (default 20)")
    parser.add_argument(
        "--batch-size", type=positive_int, default=2, help="samples per rank and step (default 2)"
    )
    parser.add_argument(
        "--output", type=output_dir, default="demo_output/hf_trainer", help="the Trainer's output directory"
    )
    return parser.parse_args(argv)


def summarize(log_history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """What the training logs' ``vit_balance/*`` metrics say over the run (means over the logs)."""
    logs = [entry for entry in log_history if "vit_balance/calls" in entry]
    if not logs:
        return {}

    def mean(key: str) -> float:
        values = [entry[key] for entry in logs if key in entry]
        return statistics.fmean(values) if values else float("nan")

    def per_call(*keys: str) -> float:
        """Milliseconds per balanced call: the logs hold each window's sums."""
        calls = sum(entry["vit_balance/calls"] for entry in logs)
        return sum(entry.get(key, 0.0) for entry in logs for key in keys) / calls

    return {
        "imbalance_before": mean("vit_balance/imbalance_before"),
        "imbalance_after": mean("vit_balance/imbalance_after"),
        "vit_ms_max": mean("vit_balance/vit_ms_max"),
        "vit_ms_mean": mean("vit_balance/vit_ms_mean"),
        "moved_patches": sum(entry["vit_balance/moved_patches"] for entry in logs),
        # In the balanced calls: 3 per call that moved images (the two trips and the status
        # gather), none for a skipped one; a call that gathered its own metadata adds one.
        "collectives": sum(entry["vit_balance/collectives"] for entry in logs),
        # Host time: the plan made at the start of each forward from the collator's grids (its
        # gather and planning), then the balanced call's collectives (its trips, and the status
        # gather, which waits for the slowest rank's ViT).
        "prepare_ms_per_call": per_call("vit_balance/prepare_ms"),
        "call_ms_per_call": per_call("vit_balance/plan_ms", "vit_balance/exchange_ms"),
        # The trips alone (forward and backward, packing included) per call that moved images
        # (device time on GPUs; logged a call late, so the last call's are not in the logs).
        "trip_ms_per_applied_call": sum(entry["vit_balance/trip_ms"] for entry in logs)
        / max(1.0, logs[-1]["vit_balance/applied_total"]),
        "applied_total": logs[-1]["vit_balance/applied_total"],
        "calls_total": logs[-1]["vit_balance/calls_total"],
    }


def _print(summary: dict[str, float], dashboard: Path) -> None:
    applied, calls = summary["applied_total"], summary["calls_total"]
    before, after = summary["imbalance_before"], summary["imbalance_after"]
    print(f"\nBalanced ViT calls: {applied:.0f} of {calls:.0f} moved images")
    print(f"  load imbalance (max/mean - 1): {before:.3f} -> {after:.3f}")
    print(
        f"  measured ViT time per call: slowest rank {summary['vit_ms_max']:.1f} ms, "
        f"mean over ranks {summary['vit_ms_mean']:.1f} ms"
    )
    print(f"  patches encoded away from their rank: {summary['moved_patches']:.0f}")
    print(
        f"  host time per call: {summary['prepare_ms_per_call']:.2f} ms planning from the collator's "
        f"grids, {summary['call_ms_per_call']:.2f} ms in the balanced call's collectives (the trips, and "
        "the status gather, which waits for the slowest rank's ViT)"
    )
    print(
        f"  in the trips themselves: {summary['trip_ms_per_applied_call']:.2f} ms per call that moved "
        "images (forward and backward, packing included; on GPUs the device's time)"
    )
    print(f"  dashboard: {dashboard}")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    model = tiny_qwen2_5_vl()
    handle = balance_vision_tower(model)  # <-- vit balance
    training_args = TrainingArguments(
        output_dir=args.output,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,  # the collator reads the samples' own keys (images, videos, text)
        report_to=[],
        use_cpu=not on_gpu,
        # gloo for CPU ranks under torchrun; alone (no LOCAL_RANK) there is no process group to make.
        ddp_backend="gloo" if not on_gpu and "LOCAL_RANK" in os.environ else None,
        # Every rank calls the tower, a text-only one too, so no parameter goes unused.
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        seed=0,
    )
    dataset = MixedVisionDataset(args.steps * args.batch_size * 8)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=handle.plan_ahead(collate),  # <-- vit balance
    )
    ViTBalanceTrainerCallback().attach(trainer)  # <-- vit balance
    trainer.train()
    summary = summarize(trainer.state.log_history)
    if trainer.is_world_process_zero() and trainer.args.world_size > 1:
        trainer.save_state()  # trainer_state.json: the log history the dashboard reads
        dashboard = draw_dashboard([args.output, "-o", str(Path(args.output) / "vit_balance_dashboard.png")])
        _print(summary, dashboard)
    elif trainer.is_world_process_zero():
        print("One rank: nothing was balanced. Run it with torchrun --nproc_per_node 2 (or more).")
    return summary


if __name__ == "__main__":
    main()
