"""Inference without a training step: does balancing each batch pay when nothing else makes the
ranks meet?

``make bench-predict`` runs 2 gloo CPU ranks (``--ranks``) over the demo's tower and batches (as
``make bench-e2e`` draws them: ``DistributedSampler(shuffle=False)`` order, 2 samples per rank
and batch), forward only under ``torch.no_grad``, each batch encoded twice in an order alternating
with the batch: directly (``vit(pixel_values, grid_thw)``) and balanced (``ViTBalancer`` with the
demo's config). Each call's process CPU time is the rank's busy time, its best of ``--repeats``;
a balanced call's includes its exchange and host work, and not its waits.

A training step's gradient all-reduce makes every rank wait for the slowest one at every step, so
a step costs the slowest rank's time. A predict loop (Lightning's ``trainer.predict``, a plain
inference loop) has no such meeting: each rank runs its own batches, and the job takes as long as
the rank whose total is largest. A balanced call is a collective, so with balancing the ranks
meet at every batch again. The report puts the three side by side, in seconds over the batches
after the first (a warm-up):

* *direct, ranks apart*: ``max over ranks of the sum over batches``, a predict loop without
  balancing;
* *direct, ranks meeting*: ``sum over batches of the max over ranks``, the same calls where the
  ranks meet at every batch anyway (the tower's or the model's parameters sharded, FSDP or ZeRO-3,
  whose every call is a collective; a collective of the user's own in the step);
* *balanced*: ``sum over batches of the max over ranks`` of the balanced calls.

The mixin's ``vit_balance_predict`` (off by default) follows from it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from bench_e2e import Mix, cpu_ms, demo_mix, exit_without_teardown, make_tower, rank_batch
from tiny_vlm import SyntheticVLMDataset

from lightning_vit_balance import ViTBalancer

__all__ = ["main", "predict_report"]


def _worker(rank: int, world: int, store_path: str, out_dir: str, mix: Mix, args: dict[str, Any]) -> None:
    torch.set_num_threads(1)  # one core per rank: ranks must not steal each other's cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        tower = make_tower(mix, torch.device("cpu")).eval()
        batches = args["batches"]
        dataset = SyntheticVLMDataset(
            batches * world * mix.batch_size, patch_dim=tower.patch_dim, scale=mix.scale, seed=mix.seed
        )
        balancer = ViTBalancer(mix.config)
        times: dict[str, list[float]] = {"direct": [], "balanced": []}
        applied = 0
        with torch.no_grad():
            for batch in range(batches):
                pixels, grid = rank_batch(dataset, batch, rank, world, mix.batch_size)
                calls = {
                    "direct": functools.partial(tower, pixels, grid),
                    "balanced": functools.partial(balancer, tower, pixels, grid),
                }
                for name in sorted(calls, reverse=bool(batch % 2)):  # the order alternates
                    times[name].append(cpu_ms(calls[name], args["repeats"]) / 1000)
                applied += int(balancer.last_stats is not None and balancer.last_stats.applied)
        result = {"times": times, "applied": applied}
        Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def predict_report(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Print the three totals and their ratios; returns them."""
    direct = torch.tensor([r["times"]["direct"] for r in results])[:, 1:]  # [ranks, batches]
    balanced = torch.tensor([r["times"]["balanced"] for r in results])[:, 1:]
    summary = {
        "direct_apart_s": float(direct.sum(1).max()),
        "direct_meeting_s": float(direct.max(0).values.sum()),
        "balanced_s": float(balanced.max(0).values.sum()),
    }
    summary["gain_apart"] = summary["direct_apart_s"] / summary["balanced_s"]
    summary["gain_meeting"] = summary["direct_meeting_s"] / summary["balanced_s"]
    ranks, batches = direct.shape
    print(f"Inference, {ranks} ranks x {batches} batches after a warm-up (process CPU s, best of repeats)")
    print(f"  direct, ranks apart    (max over ranks of their sums):  {summary['direct_apart_s']:.3f}")
    print(f"  direct, ranks meeting  (sum over batches of the max):   {summary['direct_meeting_s']:.3f}")
    print(f"  balanced (meet at every batch):                        {summary['balanced_s']:.3f}")
    print(f"  balancing's gain where ranks run apart: {summary['gain_apart']:.2f}x;", end=" ")
    print(f"where they meet anyway: {summary['gain_meeting']:.2f}x")
    print(f"  batches whose plan moved images: {results[0]['applied']} of {batches + 1}")
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo CPU ranks")
    parser.add_argument("--batches", type=int, default=31, help="batches per rank (the first is a warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="each call's best of this many runs")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.batches < 2 or args.repeats < 1:
        parser.error(
            "need --ranks >= 2, --batches >= 2 (the first is a warm-up) and --repeats >= 1; got "
            f"{args.ranks}, {args.batches} and {args.repeats}"
        )
    mix = demo_mix()
    with tempfile.TemporaryDirectory() as tmp:
        settings = {"batches": args.batches, "repeats": args.repeats}
        store = str(Path(tmp) / "store")
        mp.spawn(_worker, args=(args.ranks, store, tmp, mix, settings), nprocs=args.ranks, join=True)
        results = [json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(args.ranks)]
    return predict_report(results)


if __name__ == "__main__":
    main()
