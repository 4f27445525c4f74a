"""Planning benchmark: plan quality, pixel rows moved and plan time, seed solver vs default.

Run with ``make bench`` (or ``python benchmarks/bench_planning.py``; ``--quick`` for a smoke run).
Batches use Qwen2-VL-style sizes: 14-pixel patches with a 2x2 merge, so image sides are rounded to
multiples of 28 pixels and an image has ``(H/14) * (W/14)`` patches; videos have 4-16 temporal
patches. Every rank holds 1-16 images. Costs are the seed's ``l**2``. RNG seeds are fixed, so the
table is the same on every run (plan times aside). See BENCHMARKS.md for how to read the output.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np

from lightning_vit_balance import ViTBalanceConfig, plan_rebalance

PATCH_PX = 14
MERGE = 2

# Solver quality is measured with both skip rules off so every plan is a real plan; the seed still
# skips when one image outweighs the mean load (that is part of its algorithm).
FORCED = {"trigger_threshold": 0.0, "min_gain": 0.0}


def image_patches(rng: np.random.Generator, min_px: float, max_px: float, size: int) -> np.ndarray:
    """Patches of ``size`` images whose pixel area is log-uniform in ``[min_px**2, max_px**2]``."""
    area = np.exp(rng.uniform(2 * np.log(min_px), 2 * np.log(max_px), size))
    aspect = np.exp(rng.uniform(np.log(0.5), np.log(2.0), size))
    unit = PATCH_PX * MERGE
    height = np.maximum(unit, np.round(np.sqrt(area * aspect) / unit) * unit)
    width = np.maximum(unit, np.round(np.sqrt(area / aspect) / unit) * unit)
    return (height // PATCH_PX * (width // PATCH_PX)).astype(np.int64)


def video_patches(rng: np.random.Generator, size: int) -> np.ndarray:
    """Videos: 4-16 temporal patches of frames between 168x168 and 448x448 pixels."""
    frames = rng.integers(4, 17, size)
    return frames * image_patches(rng, 168, 448, size)


def mixed(rng: np.random.Generator, size: int) -> np.ndarray:
    """Photos (56 px to ~1 MP) with one document page in four (~1 to ~2.6 MP)."""
    photos = image_patches(rng, 56, 1024, size)
    documents = image_patches(rng, 1024, 1624, size)
    return np.where(rng.random(size) < 0.25, documents, photos)


def video_heavy(rng: np.random.Generator, size: int) -> np.ndarray:
    """Three videos in five, the rest photos."""
    return np.where(rng.random(size) < 0.6, video_patches(rng, size), image_patches(rng, 56, 1024, size))


def heavy_tail(rng: np.random.Generator, size: int) -> np.ndarray:
    """Small photos (56-512 px) and, one image in a hundred, a huge one (4-12.8 MP)."""
    small = image_patches(rng, 56, 512, size)
    huge = image_patches(rng, 2048, 3584, size)
    return np.where(rng.random(size) < 0.01, huge, small)


def uniform(rng: np.random.Generator, size: int) -> np.ndarray:
    """Images of about the same size (392 to 504 px a side): mostly the image counts differ."""
    return image_patches(rng, 392, 504, size)


SCENARIOS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "mixed photos+documents": mixed,
    "video-heavy": video_heavy,
    "heavy tail": heavy_tail,
    "uniform": uniform,
}


def draw_batch(
    scenario: Callable[[np.random.Generator, int], np.ndarray],
    rng: np.random.Generator,
    num_ranks: int,
    per_rank: tuple[int, int] = (1, 16),
) -> list[list[int]]:
    """Per-rank patch counts: ``per_rank`` images per rank (inclusive range)."""
    sizes = rng.integers(per_rank[0], per_rank[1] + 1, num_ranks)
    flat = scenario(rng, int(sizes.sum())).tolist()
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [flat[s:e] for s, e in itertools.pairwise(bounds)]


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def quality(points: list[tuple[int, int, bool]], quick: bool) -> None:
    """One table per scenario: makespan/LB and rows moved, no balancing vs seed vs default."""
    seed_cfg = ViTBalanceConfig(solver="seed", **FORCED)
    default_cfg = ViTBalanceConfig(**FORCED)
    plain_default = ViTBalanceConfig()
    print("Plan quality (skip rules off; medians over draws; moved = % of all pixel rows;")
    print("xLB = moved / lower bound on rows any plan that good must move)")
    summary: list[str] = []
    for index, (name, scenario) in enumerate(SCENARIOS.items()):
        print(f"\n## {name}")
        print(
            f"{'P':>5} {'draws':>5} | {'none':>6} | {'seed':>6} {'moved':>6} {'xLB':>5} | "
            f"{'default':>7} {'moved':>6} {'xLB':>5} {'max d/s':>7} | "
            f"{'applied':>7} | {'ms seed':>8} {'ms dflt':>7}"
        )
        scenario_ratio: list[float] = []
        for num_ranks, draws, with_seed in points:
            rng = np.random.default_rng(1000 * index + num_ranks)
            rows: dict[str, list[float]] = {
                k: []
                for k in (
                    "none",
                    "seed",
                    "seed_moved",
                    "seed_xlb",
                    "dflt",
                    "dflt_moved",
                    "dflt_xlb",
                    "ratio",
                    "applied",
                    "t_seed",
                    "t_dflt",
                )
            }
            for _ in range(draws):
                batch = draw_batch(scenario, rng, num_ranks)
                plan, seconds = timed(lambda b=batch: plan_rebalance(b, default_cfg))
                lb = plan.lower_bound
                total = plan.total_patches
                rows["none"].append(plan.makespan_before / lb)
                rows["dflt"].append(plan.makespan_after / lb)
                rows["dflt_moved"].append(100 * plan.moved_patches / total)
                rows["dflt_xlb"].append(plan.moved_patches / max(plan.moved_patches_lower_bound, 1.0))
                rows["t_dflt"].append(1000 * seconds)
                rows["applied"].append(100.0 * plan_rebalance(batch, plain_default).applied)
                if with_seed:
                    seed, seconds = timed(lambda b=batch: plan_rebalance(b, seed_cfg))
                    rows["seed"].append(seed.makespan_after / lb)
                    rows["seed_moved"].append(100 * seed.moved_patches / total)
                    rows["seed_xlb"].append(seed.moved_patches / max(seed.moved_patches_lower_bound, 1.0))
                    rows["ratio"].append(plan.makespan_after / seed.makespan_after)
                    rows["t_seed"].append(1000 * seconds)
            med = {k: statistics.median(v) if v else float("nan") for k, v in rows.items()}
            worst = max(rows["ratio"], default=float("nan"))
            scenario_ratio.extend(rows["dflt"])
            print(
                f"{num_ranks:>5} {draws:>5} | {med['none']:>6.3f} | {med['seed']:>6.3f} "
                f"{med['seed_moved']:>5.1f}% {med['seed_xlb']:>5.1f} | {med['dflt']:>7.3f} "
                f"{med['dflt_moved']:>5.1f}% {med['dflt_xlb']:>5.1f} {worst:>7.4f} | "
                f"{med['applied']:>6.0f}% | {med['t_seed']:>8.1f} {med['t_dflt']:>7.2f}"
            )
        overall = statistics.median(scenario_ratio)
        summary.append(f"{name}: median default makespan/LB over all draws {overall:.4f}")
    print()
    for line in summary:
        print(line)


def plan_time(sizes: list[int], seed_sizes: set[int], repeats: int) -> None:
    """Median plan time at 8 images per rank, and the default's speedup over the seed solver.

    The speedup is taken on uniform sizes, where the seed solver always runs in full (on mixed
    batches it often skips because one document outweighs the mean load).
    """
    print("\nPlan time, 8 images per rank (median ms over batches x 3 runs; skip rules off)")
    header = f"{'P':>5} | {'uniform: seed':>13} {'default':>8} {'speedup':>7} | "
    print(header + f"{'mixed: default':>14} {'video-heavy: default':>20}")
    seed_cfg = ViTBalanceConfig(solver="seed", **FORCED)
    default_cfg = ViTBalanceConfig(**FORCED)
    for num_ranks in sizes:
        default_ms = {}
        seed_ms = float("nan")
        for name, scenario in (("uniform", uniform), ("mixed", mixed), ("video", video_heavy)):
            rng = np.random.default_rng(7 + num_ranks)
            batches = [draw_batch(scenario, rng, num_ranks, (8, 8)) for _ in range(repeats)]
            default_ms[name] = statistics.median(
                1000 * timed(lambda b=b: plan_rebalance(b, default_cfg))[1] for b in batches for _ in range(3)
            )
            if name == "uniform" and num_ranks in seed_sizes:
                seed_ms = statistics.median(
                    1000 * timed(lambda b=b: plan_rebalance(b, seed_cfg))[1]
                    for b in batches[: 3 if num_ranks < 1024 else 1]
                )
        speedup = seed_ms / default_ms["uniform"]
        print(
            f"{num_ranks:>5} | {seed_ms:>13.1f} {default_ms['uniform']:>8.2f} {speedup:>6.0f}x | "
            f"{default_ms['mixed']:>14.2f} {default_ms['video']:>20.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer draws, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        points = [(8, 5, True), (64, 3, True), (256, 1, True)]
        quality(points, quick=True)
        plan_time([8, 64, 256], {8, 64, 256}, repeats=2)
        return
    points = [
        (8, 40, True),
        (32, 30, True),
        (128, 15, True),
        (512, 4, True),
        (1024, 3, True),
        (4096, 1, False),
    ]
    start = time.perf_counter()
    quality(points, quick=False)
    plan_time([8, 32, 128, 512, 1024], {8, 32, 128, 512, 1024}, repeats=7)
    print(f"\n(benchmark took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
