"""Costs of the engine's own machinery, each next to its floor, measured side by side in one run.

``make bench-engine`` spawns 2 gloo ranks on CPU (file-store rendezvous) and prints five tables
(``--tables`` picks some):

* **status**: the status gather after the ViT (the check that turns a ViT failure on one rank into
  one error on every rank) per call, next to a whole applied balanced call on the demo's tower and
  batches, and next to a raw ``all_gather`` of the same int64 values (``exchange.STATUS_WORD``);
* **skipped**: a call the plan skips, prepared before the forward, without and with
  ``check_skipped_calls`` (the status gather after the ViT), the two settings alternating call by
  call; the slowest rank's wall time per call, which is what the step waits for;
* **scale**: thousands of tiny images on a rank: one applied balanced call (rank 0 holds ``n``
  images, rank 1 a quarter of that) against the direct call on the same images, with the host
  bookkeeping split out (gather + plan + the trips' host work);
* **frames**: videos planned by temporal step (``split_videos``: hundreds to thousands of items on
  a rank) with a four-output tower that has no per-image loop: balanced against direct, forward
  and backward, process CPU time (gloo's threads included) summed over both ranks (the tower's
  work only moves between ranks, so the difference is the balancer's own work);
* **overlap**: ``overlap_pixel_trip`` off and on, forward and backward of the demo's tower on the
  demo's batches, wall time of the slowest rank per step (median), alternating the two settings
  step by step so that machine noise hits both alike.

Every figure is a median over repeats. The numbers depend on the machine; the ratios are the point.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tiny_vlm import SyntheticVLMDataset, TinyVisionTower, collate_vlm

from lightning_vit_balance import CostModel, ViTBalanceConfig, ViTBalancer
from lightning_vit_balance.exchange import STATUS_WORD, ViTStatus, exchange_status

RANKS = 2
#: The tables `main` measures, in order.
TABLES = ("status", "skipped", "scale", "frames", "overlap")


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _slowest(value: float) -> float:
    box = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box)


def _demo_tower(scale: float) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]], ViTBalanceConfig]:
    torch.manual_seed(0)
    tower = TinyVisionTower(window_layers=(1,), deepstack_layers=(0, 2))
    data = SyntheticVLMDataset(64, scale=scale, seed=1)
    rank = dist.get_rank()
    batches = [collate_vlm([data[4 * step + 2 * rank], data[4 * step + 2 * rank + 1]]) for step in range(8)]
    cost = CostModel.from_vit(tower, window_layers=(1,), window_patches=(2 * tower.window_size) ** 2)
    config = cost.to_config(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
    return tower, batches, config


def _status_table(repeats: int) -> list[str]:
    tower, batches, config = _demo_tower(0.8)
    balancer = ViTBalancer(config)
    ok = ViTStatus()
    status_ms = _median_ms(lambda: exchange_status(ok, None), repeats)
    word = torch.zeros(len(STATUS_WORD), dtype=torch.int64)
    raw_ms = _median_ms(
        lambda: dist.all_gather([torch.empty_like(word) for _ in range(RANKS)], word), repeats
    )
    applied_batches = []
    for batch in batches:
        balancer(tower, batch["pixel_values"], batch["image_grid_thw"])
        if balancer.last_stats is not None and balancer.last_stats.applied:
            applied_batches.append(batch)
    batch = applied_batches[0]  # the same on every rank: the plans are
    call_ms = _median_ms(lambda: balancer(tower, batch["pixel_values"], batch["image_grid_thw"]), 5)
    applied = balancer.last_stats is not None and balancer.last_stats.applied
    return [
        "| piece | ms per call (median) |",
        "|---|---|",
        f"| status gather after the ViT | {status_ms:.3f} |",
        f"| raw all_gather of the same {len(STATUS_WORD)} int64 | {raw_ms:.3f} |",
        f"| whole applied balanced call, demo tower (applied={applied}) | {call_ms:.1f} |",
        f"| status share of the call | {100 * status_ms / call_ms:.2f}% |",
    ]


def _skipped_table(repeats: int) -> list[str]:
    tower, batches, config = _demo_tower(0.8)
    pixels, grid = batches[0]["pixel_values"], batches[0]["image_grid_thw"]
    skipping = dataclasses.replace(config, trigger_threshold=100.0)
    balancers = {
        checked: ViTBalancer(dataclasses.replace(skipping, check_skipped_calls=checked))
        for checked in (False, True)
    }
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for checked, balancer in balancers.items():
            ticket = balancer.prepare(pixels, grid, tower)
            dist.barrier()
            started = time.perf_counter()
            balancer(tower, pixels, grid, prepared=ticket)
            times[checked].append(_slowest((time.perf_counter() - started) * 1e3))
            assert balancer.last_stats is not None and not balancer.last_stats.applied
    off, on = (statistics.median(times[checked]) for checked in (False, True))
    return [
        "| skipped call, prepared, demo tower | slowest rank's ms per call (median) |",
        "|---|---|",
        f"| unchecked (no collective) | {off:.2f} |",
        f"| check_skipped_calls (the status gather) | {on:.2f} |",
        f"| difference | {on - off:.3f} ({100 * (on - off) / off:.2f}%) |",
    ]


class _PerImageTower(torch.nn.Module):
    """A tiny tower that, like Hugging Face's, walks the images of its batch one by one."""

    spatial_merge_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(12, 16)
        self.merge = torch.nn.Linear(64, 16)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        counts = grid_thw.prod(-1).tolist()
        hidden = [torch.softmax(x @ x.T, -1) @ x for x in torch.split(self.embed(pixel_values), counts)]
        return self.merge(torch.cat(hidden).reshape(-1, 64))


def _scale_table(counts: list[int]) -> list[str]:
    rank = dist.get_rank()
    rows = [
        "| images on rank 0 | direct ms | balanced ms | balanced / direct | host bookkeeping ms |",
        "|---|---|---|---|---|",
    ]
    for n in counts:
        torch.manual_seed(0)
        tower = _PerImageTower()
        images = n if rank == 0 else n // 4
        grid = torch.tensor([[1, 2, 2]] * images)
        pixels = torch.randn(4 * images, 12)
        balancer = ViTBalancer(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0))
        balancer(tower, pixels, grid)  # warm-up
        direct = _median_ms(lambda: tower(pixels, grid), 3)  # noqa: B023
        balanced = _median_ms(lambda: balancer(tower, pixels, grid), 3)  # noqa: B023
        stats = balancer.last_stats
        assert stats is not None
        host = 1e3 * (
            stats.gather_seconds + stats.plan_seconds + stats.dispatch_seconds + stats.combine_seconds
        )
        if rank == 0:
            rows.append(f"| {n:,} | {direct:.1f} | {balanced:.1f} | {balanced / direct:.2f} | {host:.1f} |")
    return rows


class _FrameTower(torch.nn.Module):
    """A tower without a per-image loop (the work is one matmul per layer, as with varlen
    attention kernels) and four token outputs, Qwen3-VL's merged tokens and three deepstack
    layers: what is left of a call beyond it is the balancer's own work."""

    spatial_merge_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(12, 16)
        self.merge = torch.nn.Linear(64, 16)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        merged = self.merge(self.embed(pixel_values).reshape(-1, 64))
        return [merged, *(merged * (k + 2) for k in range(3))]


def _frame_times(steps: int, repeats: int) -> dict[str, float]:
    """Median process CPU ms (gloo's transfer threads included: the balancer's collectives are
    its work too) of the forward (``f``) and backward (``b``), direct and balanced, alternating
    which runs first; rank 0 holds ``steps`` video steps (a multiple of 100), rank 1 a quarter."""
    torch.manual_seed(0)
    tower = _FrameTower()
    # Videos of 100 temporal steps (25 on rank 1) of 8x8 patches each, planned step by step as the
    # Hugging Face drop-in does for Qwen-VL towers, and three photos of 16x16.
    length = 100 if dist.get_rank() == 0 else 25
    grid = torch.tensor([[length, 8, 8]] * (steps // 100) + [[1, 16, 16]] * 3)
    pixels = torch.randn(int(grid.prod(-1).sum()), 12)
    balancer = ViTBalancer(ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0, split_videos=True))
    calls = {"direct": tower, "balanced": lambda p, g: balancer(tower, p, g)}
    times: dict[str, list[float]] = collections.defaultdict(list)
    for step in range(repeats + 1):
        for name in ("direct", "balanced") if step % 2 else ("balanced", "direct"):
            dist.barrier()
            started = time.process_time()
            outputs = calls[name](pixels, grid)
            forward = time.process_time()
            sum(out.sum() for out in outputs).backward()
            if step:  # the first is a warm-up
                times[f"{name} f"].append((forward - started) * 1e3)
                times[f"{name} b"].append((time.process_time() - forward) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def _frames_table(counts: list[int], repeats: int) -> list[str]:
    # Summed over both ranks: the tower's work is linear in the rows, and balancing only moves
    # rows, so what the sum gains is the balancer's own work (per rank, the busy rank sheds ViT
    # work and the other takes it on).
    rows = [
        "| video steps on rank 0 | direct ms | balanced ms | balanced - direct | of which backward |",
        "|---|---|---|---|---|",
    ]
    for steps in counts:
        ms = _frame_times(steps, repeats)
        keys = ("direct f", "direct b", "balanced f", "balanced b")
        summed = torch.tensor([ms[key] for key in keys], dtype=torch.float64)
        dist.all_reduce(summed)
        direct_f, direct_b, balanced_f, balanced_b = summed.tolist()
        direct, balanced, backward = direct_f + direct_b, balanced_f + balanced_b, balanced_b - direct_b
        cells = (direct, balanced, balanced - direct, backward)
        rows.append(f"| {steps:,} | " + " | ".join(f"{value:.1f}" for value in cells) + " |")
    return rows


def _overlap_table(steps: int) -> list[str]:
    tower, batches, config = _demo_tower(1.0)
    settings = {"off": config, "on": ViTBalanceConfig(**{**config.__dict__, "overlap_pixel_trip": True})}
    balancers = {name: ViTBalancer(cfg) for name, cfg in settings.items()}
    times: dict[str, list[float]] = {name: [] for name in settings}
    for step in range(steps):
        batch = batches[step % len(batches)]
        # Alternate which setting runs first, so warm caches favour neither.
        for name in ("off", "on") if step % 2 else ("on", "off"):
            balancer = balancers[name]
            dist.barrier()
            started = time.perf_counter()
            embeds, _, deepstack = balancer(tower, batch["pixel_values"], batch["image_grid_thw"])
            (embeds.sum() + sum(d.sum() for d in deepstack)).backward()
            times[name].append(_slowest(time.perf_counter() - started) * 1e3)
            tower.zero_grad(set_to_none=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return [
        "| overlap_pixel_trip | slowest rank, forward + backward, ms (median) |",
        "|---|---|",
        f"| off | {off:.1f} |",
        f"| on | {on:.1f} |",
        f"| on / off | {on / off:.3f} |",
    ]


def _worker(rank: int, store: str, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    makers: dict[str, Callable[[], list[str]]] = {
        "status": lambda: _status_table(args.repeats),
        "skipped": lambda: _skipped_table(args.skipped_repeats),
        "scale": lambda: _scale_table(args.images),
        "frames": lambda: _frames_table(args.steps_on_rank, args.frame_repeats),
        "overlap": lambda: _overlap_table(args.steps),
    }
    tables = {name: make() for name, make in makers.items() if name in args.tables}
    if rank == 0:
        queue.put(tables)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200, help="status gathers timed")
    parser.add_argument("--skipped-repeats", type=int, default=40, help="skipped calls timed per setting")
    parser.add_argument("--images", type=int, nargs="+", default=[2_000, 20_000], help="images on rank 0")
    parser.add_argument("--steps", type=int, default=12, help="overlap steps per setting")
    parser.add_argument(
        "--steps-on-rank", type=int, nargs="+", default=[100, 600, 5_000], help="video steps on rank 0"
    )
    parser.add_argument("--frame-repeats", type=int, default=15, help="calls timed per video setting")
    parser.add_argument(
        "--tables",
        nargs="+",
        default=list(TABLES),
        choices=TABLES,
        help="the tables to measure (default: all)",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = tempfile.mktemp(prefix="bench-engine-")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(store, args, queue), nprocs=RANKS)
    tables = queue.get()
    for title, rows in tables.items():
        print(f"\n## {title}\n")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
