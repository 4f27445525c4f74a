"""Per-image forward+backward times of a real-sized vision tower on this machine's accelerator.

One process and one device: no second GPU needed. The tower is Hugging Face's Qwen2-VL vision
tower with Qwen2-VL-2B's vision shape (32 blocks of width 1280, 16 heads, MLP 5120, 14-pixel patches
of 2 frames, 2x2 merge: about 0.6 B parameters) and random weights (nothing is downloaded), in
bfloat16 on the GPU. ``--size tiny`` builds a two-block toy in float32 instead, which is what runs on
a CPU (the tests).

For a ladder of image sizes from 64 to 16,384 patches it times forward and backward of one image
and of several equal images in one call (at least 8,192 more patches, at most 32 images), in turn,
``--repeats`` times after two warm-ups (CUDA events on a GPU, the host clock on a CPU): the median
difference per added image is one image's cost, the rest each call's. It

* writes them as ``patch_count,milliseconds`` rows (``--out``), the format the simulator fits a
  cost model to::

      python -m lightning_vit_balance.simulate examples/sample_visual_sizes.jsonl \\
          --timings gpu_timings.csv --ranks 8 64 512 --solver locality   # and --solver lpt

  which turns the gains and plan quality of ``make bench`` into this device's milliseconds;
* prints how far each cost model is from the measured times: the seed's ``l**2`` and the
  shape-derived ``CostModel.from_vit`` (each scaled by its best single factor: plans depend on cost
  ratios only), and a fit to these timings (as fitted);
* prints what the default solver's search near the lower bound is worth in this device's
  milliseconds: on micro-batches drawn from ``examples/sample_visual_sizes.jsonl`` (images and
  videos costed as whole items by the fit), the slowest rank's forward and backward under the
  default plan against under shed-and-place's placement alone (the search's first step, about one
  heap LPT of host time) and under a plain heap LPT (which moves nearly every image), next to the
  host time the first two take to plan;
* prints what each cost model's errors cost: plans made with the seed's ``l**2``,
  ``CostModel.from_vit``, the fit and the online fit (``calibrate_cost=True``, learning from the
  times of its own plans), each judged on the measured times, on the example dataset's samples and
  on a thumbnail-heavy mix.

``--from-timings FILE`` analyses the timings an earlier run wrote instead of timing (no device
needed): ``benchmarks/h200_timings.csv`` holds an H200's.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from lightning_vit_balance import CostCalibrator, CostModel, RebalancePlan, ViTBalanceConfig, plan_rebalance
from lightning_vit_balance.simulate import draw_batches, read_dataset, read_timings
from lightning_vit_balance.solvers import tuning
from lightning_vit_balance.solvers.batch import Batch, rank_loads
from lightning_vit_balance.solvers.locality import shed_and_place
from lightning_vit_balance.solvers.lpt import lpt

DATASET = Path(__file__).resolve().parents[1] / "examples" / "sample_visual_sizes.jsonl"

#: Image grids (T, H, W) in patches, 64 to 16,384 patches; H and W are multiples of the 2x2 merge.
GRIDS: tuple[tuple[int, int, int], ...] = (
    (1, 8, 8),
    (1, 16, 16),
    (1, 16, 32),
    (1, 32, 32),
    (1, 32, 64),
    (1, 48, 64),
    (1, 64, 64),
    (1, 64, 96),
    (1, 96, 96),
    (1, 96, 128),
    (1, 128, 128),
)


def build_tower(size: str, device: torch.device) -> tuple[torch.nn.Module, int, torch.dtype]:
    """The vision tower, its pixel row width and its dtype."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    if size == "2b":
        config = Qwen2VLVisionConfig(
            depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, in_channels=3,
            patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
        )  # fmt: skip
        dtype = torch.bfloat16
    else:
        config = Qwen2VLVisionConfig(
            depth=2, embed_dim=32, hidden_size=48, num_heads=2, in_channels=3, patch_size=2,
            temporal_patch_size=1, spatial_merge_size=2,
        )  # fmt: skip
        dtype = torch.float32
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2VisionTransformerPretrainedModel(config).to(device=device, dtype=dtype)
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return tower, width, dtype


def _clock(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """A timer of one call in milliseconds: CUDA events on a GPU, the host clock elsewhere."""

    def on_gpu(fn: Callable[[], object]) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)

    def on_host(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return 1000.0 * (time.perf_counter() - start)

    return on_gpu if device.type == "cuda" else on_host


#: Patches the timed call adds beyond the first image: enough that one call's noise (kernel
#: launches and the host syncs of the tower's attention, which vary by milliseconds on a GPU) is
#: small next to them. Small images are therefore timed many to a call.
EXTRA_PATCHES = 8192
MAX_COPIES = 32


def copies_timed(patches: int) -> int:
    """How many equal images the second timed call holds (the first holds one)."""
    return min(MAX_COPIES, max(2, 1 + -(-EXTRA_PATCHES // patches)))


def time_images(
    tower: torch.nn.Module,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    grids: Sequence[tuple[int, int, int]] = GRIDS,
) -> list[tuple[int, float, float]]:
    """``(patch_count, ms per image, ms per call)`` of forward and backward.

    A call of one image and a call of ``copies_timed`` equal images are timed in turn, ``repeats``
    times: the median of the differences, over the added images, is what one more image costs (its
    share of the rank's ViT time, what a plan moves); the rest of the one-image call is what every
    call pays once (kernel launches of the layers that run on the whole batch). Timing the two in
    turn lets a drifting clock or a busy host weigh on both alike.
    """
    clock = _clock(device)
    timings = []
    for grid in grids:
        patches = grid[0] * grid[1] * grid[2]
        copies = copies_timed(patches)
        inputs = []
        for n in (1, copies):
            pixels = torch.randn(n * patches, width, device=device, dtype=dtype)
            inputs.append((pixels, torch.tensor([grid] * n, device=device)))
        for pixels, grid_thw in inputs:
            for _ in range(2):
                _forward_backward(tower, pixels, grid_thw)
        ones, per_image = [], []
        for _ in range(repeats):
            one, many = (clock(lambda p=p, g=g: _forward_backward(tower, p, g)) for p, g in inputs)
            ones.append(one)
            per_image.append((many - one) / (copies - 1))
        tower.zero_grad(set_to_none=True)
        image_ms = max(statistics.median(per_image), 0.0)
        timings.append((patches, image_ms, max(statistics.median(ones) - image_ms, 0.0)))
    return timings


def _forward_backward(tower: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor) -> None:
    output = tower(pixels, grid_thw=grid_thw)
    hidden = output if isinstance(output, torch.Tensor) else output[0]
    hidden.float().square().mean().backward()


def _errors(predicted: Sequence[float], measured: Sequence[float], scaled: bool) -> float:
    """Median ``|predicted / measured - 1|``, after the best single factor when ``scaled``."""
    factor = 1.0
    if scaled:
        ratios = sorted(m / p for p, m in zip(predicted, measured) if p > 0)
        factor = statistics.median(ratios) if ratios else 1.0
    return statistics.median(abs(factor * p / m - 1.0) for p, m in zip(predicted, measured) if m > 0)


def report(tower: torch.nn.Module, timings: list[tuple[int, float, float]]) -> CostModel:
    """Print the timings and each cost model's error on them; returns the fit."""
    counts = [n for n, _, _ in timings]
    measured = [ms for _, ms, _ in timings]
    print("  patches   ms per image   us per patch   ms per call   images timed")
    for n, ms, call in timings:
        per_call = f"{call:>11.3f}   {copies_timed(n):>12}" if call == call else f"{'-':>11}   {'-':>12}"
        print(f"  {n:>7}   {ms:>12.3f}   {1000.0 * ms / n:>12.3f}   {per_call}")
    fitted = CostModel.fit(counts, measured)
    models = {
        "l^2 (seed default), best factor": (CostModel(), True),
        "shape FLOPs (CostModel.from_vit), best factor": (CostModel.from_vit(tower), True),
        "fit to these timings, as fitted": (fitted, False),
    }
    print("\nCost model error per image: median |predicted / measured - 1|")
    for name, (model, scaled) in models.items():
        predicted = model.costs(counts)
        print(f"  {name:<48} {100.0 * _errors(predicted, measured, scaled):6.1f}%")
    terms = f"{fitted.quadratic:.3g}*l^2 + {fitted.linear:.3g}*l + {fitted.constant:.3g}"
    print(f"  fit (ms): {terms}")
    return fitted


def search_worth(model: CostModel, ranks: Sequence[int], samples_per_rank: int, steps: int) -> None:
    """Print the slowest rank under the default plan, under shed-and-place's placement alone and
    under a plain heap LPT (the seed's, without its refinement), in the model's units
    (milliseconds, when fitted to timings), and the host time of the first two (CPU time,
    medians): ``plan_rebalance`` whole, and for the placement only building the batch, placing
    and its loads (no validation, no plan value). Each plan counts only where it shortens the
    slowest rank, as the default's skip rules do."""
    samples = read_dataset(DATASET).samples
    config = ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0)
    print(
        f"\nThe search near the bound, {samples_per_rank} samples per rank, {steps} steps"
        " (means; plan ms: medians)"
    )
    print(
        "  ranks | unbalanced  heap LPT  placement   default     bound | search saves"
        " | plan ms: placement  default"
    )
    for num_ranks in ranks:
        figures: dict[str, list[float]] = {k: [] for k in ("before", "lpt", "placed", "default", "bound")}
        seconds: dict[str, list[float]] = {"placed": [], "default": []}
        for counts in draw_batches(samples, num_ranks, samples_per_rank, steps, seed=num_ranks):
            start = time.process_time()
            plan = plan_rebalance(counts, config, cost_model=model)
            middle = time.process_time()
            batch = Batch.build(tuple(map(tuple, counts)), model)
            placed = shed_and_place(batch, batch.lower_bound * (1.0 + tuning.SHED_AIM), None)
            placed_makespan = max(rank_loads(batch, placed), default=0.0)
            seconds["placed"].append(time.process_time() - middle)
            seconds["default"].append(middle - start)
            before = plan.makespan_before
            figures["before"].append(before)
            figures["lpt"].append(min(max(lpt(batch, None)[1]), before))
            figures["placed"].append(min(placed_makespan, before))
            figures["default"].append(plan.makespan_after)
            figures["bound"].append(plan.lower_bound)
        mean = {k: float(np.mean(v)) for k, v in figures.items()}
        plan_ms = {k: 1000.0 * statistics.median(v) for k, v in seconds.items()}
        print(
            f"  {num_ranks:>5} | {mean['before']:>10.2f} {mean['lpt']:>9.2f} {mean['placed']:>10.2f} "
            f"{mean['default']:>9.2f} {mean['bound']:>9.2f} | {mean['placed'] - mean['default']:>12.3f} "
            f"| {plan_ms['placed']:>18.3f} {plan_ms['default']:>8.3f}"
        )


#: Steps of each mix left out of the cost models' means: the online fit's warm-up
#: (:class:`CostCalibrator` ignores 2 measured steps and needs 12 rank rows for its first fit).
JUDGE_FROM_STEP = 20


def thumbnail_heavy(num_ranks: int, steps: int, seed: int) -> list[list[list[int]]]:
    """Per step, 1-24 images per rank, 7 in 10 thumbnails of 64-256 patches and the rest of
    1,024-8,192 (crops, icons, video frames at low resolution next to pages): where a device's
    per-image cost, which no FLOP count sees, sets the loads."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        sizes = rng.integers(1, 25, num_ranks)
        small = rng.random(int(sizes.sum())) < 0.7
        patches = np.where(small, rng.integers(64, 257, small.size), rng.integers(1024, 8193, small.size))
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        batches.append([patches[a:b].tolist() for a, b in itertools.pairwise(bounds.tolist())])
    return batches


def judge_cost_models(
    tower: torch.nn.Module,
    timings: list[tuple[int, float, float]],
    fitted: CostModel,
    ranks: Sequence[int],
    steps: int,
) -> None:
    """Print the slowest rank's time under plans made with each cost model, every plan judged on the
    measured times (interpolated per image in log-log between the timed sizes; beyond the largest,
    the fit's growth): what a cost model's errors cost in the device's milliseconds. ``auto`` is the
    online fit (``calibrate_cost=True``): a :class:`CostCalibrator` from ``CostModel.from_vit``,
    given each step's per-rank times of the plan it made, as the gather carries them. Two mixes:
    4 samples per rank from the example dataset (videos whole), and :func:`thumbnail_heavy`. Skip
    rules off; means over the steps after the online fit's warm-up (:data:`JUDGE_FROM_STEP`)."""
    truth = _measured_cost(timings, fitted)
    models = {"l^2": CostModel(), "from_vit": CostModel.from_vit(tower), "fit": fitted}
    samples = read_dataset(DATASET).samples
    mixes: dict[str, Callable[[int], list[list[list[int]]]]] = {
        "4 samples per rank of the example dataset": lambda p: list(
            draw_batches(samples, p, 4, steps, seed=p)
        ),
        "thumbnail-heavy (1-24 images per rank, 7 in 10 of 64-256 patches)": lambda p: thumbnail_heavy(
            p, steps, seed=p
        ),
    }
    skip = min(JUDGE_FROM_STEP, steps // 2)
    for title, draw in mixes.items():
        print(f"\nPlans by cost model, judged on the measured times, {title}:")
        print(f"means of steps {skip + 1}-{steps}; auto = the online fit, bound = max(total / P, largest)")
        print("  ranks | unbalanced " + " ".join(f"{name:>9}" for name in (*models, "auto", "bound")))
        for num_ranks in ranks:
            means = _judged(draw(num_ranks), models, truth, num_ranks, skip)
            print(f"  {num_ranks:>5} | {means[0]:>10.1f} " + " ".join(f"{m:>9.1f}" for m in means[1:]))


def _measured_cost(timings: list[tuple[int, float, float]], fitted: CostModel) -> Callable[[int], float]:
    """An image's measured milliseconds: interpolated in log-log between the timed sizes, beyond the
    largest grown as ``fitted`` grows."""
    counts = np.log(np.array([n for n, _, _ in timings], dtype=np.float64))
    measured = np.log(np.array([ms for _, ms, _ in timings], dtype=np.float64))
    largest, largest_ms = int(timings[-1][0]), float(timings[-1][1])

    def truth(n: int) -> float:
        if n > largest:
            return largest_ms * fitted.costs([n])[0] / fitted.costs([largest])[0]
        return float(np.exp(np.interp(np.log(max(n, 1)), counts, measured)))

    return truth


def _judged(
    batches: list[list[list[int]]],
    models: dict[str, CostModel],
    truth: Callable[[int], float],
    num_ranks: int,
    skip: int,
) -> list[float]:
    """Means over the steps after ``skip`` of the slowest rank's measured time: unbalanced, under
    each model's plans, under the online fit's, and the bound ``max(total / P, largest image)``."""
    config = ViTBalanceConfig(trigger_threshold=0.0, min_gain=0.0, split_videos=False)
    calibrator = CostCalibrator(models["from_vit"])
    slowest: dict[str, list[float]] = {name: [] for name in ("unbalanced", *models, "auto", "bound")}
    for batch in batches:
        costs = [[truth(n) for n in row] for row in batch]
        slowest["unbalanced"].append(max(sum(row) for row in costs))
        flat = [c for row in costs for c in row]
        slowest["bound"].append(max(sum(flat) / num_ranks, max(flat)))
        for name, model in models.items():
            loads, _ = _placed(batch, costs, plan_rebalance(batch, config, cost_model=model))
            slowest[name].append(max(loads))
        loads, encoded = _placed(batch, costs, plan_rebalance(batch, config, cost_model=calibrator.model))
        slowest["auto"].append(max(loads))
        calibrator.observe(encoded, loads)  # the online fit's own plan, as every rank measures it
    return [float(np.mean(v[skip:])) for v in slowest.values()]


def _placed(
    batch: list[list[int]], costs: list[list[float]], plan: RebalancePlan
) -> tuple[list[float], list[list[int]]]:
    """Under ``plan``: each rank's measured time (``costs``, per image of ``batch``) and the patch
    counts of the images it encodes."""
    loads: list[float] = [0.0] * plan.num_ranks
    encoded: list[list[int]] = [[] for _ in range(plan.num_ranks)]
    for row, row_costs, destinations in zip(batch, costs, plan.destinations):
        for n, cost, rank in zip(row, row_costs, destinations):
            loads[rank] += cost
            encoded[rank].append(n)
    return loads, encoded


def _saved_timings(path: Path) -> list[tuple[int, float, float]]:
    """Timings read back from a ``--out`` file: per call unknown (nan)."""
    patch_counts, milliseconds = read_timings(path)
    return [(n, ms, float("nan")) for n, ms in zip(patch_counts, milliseconds)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    parser.add_argument(
        "--size", choices=("2b", "tiny"), default=None, help="default: 2b on a GPU, tiny on a CPU"
    )
    parser.add_argument("--repeats", type=int, default=9, help="timed pairs of calls per image size")
    parser.add_argument("--max-patches", type=int, default=None, help="time only images up to this size")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 64], help="search-worth DP sizes")
    parser.add_argument("--steps", type=int, default=200, help="search-worth steps per DP size")
    parser.add_argument("--out", type=Path, default=Path("demo_output/gpu_timings.csv"))
    parser.add_argument(
        "--from-timings",
        type=Path,
        default=None,
        help="analyse timings an earlier run wrote (e.g. benchmarks/h200_timings.csv) instead of timing",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or min(args.ranks) < 2 or args.repeats < 1:
        parser.error(
            f"need --steps >= 1, every --ranks >= 2 and --repeats >= 1; got {args.steps}, {args.ranks} "
            f"and {args.repeats}"
        )
    if args.from_timings is not None and not args.from_timings.is_file():
        parser.error(f"--from-timings {args.from_timings}: no such file")
    if args.from_timings is not None:
        size = args.size or "2b"
        with torch.device("meta"):  # only its shape is read (CostModel.from_vit)
            tower = build_tower(size, torch.device("meta"))[0]
        print(f"{size} tower, timings read from {args.from_timings}")
        timings = _saved_timings(args.from_timings)
        fitted = report(tower, timings)
        search_worth(fitted, args.ranks, samples_per_rank=4, steps=args.steps)
        judge_cost_models(tower, timings, fitted, args.ranks, args.steps)
        return
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    size = args.size or ("2b" if device.type == "cuda" else "tiny")
    if device.type == "cuda":
        # Full float32 where float32 is used; the 2b tower runs in bfloat16 anyway.
        torch.backends.cuda.matmul.allow_tf32 = False
    tower, width, dtype = build_tower(size, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    parameters = sum(p.numel() for p in tower.parameters())
    shape = f"{size} tower ({parameters / 1e6:.1f} M parameters, {dtype})"
    print(f"{shape} on {where}, medians of {args.repeats} pairs")
    grids = [g for g in GRIDS if args.max_patches is None or g[0] * g[1] * g[2] <= args.max_patches]
    timings = time_images(tower, width, dtype, device, args.repeats, grids)
    fitted = report(tower, timings)
    search_worth(fitted, args.ranks, samples_per_rank=4, steps=args.steps)
    judge_cost_models(tower, timings, fitted, args.ranks, args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{n},{ms:.6f}\n" for n, ms, _ in timings)
    args.out.write_text("patch_count,milliseconds\n" + rows)
    print(f"\ntimings written to {args.out} (the simulator's --timings)")


if __name__ == "__main__":
    main()
