"""``make demo``: train a small VLM on several ranks twice, without and with ViT balancing.

Each run is a real multi-process Lightning fit (``ddp_spawn``; gloo on CPU, NCCL on GPUs) of
:mod:`tiny_vlm`'s Qwen2-VL style tower plus a tiny text decoder, on a synthetic dataset where a
few samples (multi-page documents, videos) hold most of the pixels. Both runs use the same seed
and the same data; only ``vit_balance_config.enabled`` differs. At the end the script prints a
side-by-side summary (slowest rank's ViT time per step, imbalance, speed-up, patches and bytes
moved, losses) and writes a dashboard PNG into ``demo_output/``.

    python examples/demo.py               # the full demo (what `make demo` runs)
    python examples/demo.py --steps 2     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger

from lightning_vit_balance import CostModel, ViTBalanceCallback, ViTBalanceConfig, ViTBalanceMixin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_vit_balance import load_metrics, plot_dashboard
from tiny_vlm import (
    SyntheticVLMDataset,
    TinyTextDecoder,
    TinyVisionTower,
    collate_vlm,
    output_dir,
    positive_float,
    positive_int,
    seed_int,
)

__all__ = ["DemoVLM", "main", "parse_args", "run_training", "summarize"]

# Losses of the two runs must agree within this. Balancing changes only where each image is
# encoded: the per-image math is the same, but matrix products over different row groups and the
# gradient sums of DDP add float32 numbers in another order (relative rounding ~1e-7 per
# operation). Over a few dozen Adam steps those perturbations stay many orders of magnitude below
# the loss (~5.5); 1e-3 absolute still catches any real mistake (a misplaced image token moves
# the loss by far more).
LOSS_TOLERANCE = 1e-3
WARMUP_STEPS = 2  # first steps pay one-off allocation costs; left out of the timing means


class DemoVLM(ViTBalanceMixin, L.LightningModule):
    """The demo's vision-language model: ``TinyVisionTower`` -> ``TinyTextDecoder``.

    Args:
        vit_balance_config: Read by :class:`ViTBalanceMixin` (balancing on or off).
        record_dir: Where each rank writes its per-step timings and losses (``rank_{r}.json``).
        label: Name of the run, printed in the progress lines.
        total_steps: Steps of the run, for the progress lines.
        tower_kwargs: Arguments of :class:`TinyVisionTower`.
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        vit_balance_config: ViTBalanceConfig,
        record_dir: str,
        *,
        label: str = "run",
        total_steps: int = 0,
        tower_kwargs: dict[str, Any] | None = None,
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        self.vit_balance_config = vit_balance_config
        self.visual = TinyVisionTower(**(tower_kwargs or {}))
        self.decoder = TinyTextDecoder(dim=self.visual.merger.mlp[-1].out_features)
        self.record_dir = record_dir
        self.label = label
        self.total_steps = total_steps
        self.lr = lr
        keys = ("vit_seconds", "vit_cpu_seconds", "step_seconds", "loss", "bytes_sent", "moved_patches")
        keys += ("applied", "imbalance_before", "imbalance_after", "balance_overhead_seconds")
        self.records: dict[str, list[float]] = {key: [] for key in keys}
        self._step_started = 0.0

    def setup(self, stage: str) -> None:
        # One core per rank: ranks must not steal each other's cores, or the imbalance we want to
        # show would be hidden by the OS scheduler.
        torch.set_num_threads(1)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_started = time.perf_counter()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        grid_thw = batch["image_grid_thw"]  # [n_images, 3]
        if dist.is_available() and dist.is_initialized():
            # Start the ViT clock on every rank at the same moment, so that the slowest rank's
            # interval is the time the whole group spends in the ViT.
            dist.barrier()
        on_gpu = batch["pixel_values"].is_cuda
        if on_gpu:
            torch.cuda.synchronize()  # kernels run asynchronously: time them, not their launch
        started, cpu_started = time.perf_counter(), time.process_time()
        pixel_embeds, _window_index, deepstack = self.encode_images(
            self.visual, batch["pixel_values"], grid_thw
        )
        if on_gpu:
            torch.cuda.synchronize()
        self.records["vit_seconds"].append(time.perf_counter() - started)
        # CPU time of this rank's process (compute plus the exchange's own work, not time spent
        # waiting): unlike the wall clock it does not grow when other programs share the cores.
        # With one core per rank it is the time a dedicated device would spend.
        self.records["vit_cpu_seconds"].append(time.process_time() - cpu_started)
        stats = self.last_vit_balance_stats if self.vit_balance_config.enabled else None
        if stats is not None:
            self.records["bytes_sent"].append(float(stats.bytes_sent))
            self.records["moved_patches"].append(float(stats.moved_patches))
            self.records["applied"].append(float(stats.applied))
            self.records["imbalance_before"].append(stats.imbalance_before)
            self.records["imbalance_after"].append(stats.imbalance_after)
            # Own work only: the status gather also waits there for the slowest rank's ViT, which is
            # the imbalance whole images leave, not a cost of balancing.
            own = stats.plan_seconds + stats.exchange_seconds - stats.status_seconds
            self.records["balance_overhead_seconds"].append(own)
        merged_per_image = (grid_thw.prod(-1) // 4).tolist()
        images_per_sample = batch["images_per_sample"].tolist()
        tokens_per_sample, first = [], 0
        for count in images_per_sample:
            tokens_per_sample.append(sum(merged_per_image[first : first + count]))
            first += count
        loss = self.decoder(pixel_embeds, tokens_per_sample, batch["input_ids"], deepstack)
        self.records["loss"].append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.records["step_seconds"].append(time.perf_counter() - self._step_started)
        step = len(self.records["loss"])
        every = max(1, self.total_steps // 6)
        if self.global_rank == 0 and (step % every == 0 or step == self.total_steps):
            balance = ""
            if self.records["applied"]:
                balance = (
                    f"  imbalance {self.records['imbalance_before'][-1]:.2f} -> "
                    f"{self.records['imbalance_after'][-1]:.2f}"
                )
            print(
                f"  [{self.label}] step {step:3d}/{self.total_steps}  loss {self.records['loss'][-1]:.4f}  "
                f"rank-0 ViT {1000 * self.records['vit_seconds'][-1]:7.1f} ms{balance}",
                flush=True,
            )

    def on_train_end(self) -> None:
        path = Path(self.record_dir) / f"rank_{self.global_rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.records))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=positive_int, default=30, help="optimizer steps per run")
    parser.add_argument("--devices", type=int, default=2, help="data-parallel ranks (>= 2)")
    parser.add_argument("--batch-size", type=positive_int, default=2, help="samples per rank per step")
    parser.add_argument("--scale", type=positive_float, default=1.3, help="multiplies every image side")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument(
        "--output", type=output_dir, default="demo_output", help="directory for logs and the PNG"
    )
    parser.add_argument(
        "--accelerator", default="auto", choices=("auto", "cpu", "gpu"), help="auto: GPUs if enough"
    )
    args = parser.parse_args(argv)
    if args.devices < 2:
        parser.error(f"--devices={args.devices}: the demo needs at least 2 data-parallel ranks")
    return args


def _accelerator(args: argparse.Namespace) -> str:
    if args.accelerator != "auto":
        return args.accelerator
    return "gpu" if torch.cuda.is_available() and torch.cuda.device_count() >= args.devices else "cpu"


TOWER_KWARGS: dict[str, Any] = {
    "patch_dim": 3 * 2 * 14 * 14,
    "embed_dim": 96,
    "depth": 4,
    "num_heads": 4,
    "mlp_ratio": 2.0,
    "out_dim": 64,
    "window_layers": (1,),
    "window_size": 4,
    "deepstack_layers": (0, 2),
}


def balanced_config() -> ViTBalanceConfig:
    """Balancing on, with a cost model derived from the demo tower's shape."""
    cost = CostModel.from_vit_shape(
        hidden_size=TOWER_KWARGS["embed_dim"],
        depth=TOWER_KWARGS["depth"],
        mlp_ratio=TOWER_KWARGS["mlp_ratio"],
        patch_input_dim=TOWER_KWARGS["patch_dim"],
        window_layers=TOWER_KWARGS["window_layers"],
        window_patches=(2 * TOWER_KWARGS["window_size"]) ** 2,
    )
    return cost.to_config(ViTBalanceConfig(enabled=True))


def run_training(label: str, config: ViTBalanceConfig, args: argparse.Namespace) -> dict[str, Any]:
    """One multi-rank fit; returns the per-rank records and the metrics the callback logged."""
    out = Path(args.output)
    record_dir = out / label / "records"
    shutil.rmtree(out / label, ignore_errors=True)  # never read a previous run's records or logs
    L.seed_everything(args.seed, verbose=False)
    model = DemoVLM(config, str(record_dir), label=label, total_steps=args.steps, tower_kwargs=TOWER_KWARGS)
    samples = args.steps * args.batch_size * args.devices
    dataset = SyntheticVLMDataset(
        samples, patch_dim=TOWER_KWARGS["patch_dim"], scale=args.scale, seed=args.seed
    )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=False, collate_fn=collate_vlm
    )
    trainer = L.Trainer(
        accelerator=_accelerator(args),
        devices=args.devices,
        strategy="ddp_spawn",
        max_steps=args.steps,
        logger=CSVLogger(str(out), name=label, version=""),
        callbacks=[ViTBalanceCallback()],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    started = time.perf_counter()
    trainer.fit(model, loader)
    wall = time.perf_counter() - started
    records = [json.loads((record_dir / f"rank_{r}.json").read_text()) for r in range(args.devices)]
    metrics_path = out / label / "metrics.csv"
    metrics = load_metrics(metrics_path) if metrics_path.exists() else {}
    return {"records": records, "metrics": metrics, "wall_seconds": wall}


def _slowest(records: Sequence[dict[str, list[float]]], key: str) -> list[float]:
    """Per step, the largest value over ranks."""
    return [max(values) for values in zip(*(r[key] for r in records))]


def _warmup_left_out(steps: int) -> bool:
    """Whether the summary and the timings panel leave the warm-up steps out: not in a run of no
    more steps than that (a smoke run), which would leave nothing."""
    return steps > WARMUP_STEPS


def _mean_after_warmup(values: Sequence[float]) -> float:
    tail = values[WARMUP_STEPS:] if _warmup_left_out(len(values)) else values
    return statistics.fmean(tail) if tail else math.nan


def summarize(baseline: dict[str, Any], balanced: dict[str, Any]) -> dict[str, float]:
    """The numbers of the side-by-side summary."""
    vit_base = _slowest(baseline["records"], "vit_seconds")
    vit_bal = _slowest(balanced["records"], "vit_seconds")
    cpu_base = _slowest(baseline["records"], "vit_cpu_seconds")
    cpu_bal = _slowest(balanced["records"], "vit_cpu_seconds")
    step_base = _slowest(baseline["records"], "step_seconds")
    step_bal = _slowest(balanced["records"], "step_seconds")
    loss_diffs = [
        abs(a - b)
        for rb, rr in zip(baseline["records"], balanced["records"])
        for a, b in zip(rb["loss"], rr["loss"])
    ]
    final_base = statistics.fmean(r["loss"][-1] for r in baseline["records"])
    final_bal = statistics.fmean(r["loss"][-1] for r in balanced["records"])
    # Plans are global (every rank computes the same one): rank 0's stats speak for all ranks;
    # bytes are per rank, so they are summed.
    first = balanced["records"][0]
    moved = first["moved_patches"]
    applied = first["applied"]
    moved_bytes = sum(sum(r["bytes_sent"]) for r in balanced["records"])
    return {
        "vit_ms_baseline": 1000 * _mean_after_warmup(vit_base),
        "vit_ms_balanced": 1000 * _mean_after_warmup(vit_bal),
        "vit_cpu_ms_baseline": 1000 * _mean_after_warmup(cpu_base),
        "vit_cpu_ms_balanced": 1000 * _mean_after_warmup(cpu_bal),
        "vit_cpu_speedup": _mean_after_warmup(cpu_base) / _mean_after_warmup(cpu_bal),
        "step_ms_baseline": 1000 * _mean_after_warmup(step_base),
        "step_ms_balanced": 1000 * _mean_after_warmup(step_bal),
        "vit_speedup": _mean_after_warmup(vit_base) / _mean_after_warmup(vit_bal),
        "step_speedup": _mean_after_warmup(step_base) / _mean_after_warmup(step_bal),
        "imbalance_before": statistics.fmean(first["imbalance_before"]) if applied else math.nan,
        "imbalance_after": statistics.fmean(first["imbalance_after"]) if applied else math.nan,
        "applied_steps": float(sum(v > 0.5 for v in applied)),
        "logged_steps": float(len(applied)),
        "moved_patches_per_step": statistics.fmean(moved) if moved else math.nan,
        "moved_bytes_total": float(moved_bytes),
        "overhead_ms_per_step": 1000
        * max(_mean_after_warmup(r["balance_overhead_seconds"]) for r in balanced["records"]),
        "loss_max_abs_diff": max(loss_diffs, default=math.nan),
        "final_loss_baseline": final_base,
        "final_loss_balanced": final_bal,
        "wall_baseline": baseline["wall_seconds"],
        "wall_balanced": balanced["wall_seconds"],
    }


def _print_summary(s: dict[str, float], args: argparse.Namespace, png: Path) -> None:
    def row(name: str, left: str, right: str, note: str = "") -> None:
        print(f"  {name:<40}{left:>18}{right:>18}  {note}")

    print()
    averaged = (
        f"steps {WARMUP_STEPS + 1}.." if _warmup_left_out(args.steps) else "every step, warm-up included"
    )
    print(f"Summary ({args.devices} ranks, {args.steps} steps, means over {averaged}):")
    row("", "without balancing", "with balancing")
    if args.accelerator_used == "cpu":  # on GPUs host CPU time says nothing about the kernels
        row(
            "slowest rank's ViT time / step (CPU)",
            f"{s['vit_cpu_ms_baseline']:.1f} ms",
            f"{s['vit_cpu_ms_balanced']:.1f} ms",
            f"speed-up {s['vit_cpu_speedup']:.2f}x",
        )
    row(
        "slowest rank's ViT time / step (wall)",
        f"{s['vit_ms_baseline']:.1f} ms",
        f"{s['vit_ms_balanced']:.1f} ms",
        f"speed-up {s['vit_speedup']:.2f}x",
    )
    row(
        "training step time (slowest rank)",
        f"{s['step_ms_baseline']:.1f} ms",
        f"{s['step_ms_balanced']:.1f} ms",
        f"speed-up {s['step_speedup']:.2f}x",
    )
    row(
        "ViT load imbalance (max/mean - 1)",
        f"{s['imbalance_before']:.3f}",
        f"{s['imbalance_after']:.3f}",
        "mean over steps",
    )
    row("steps where images moved", "0", f"{s['applied_steps']:.0f}/{s['logged_steps']:.0f}")
    row("patches moved / step", "0", f"{s['moved_patches_per_step']:.0f}")
    row(
        "planning + exchange time / step",
        "0",
        f"{s['overhead_ms_per_step']:.1f} ms",
        "largest rank mean, waits for the slowest ViT left out",
    )
    row("bytes moved (all ranks and steps)", "0", f"{s['moved_bytes_total'] / 2**20:.1f} MiB", "both trips")
    row("final loss (mean over ranks)", f"{s['final_loss_baseline']:.5f}", f"{s['final_loss_balanced']:.5f}")
    match = "MATCH" if s["loss_max_abs_diff"] <= LOSS_TOLERANCE else "MISMATCH"
    print(
        f"  losses: max |difference| over all steps and ranks = {s['loss_max_abs_diff']:.2e} "
        f"(tolerance {LOSS_TOLERANCE:g}): {match}"
    )
    print(f"  wall time: {s['wall_baseline']:.1f} s without, {s['wall_balanced']:.1f} s with balancing")
    if args.accelerator_used == "cpu":
        print(
            "  CPU time counts each rank's own work (compute and exchange, not waiting), so it holds when\n"
            "  other programs share the cores; wall-clock rows also move with the machine's load while the\n"
            "  two runs go one after the other."
        )
    print(f"  dashboard: {png}")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run both trainings, print the summary, write the dashboard; returns the summary numbers."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric"):  # keep the progress lines readable
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    args.accelerator_used = _accelerator(args)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(
        f"ViT balance demo: {args.devices} ranks on {_accelerator(args)}, {args.steps} steps per run, "
        f"{args.batch_size} samples per rank per step. Output: {out}/",
        flush=True,
    )
    runs = {}
    for label, config in (
        ("without_balancing", ViTBalanceConfig(enabled=False)),
        ("with_balancing", balanced_config()),
    ):
        print(f"- training {label.replace('_', ' ')} ...", flush=True)
        runs[label] = run_training(label, config, args)
    summary = summarize(runs["without_balancing"], runs["with_balancing"])
    timing_key, clock = (
        ("vit_cpu_seconds", "CPU") if args.accelerator_used == "cpu" else ("vit_seconds", "wall")
    )
    first = WARMUP_STEPS if _warmup_left_out(args.steps) else 0
    png = plot_dashboard(
        runs["with_balancing"]["metrics"],
        out / "vit_balance_dashboard.png",
        title=f"ViT balance demo: {args.devices} ranks, tiny Qwen2-VL style tower",
        timings={
            label.replace("_", " "): list(enumerate(_slowest(run["records"], timing_key)))[first:]
            for label, run in runs.items()
        },
        timings_title=f"Slowest rank's ViT {clock} time per step (forward incl. exchange"
        + ("; warm-up left out)" if first else ")"),
    )
    _print_summary(summary, args, png)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return summary


if __name__ == "__main__":
    main()
