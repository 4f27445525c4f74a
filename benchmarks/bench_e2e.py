"""End-to-end benchmark: real ranks, the demo's tower and batches, forward and backward.

``make bench-e2e`` runs both parts below on its default mix, 4 samples per rank and step (12 steps),
then both again on the demo's 2 samples per rank (about three minutes in all on 2 cores); ``--mode``
picks one part, ``--batch-size`` the samples per rank (the demo's 2 when not given). With 2 samples
per rank a single document page or video outweighs the mean load in many steps, so whole images
leave a floor near 1.1 that no balancer can go below; with 4 the floor is near 1.02 and the
exchange's own cost shows.

**e2e**: 2 ranks (``--ranks``) spawned with ``torch.multiprocessing`` and joined through a file
store (gloo on CPU; NCCL when every rank has a GPU). Each rank draws its batches from the demo's
:class:`SyntheticVLMDataset` (scale 1.3, 2 samples per rank and step, in dataset order, split as
``DistributedSampler(shuffle=False)`` splits them: the demo's training shuffles, so its steps hold
other batches of the same samples) and encodes them with the demo's :class:`TinyVisionTower`,
forward and backward, four ways per step, on the same batch, in an order rotating with the step:

* *unbalanced*: ``vit(pixel_values, grid_thw)``;
* *balanced*: ``ViTBalancer(config, group)(vit, pixel_values, grid_thw)`` with the demo's config
  (cost model from the tower's shape);
* *calibrated*: the same, with a cost model fitted online by
  :class:`~lightning_vit_balance.cost.CostCalibrator` from every rank's measured encode time of the
  previous steps (gathered, so every rank fits the same coefficients; checked at the end);
* *plan only*: ``vit`` called directly on the balanced batch the plan gives this rank, with no
  exchange: what balancing would cost without any overhead.

ViT time is process CPU time (``time.process_time``, one thread per rank), so other jobs on the
machine do not add their time; on GPUs it is the wall time between synchronisations. Contention
still inflates CPU time (shared caches), never deflates it, so every figure is a rank's best of
``--repeats`` runs. The ideal is the mean over ranks of the unbalanced time: perfectly spread work.
``balanced / ideal`` splits into the *floor* (the plan's own makespan over the mean load in cost
units: whole images, one of which can outweigh the mean, and the skip rules), ``plan only /
floor`` (cost-model error and noise) and ``balanced / plan only`` (exchange and host overhead).
The overhead table splits the balanced forward call in wall milliseconds from
:class:`BalanceStats` (``n/a`` for figures a balancer does not report), next to a raw
``all_to_all_single`` of the same bytes.

**calibration**: one process measures, on the same tower and batches, each rank batch's forward
CPU time and each image's alone, then reports the median relative prediction error per image and
per rank batch of the seed's ``l**2``, of the shape-derived model and of a :class:`CostCalibrator`
fitted on the first two thirds of the steps, on the last third. ``--timings-out FILE.csv`` writes
the per-image times (``patch_count,milliseconds``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from tiny_vlm import SyntheticVLMDataset, TinyVisionTower  # noqa: E402

from lightning_vit_balance import ViTBalanceConfig, ViTBalancer, plan_rebalance  # noqa: E402
from lightning_vit_balance.cost import CostCalibrator, CostModel  # noqa: E402

WARMUP_STEPS = 3  # first steps pay one-off allocations; left out of every summary
# BalanceStats figures of the balanced call, read when present (older balancers lack some).
STAT_FIELDS = (
    "gather_seconds",
    "plan_seconds",
    "dispatch_seconds",
    "encode_seconds",
    "combine_seconds",
    "status_seconds",
    "exchange_seconds",
)


@dataclass(frozen=True)
class Mix:
    """The demo's tower and batches (read from ``examples/demo.py``)."""

    tower_kwargs: dict[str, Any]
    config: ViTBalanceConfig
    scale: float = 1.3
    batch_size: int = 2
    seed: int = 0


def demo_mix() -> Mix:
    """The demo's tower, config and batch mix; imported here, not at module level, so spawned
    ranks do not pay for importing Lightning."""
    import demo

    defaults = demo.parse_args([])
    return Mix(dict(demo.TOWER_KWARGS), demo.balanced_config(), defaults.scale, defaults.batch_size)


def sample_indices(step: int, rank: int, ranks: int, batch_size: int) -> list[int]:
    """Samples of ``rank`` at ``step``: ``DistributedSampler(shuffle=False)`` then batches."""
    return [rank + ranks * (step * batch_size + j) for j in range(batch_size)]


def rank_batch(
    dataset: SyntheticVLMDataset, step: int, rank: int, ranks: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values [sum(l), C], grid_thw [n, 3])`` of one rank at one step."""
    samples = [dataset[i] for i in sample_indices(step, rank, ranks, batch_size)]
    return (
        torch.cat([s["pixel_values"] for s in samples]),
        torch.cat([s["image_grid_thw"] for s in samples]),
    )


def rank_counts(dataset: SyntheticVLMDataset, step: int, ranks: int, batch_size: int) -> list[list[int]]:
    """Patch counts of every rank's images at ``step``, without drawing pixels."""
    return [
        [t * h * w for i in sample_indices(step, r, ranks, batch_size) for t, h, w in dataset.grids(i)[1]]
        for r in range(ranks)
    ]


def make_tower(mix: Mix, device: torch.device) -> TinyVisionTower:
    torch.manual_seed(mix.seed)  # the same weights on every rank
    return TinyVisionTower(**mix.tower_kwargs).to(device)


def vit_loss(output: Any) -> torch.Tensor:
    """A scalar reaching every output the tower returns (embeddings and deepstack features)."""
    embeds, _window_index, deepstack = output
    return embeds.sum() + sum(d.sum() for d in deepstack)


# -- calibration: prediction error of cost models against measured times ------------------------


def cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Smallest process CPU time of ``repeats`` calls, in ms (the least disturbed run)."""
    best = math.inf
    for _ in range(repeats):
        started = time.process_time()
        fn()
        best = min(best, time.process_time() - started)
    return 1000 * best


@dataclass
class CalibrationData:
    """Per step and rank: the images' patch counts, each image's forward ms, the batch's ms."""

    counts: list[list[list[int]]] = field(default_factory=list)
    image_ms: list[list[list[float]]] = field(default_factory=list)
    batch_ms: list[list[float]] = field(default_factory=list)


def measure_calibration(mix: Mix, steps: int, ranks: int, repeats: int) -> CalibrationData:
    """Forward CPU times of every rank batch and every image alone, in this process."""
    torch.set_num_threads(1)
    tower = make_tower(mix, torch.device("cpu")).eval()
    dataset = SyntheticVLMDataset(
        (steps + 1) * ranks * mix.batch_size, patch_dim=tower.patch_dim, scale=mix.scale, seed=mix.seed
    )
    data = CalibrationData()
    with torch.no_grad():
        pixels, grid = rank_batch(dataset, 0, 0, ranks, mix.batch_size)
        cpu_ms(lambda: tower(pixels, grid), 3)  # warm-up: allocator, kernels
        for step in range(steps):
            step_counts, step_images, step_batches = [], [], []
            for rank in range(ranks):
                pixels, grid = rank_batch(dataset, step, rank, ranks, mix.batch_size)
                counts = grid.prod(-1).tolist()
                step_batches.append(cpu_ms(lambda p=pixels, g=grid: tower(p, g), repeats))
                rows = torch.split(pixels, counts)
                step_images.append(
                    [cpu_ms(lambda p=p, g=grid[i : i + 1]: tower(p, g), repeats) for i, p in enumerate(rows)]
                )
                step_counts.append(counts)
            data.counts.append(step_counts)
            data.image_ms.append(step_images)
            data.batch_ms.append(step_batches)
    return data


def best_factor_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median relative error of ``s * predicted`` against ``measured`` at the best ``s``.

    The median of ``|s * r_i - 1|`` (``r_i = predicted_i / measured_i``) is piecewise linear in
    ``s``, so its minimum lies where one term is zero or two terms are equal: try all of those.
    """
    ratios = np.asarray(predicted, dtype=np.float64) / np.asarray(measured, dtype=np.float64)
    pairs = ratios[:, None] + ratios[None, :]
    candidates = np.unique(np.concatenate([1.0 / ratios, 2.0 / pairs[np.triu_indices(len(ratios), 1)]]))
    errors = np.median(np.abs(candidates[:, None] * ratios[None, :] - 1.0), axis=1)
    return float(errors.min())


def median_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median relative error, unscaled."""
    return float(np.median(np.abs(np.asarray(predicted) / np.asarray(measured) - 1.0)))


def calibration_report(mix: Mix, data: CalibrationData) -> dict[str, float]:
    """Prediction errors on the held-out last third of the steps; prints the table."""
    fit_steps = 2 * len(data.counts) // 3
    calibrator = CostCalibrator(CostModel.from_config(mix.config), warmup_steps=0)
    for step in range(fit_steps):
        calibrator.observe(data.counts[step], data.batch_ms[step])
    held = range(fit_steps, len(data.counts))
    images = [(n, ms) for s in held for c, t in zip(data.counts[s], data.image_ms[s]) for n, ms in zip(c, t)]
    batches = [(c, ms) for s in held for c, ms in zip(data.counts[s], data.batch_ms[s])]
    measured = ([ms for _, ms in images], [ms for _, ms in batches])
    fitted, overhead = calibrator.model, calibrator.call_overhead_ms
    models: dict[str, tuple[Callable[[Any], Any], float]] = {
        "l^2 (seed default)": (CostModel(), 0.0),
        "shape FLOPs (demo config, CostModel.from_vit)": (CostModel.from_config(mix.config), 0.0),
        f"online fit (CostCalibrator, {fit_steps} steps)": (fitted, overhead),
    }
    print(
        f"\nCost model prediction error: median |predicted / measured - 1| over {len(held)} held-out steps "
        f"({len(images)} images, {len(batches)} rank batches; forward CPU time). A call is predicted at\n"
        "the sum of its images' costs (plus the fit's per-call term), scaled by the model's best single "
        "factor: a plan depends on cost ratios only."
    )
    print(f"  {'model':<50}{'per image':>10}{'per rank batch':>16}")
    results: dict[str, float] = {}
    for name, (model, per_call) in models.items():
        per_image = best_factor_error([model(n) + per_call for n, _ in images], measured[0])
        predicted = [float(np.sum(model(np.array(c)))) + per_call for c, _ in batches]
        per_batch = best_factor_error(predicted, measured[1])
        key = name.split(" (")[0]
        results[f"{key} per image"], results[f"{key} per batch"] = per_image, per_batch
        print(f"  {name:<50}{per_image:>9.1%}{per_batch:>16.1%}")
    as_fitted = (
        median_error([fitted(n) + overhead for n, _ in images], measured[0]),
        median_error([float(np.sum(fitted(np.array(c)))) + overhead for c, _ in batches], measured[1]),
    )
    results["online fit as fitted per image"], results["online fit as fitted per batch"] = as_fitted
    print(
        f"  {'online fit, as fitted (absolute ms, no factor)':<50}{as_fitted[0]:>9.1%}{as_fitted[1]:>16.1%}"
    )
    terms = [
        (fitted.quadratic, "*l^2"),
        (fitted.windowed, f"*l*min(l,{fitted.window_patches})"),
        (fitted.linear, "*l"),
        (fitted.constant, " per image"),
        (overhead, " per call"),
    ]
    shown = " + ".join(f"{value:.3g}{term}" for value, term in terms if value)
    print(f"  fit (ms): {shown}; {calibrator.fits} fits")
    return results


def write_timings(path: Path, data: CalibrationData) -> None:
    """Per-image forward times as ``patch_count,milliseconds`` rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["patch_count", "milliseconds"])
        for step_counts, step_ms in zip(data.counts, data.image_ms):
            for counts, times in zip(step_counts, step_ms):
                writer.writerows([n, f"{ms:.4f}"] for n, ms in zip(counts, times))


# -- e2e: a real multi-rank run --------------------------------------------------------------


class _EncodeTimer:
    """Forward hooks on the tower: CPU (this thread) and wall time inside its forward calls.

    On GPUs the hooks synchronise, so the wall time covers the kernels; :attr:`ms` is then the
    wall time, else the CPU time.
    """

    def __init__(self, tower: torch.nn.Module, device: torch.device) -> None:
        self.cpu = self.wall = 0.0
        self._started = (0.0, 0.0)
        self._device = device
        tower.register_forward_pre_hook(self._pre)
        tower.register_forward_hook(self._post)

    @property
    def ms(self) -> float:
        """Encode milliseconds since :meth:`reset`, on the benchmark's clock."""
        return 1000 * (self.wall if self._device.type == "cuda" else self.cpu)

    def reset(self) -> None:
        self.cpu = self.wall = 0.0

    def _pre(self, *_: Any) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._started = (time.thread_time(), time.perf_counter())

    def _post(self, *_: Any) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.cpu += time.thread_time() - self._started[0]
        self.wall += time.perf_counter() - self._started[1]


class _Clock:
    """ViT time: process CPU seconds on CPU; wall seconds between synchronisations on GPUs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()


def _forward_backward(clock: _Clock, tower: torch.nn.Module, call: Callable[[], Any]) -> tuple[float, float]:
    """``(seconds of call + backward, loss)`` with the tower's gradients cleared first."""
    tower.zero_grad(set_to_none=True)
    started = clock.now()
    loss = vit_loss(call())
    loss.backward()
    return clock.now() - started, float(loss.detach())


def _balanced_batch(
    dataset: SyntheticVLMDataset, plan: Any, step: int, rank: int, mix: Mix, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The images ``plan`` has ``rank`` encode, in balanced-batch order."""
    batches: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}
    pixels, grids = [], []
    for src, i in plan.arrivals(rank):
        if src not in batches:
            p, g = rank_batch(dataset, step, src, plan.num_ranks, mix.batch_size)
            batches[src] = (list(torch.split(p, g.prod(-1).tolist())), g)
        pixels.append(batches[src][0][i])
        grids.append(batches[src][1][i : i + 1])
    if not pixels:
        return torch.zeros(0, dataset.patch_dim, device=device), torch.zeros(0, 3, dtype=torch.long)
    return torch.cat(pixels).to(device), torch.cat(grids)


def _raw_trip_seconds(
    plan: Any, rank: int, elements_per_patch: int, device: torch.device, *, with_home: bool
) -> float:
    """Wall time of one ``all_to_all_single`` moving ``elements_per_patch`` float32 values per patch
    this rank sends to or receives from another rank (and, ``with_home``, to itself): a trip's
    bytes without packing or bookkeeping. The pixel trip leaves the rows that stay home out of its
    collective; the return trip sends a rank's own outputs through it too."""
    world = plan.num_ranks
    sent, received = plan.send_patches(rank), plan.receive_patches(rank)
    send = [0 if d == rank and not with_home else sent[d] * elements_per_patch for d in range(world)]
    receive = [0 if d == rank and not with_home else received[d] * elements_per_patch for d in range(world)]
    out = torch.empty(sum(receive), device=device)
    data = torch.ones(sum(send), device=device)
    dist.barrier()
    started = time.perf_counter()
    dist.all_to_all_single(out, data, receive, send)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


@dataclass
class _Rank:
    """What one rank keeps across steps."""

    mix: Mix
    tower: TinyVisionTower
    dataset: SyntheticVLMDataset
    device: torch.device
    clock: _Clock
    timer: _EncodeTimer
    calibrator: CostCalibrator
    repeats: int


def _step(state: _Rank, step: int) -> dict[str, Any]:
    """One step on this rank: the four encodes (in an order rotating with the step, so none is
    always first), each the best of ``repeats`` runs; the balancer's figures; the raw trips."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pixels, grid = rank_batch(state.dataset, step, rank, world, state.mix.batch_size)
    pixels = pixels.to(state.device)
    counts = rank_counts(state.dataset, step, world, state.mix.batch_size)
    plan = plan_rebalance(counts, state.mix.config)
    calibrated_config = state.calibrator.model.to_config(state.mix.config)
    fitted = state.calibrator.fits > 0
    variants: dict[str, Callable[[], dict[str, Any]]] = {
        "unbalanced": lambda: _run_unbalanced(state, pixels, grid),
        "balanced": lambda: _run_balanced(state, pixels, grid, state.mix.config, "balanced"),
        "calibrated": lambda: _run_balanced(state, pixels, grid, calibrated_config, "calibrated"),
        "plan_only": lambda: _run_plan_only(state, plan, step),
    }
    names = list(variants)
    record: dict[str, Any] = {}
    for name in names[step % 4 :] + names[: step % 4]:
        record.update(_best_of(state.repeats, variants[name], name))
    _calibrate(state, record.pop("calibrated_encode_ms"), plan_rebalance(counts, calibrated_config))
    record["calibrated_fitted"] = fitted
    record["loss_diff"] = abs(record.pop("balanced_loss") - record.pop("unbalanced_loss"))
    mean_load = sum(plan.loads_before) / world
    # The plan's own makespan and lower bound over the mean load, in cost units: the floor that
    # whole images (one can outweigh the mean) and the skip rules leave above the ideal.
    record["floor"] = plan.makespan_after / mean_load if mean_load else 1.0
    record["bound"] = plan.lower_bound / mean_load if mean_load else 1.0
    record["plan_mismatch"] = (plan.applied, plan.moved_images) != (record["applied"], record["moved_images"])
    merged_elements = state.tower.merger.mlp[-1].out_features * (1 + len(state.tower.deepstack_layers)) // 4
    record["raw_forward"] = _raw_trip_seconds(
        plan, rank, state.tower.patch_dim, state.device, with_home=False
    )
    # The return trip goes the other way: each rank sends back what it encoded, its own included.
    reversed_plan = _ReversedPlan(plan)
    record["raw_return"] = _raw_trip_seconds(
        reversed_plan, rank, merged_elements, state.device, with_home=True
    )
    return record


def _best_of(repeats: int, run: Callable[[], dict[str, Any]], key: str) -> dict[str, Any]:
    """The figures of the fastest of ``repeats`` runs by ``key`` (contention only adds time)."""
    best: dict[str, Any] | None = None
    for _ in range(repeats):
        dist.barrier()  # every rank starts each run together
        figures = run()
        if best is None or figures[key] < best[key]:
            best = figures
    assert best is not None
    return best


def _run_unbalanced(state: _Rank, pixels: torch.Tensor, grid: torch.Tensor) -> dict[str, Any]:
    seconds, loss = _forward_backward(state.clock, state.tower, lambda: state.tower(pixels, grid))
    return {"unbalanced": seconds, "unbalanced_loss": loss}


def _run_balanced(
    state: _Rank, pixels: torch.Tensor, grid: torch.Tensor, config: ViTBalanceConfig, name: str
) -> dict[str, Any]:
    """A balanced forward+backward; for ``"balanced"`` also the balancer's figures."""
    balancer = ViTBalancer(config)
    call: dict[str, Any] = {}
    state.timer.reset()
    seconds, loss = _forward_backward(
        state.clock, state.tower, lambda: _timed_call(call, balancer, state.tower, pixels, grid)
    )
    if name == "calibrated":
        return {"calibrated": seconds, "calibrated_encode_ms": state.timer.ms}
    stats = balancer.last_stats
    figures = {name: seconds, "balanced_loss": loss, "encode_cpu": state.timer.cpu, **call}
    figures["stats"] = {field: getattr(stats, field, None) for field in STAT_FIELDS}
    if figures["stats"]["encode_seconds"] is None:
        figures["stats"]["encode_seconds"] = state.timer.wall
    figures.update(moved_images=stats.moved_images, applied=stats.applied)
    return figures


def _calibrate(state: _Rank, encode_ms: float, plan: Any) -> None:
    """Every rank feeds the calibrator the same gathered figures: the patch counts each rank
    encoded under ``plan`` (the calibrated run's) and its encode milliseconds."""
    encoded = [plan.patch_counts[s][i] for s, i in plan.arrivals(dist.get_rank())]
    figures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(figures, (encoded, encode_ms))
    state.calibrator.observe([f[0] for f in figures], [f[1] for f in figures])


def _run_plan_only(state: _Rank, plan: Any, step: int) -> dict[str, Any]:
    pixels, grid = _balanced_batch(state.dataset, plan, step, dist.get_rank(), state.mix, state.device)
    if not len(grid):
        return {"plan_only": 0.0}
    seconds, _ = _forward_backward(state.clock, state.tower, lambda: state.tower(pixels, grid))
    return {"plan_only": seconds}


def _timed_call(record: dict[str, Any], balancer: ViTBalancer, tower: Any, pixels: Any, grid: Any) -> Any:
    started, cpu_started = time.perf_counter(), time.process_time()
    output = balancer(tower, pixels, grid)
    record["call_wall"] = time.perf_counter() - started
    record["call_cpu"] = time.process_time() - cpu_started
    return output


@dataclass(frozen=True)
class _ReversedPlan:
    """The return trip's traffic: what rank ``r`` sends to ``d`` = what ``d`` sent to ``r``."""

    plan: Any

    @property
    def num_ranks(self) -> int:
        return self.plan.num_ranks

    def send_patches(self, rank: int) -> tuple[int, ...]:
        return self.plan.receive_patches(rank)

    def receive_patches(self, rank: int) -> tuple[int, ...]:
        return self.plan.send_patches(rank)


def _worker(rank: int, world: int, store_path: str, out_dir: str, mix: Mix, args: dict[str, Any]) -> None:
    device = torch.device(f"cuda:{rank}") if args["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # one core per rank: ranks must not steal each other's cores
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world
    )
    try:
        tower = make_tower(mix, device)
        dataset = SyntheticVLMDataset(
            (args["steps"] + 1) * world * mix.batch_size,
            patch_dim=tower.patch_dim,
            scale=mix.scale,
            seed=mix.seed,
        )
        state = _Rank(
            mix=mix,
            tower=tower,
            dataset=dataset,
            device=device,
            clock=_Clock(device),
            timer=_EncodeTimer(tower, device),
            calibrator=CostCalibrator(CostModel.from_config(mix.config)),
            repeats=args["repeats"],
        )
        records = [_step(state, step) for step in range(args["steps"])]
        fingerprints: list[Any] = [None] * world
        dist.all_gather_object(fingerprints, state.calibrator.fingerprint())
        result = {"records": records, "fingerprints": fingerprints, "fits": state.calibrator.fits}
        Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End a spawned rank whose results are written, skipping the interpreter's teardown, where a
    native thread sometimes aborted the process on a loaded machine ("terminate called without an
    active exception", no Python frame; 1-4 runs in 8 while other jobs ran)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_e2e(mix: Mix, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn the ranks; returns each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        store_path = str(Path(tmp) / "store")
        settings = {"steps": args.steps, "device": args.device, "repeats": args.repeats}
        mp.spawn(_worker, args=(args.ranks, store_path, tmp, mix, settings), nprocs=args.ranks, join=True)
        return [json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(args.ranks)]


def _fmt(value: float | None, scale: float = 1000.0) -> str:
    return "n/a" if value is None else f"{scale * value:.1f}"


VARIANTS = ("unbalanced", "balanced", "calibrated", "plan_only")


def e2e_report(results: list[dict[str, Any]], device: str) -> dict[str, float]:
    """Print the per-step tables and the summary; returns the summary ratios."""
    steps = len(results[0]["records"])
    per_step = [[r["records"][s] for r in results] for s in range(steps)]
    clock = "CPU" if device == "cpu" else "wall"
    print(
        f"\nViT forward+backward, {clock} ms per step ({len(results)} ranks, each figure a rank's best of "
        "--repeats runs; max = slowest rank, ideal = mean over ranks unbalanced; plan only = the balanced "
        "batch encoded with no exchange; c = calibrated with a fitted model):"
    )
    print(
        f"  {'step':>4} {'moved':>5} {'floor':>5} | {'unbal max':>9} {'ideal':>7} {'/ideal':>6} | "
        f"{'bal max':>8} "
        f"{'/ideal':>6} | {'calib max':>9} {'/ideal':>6} | {'plan only':>9} {'/ideal':>6}"
    )
    ratios: dict[str, list[tuple[float, float]]] = {key: [] for key in (*VARIANTS, "floor", "bound")}
    for s, recs in enumerate(per_step):
        ideal = statistics.fmean(r["unbalanced"] for r in recs)
        worst = {key: max(r[key] for r in recs) for key in VARIANTS}
        if s >= WARMUP_STEPS:
            for key, value in worst.items():
                ratios[key].append((value, ideal))
            for key in ("floor", "bound"):
                ratios[key].append((recs[0][key] * ideal, ideal))
        cells = " | ".join(
            f"{1000 * worst[k]:>{w}.1f} {worst[k] / ideal:>6.2f}" for k, w in zip(VARIANTS[1:], (8, 9, 9))
        )
        moved = sum(r["moved_images"] for r in recs)
        unbalanced = (
            f"{1000 * worst['unbalanced']:>9.1f} {1000 * ideal:>7.1f} {worst['unbalanced'] / ideal:>6.2f}"
        )
        mark = "*" if s < WARMUP_STEPS else "c" if recs[0]["calibrated_fitted"] else " "
        print(f" {mark}{s:>4} {moved:>5} {recs[0]['floor']:>5.2f} | {unbalanced} | {cells}")
    print(
        "  (* warm-up, left out of the summary; moved = images encoded away from home, all ranks;\n"
        "   floor = the plan's makespan / mean load in cost units)"
    )
    overhead = _overhead_table(per_step)
    fitted = [s - WARMUP_STEPS for s in range(WARMUP_STEPS, steps) if per_step[s][0]["calibrated_fitted"]]
    summary = {f"{key}/ideal": _ratio(pairs) for key, pairs in ratios.items()}
    summary.update({f"{key}/ideal median": _ratio(pairs, median=True) for key, pairs in ratios.items()})
    for key in ("balanced", "calibrated"):
        summary[f"{key}/ideal fitted steps"] = (
            _ratio([ratios[key][k] for k in fitted]) if fitted else math.nan
        )
    _print_summary(summary, results, per_step, overhead, cpu=device == "cpu")
    return summary


def _ratio(pairs: Sequence[tuple[float, float]], median: bool = False) -> float:
    """Sum of times over sum of ideals, or the median per-step ratio."""
    if median:
        return statistics.median(value / ideal for value, ideal in pairs)
    return math.fsum(v for v, _ in pairs) / math.fsum(i for _, i in pairs)


def _print_summary(
    summary: dict[str, float],
    results: list[dict[str, Any]],
    per_step: list[list[dict[str, Any]]],
    overhead: dict[str, float],
    cpu: bool,
) -> None:
    steps = len(per_step)
    same_fit = all(f == results[0]["fingerprints"][0] for f in results[0]["fingerprints"])
    loss_diff = max(r["loss_diff"] for recs in per_step for r in recs)
    mismatch = sum(r["plan_mismatch"] for recs in per_step for r in recs)
    print(
        f"\nSummary, steps {WARMUP_STEPS}..{steps - 1} (sum of the slowest rank's time / sum of the ideal):"
    )
    for key in ("unbalanced", "balanced"):
        median = summary[f"{key}/ideal median"]
        print(f"  {key}/ideal = {summary[key + '/ideal']:.2f} (median per step {median:.2f})")
    floor, only, balanced = summary["floor/ideal"], summary["plan_only/ideal"], summary["balanced/ideal"]
    print(
        f"    = floor {floor:.2f} (whole images and skip rules, in cost units; "
        f"{summary['bound/ideal']:.2f} from images above the mean alone)\n"
        f"      x plan only/floor {only / floor:.2f} (cost model error and noise; plan only/ideal "
        f"{only:.2f})\n"
        f"      x balanced/plan only {balanced / only:.2f} (exchange and host work)"
    )
    print(
        f"  calibrated/ideal = {summary['calibrated/ideal fitted steps']:.2f} against balanced/ideal = "
        f"{summary['balanced/ideal fitted steps']:.2f} over the steps marked c (CostCalibrator fitted "
        f"online, {results[0]['fits']} fits, identical coefficients on every rank: {same_fit})"
    )
    cpu_overhead = [r["call_cpu"] - r["encode_cpu"] for recs in per_step[WARMUP_STEPS:] for r in recs]
    encode_cpu = [r["encode_cpu"] for recs in per_step[WARMUP_STEPS:] for r in recs]
    if cpu:  # process CPU time says nothing about GPU kernels
        print(
            f"  balanced forward call, CPU outside the encode (gather, plan, trips, packing; gloo threads "
            f"included): median {1000 * statistics.median(cpu_overhead):.1f} ms per rank and call, next "
            f"to {1000 * statistics.median(encode_cpu):.1f} ms encoding"
        )
    print(
        "  balanced forward call, median wall ms on the critical rank: "
        + ", ".join(f"{name} {value:.1f}" for name, value in overhead.items())
    )
    if "gather" in overhead and "plan" in overhead:
        calls = [max(r["call_wall"] for r in recs) for recs in per_step[WARMUP_STEPS:]]
        ahead = overhead["gather"] + overhead["plan"]
        share = 100 * ahead / (1000 * statistics.median(calls))
        print(
            f"  gather + plan = {ahead:.1f} ms, {share:.1f}% of the "
            "balanced forward call: what plan_ahead moves before the forward, and the most that planning "
            "the next step on a background thread could hide"
        )
    print(
        f"  max |loss balanced - loss unbalanced| = {loss_diff:.1e}; local plan replay mismatches: {mismatch}"
    )


def _overhead_table(per_step: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Wall ms of the balanced forward call's pieces on the critical rank (the longest encode: it
    waits least in the return trip), raw trips next to them; returns the medians after warm-up."""
    print(
        "\nBalanced forward call, wall ms on the critical rank (longest encode); raw = all_to_all_single "
        "of the same bytes (mean over ranks)"
    )
    names = ("gather", "plan", "fwd trip", "encode", "status", "ret trip", "rest", "call")
    names += ("raw fwd", "raw ret")
    print("  step " + " ".join(f"{n:>8}" for n in names))
    rows = []
    for s, recs in enumerate(per_step):
        critical = max(recs, key=lambda r: r["stats"]["encode_seconds"])
        st = critical["stats"]
        parts = [st[n] for n in ("gather_seconds", "dispatch_seconds", "combine_seconds")]
        communication = sum(parts) if all(p is not None for p in parts) else st["exchange_seconds"]
        known = [st["plan_seconds"], st["encode_seconds"], communication]
        rest = None if None in known else critical["call_wall"] - sum(known)
        status, ret_trip = st["status_seconds"], st["combine_seconds"]
        if status is not None and ret_trip is not None:
            ret_trip -= status  # combine includes the status gather (older balancers: no status figure)
        row = (
            st["gather_seconds"], st["plan_seconds"], st["dispatch_seconds"], st["encode_seconds"],
            status, ret_trip, rest, critical["call_wall"],
            statistics.fmean(r["raw_forward"] for r in recs), statistics.fmean(r["raw_return"] for r in recs),
        )  # fmt: skip
        print(f"  {s:>4} " + " ".join(f"{_fmt(v):>8}" for v in row))
        rows.append(row)
    print(
        "  status = packing the return buffer, then the status gather after the ViT (it waits for the "
        "slowest ViT); ret trip = the return all_to_all and unpacking\n"
        "  rest = call - plan - encode - (gather + status + trips; the exchange total where the trips are "
        "not reported): host bookkeeping"
    )
    medians = {}
    for k, name in enumerate(names):
        values = [row[k] for row in rows[WARMUP_STEPS:] if row[k] is not None]
        if values and name not in ("encode", "call"):
            medians[name] = 1000 * statistics.median(values)
    return medians


# -- entry point ----------------------------------------------------------------------------------


#: Rank batches the online fit needs before its first fit (``CostCalibrator``'s ``min_rank_steps``).
FIT_FROM_ROWS = inspect.signature(CostCalibrator).parameters["min_rank_steps"].default


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("all", "e2e", "calibration"), default="all")
    parser.add_argument("--steps", type=int, default=16, help="e2e steps (the first 3 are warm-up)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="samples per rank and step (demo: 2)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--calibration-steps", type=int, default=18, help="2/3 fit, 1/3 held out")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per measurement")
    parser.add_argument(
        "--timings-out", type=Path, default=None, help="per-image CSV: patch_count,milliseconds"
    )
    args = parser.parse_args(argv)
    if args.device == "auto":
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks
        args.device = "cuda" if enough else "cpu"
    if args.ranks < 2 or args.steps <= WARMUP_STEPS or args.calibration_steps < 4 or args.repeats < 1:
        parser.error(
            "need --ranks >= 2, --steps > 3, --calibration-steps >= 4 and --repeats >= 1; got "
            f"{args.ranks}, {args.steps}, {args.calibration_steps} and {args.repeats}"
        )
    fit_rows = 2 * args.calibration_steps // 3 * args.ranks  # rank batches the online fit sees
    if args.mode != "e2e" and fit_rows < FIT_FROM_ROWS:
        parser.error(
            f"--calibration-steps {args.calibration_steps}: its first two thirds give the online fit "
            f"{fit_rows} rank batches at {args.ranks} ranks; it fits from {FIT_FROM_ROWS}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    started = time.perf_counter()
    mix = demo_mix()
    if args.batch_size is not None:
        mix = dataclasses.replace(mix, batch_size=args.batch_size)
    summary: dict[str, float] = {}
    if args.mode in ("all", "calibration") or args.timings_out is not None:
        data = measure_calibration(mix, args.calibration_steps, args.ranks, args.repeats)
        summary.update(calibration_report(mix, data))
        if args.timings_out is not None:
            write_timings(args.timings_out, data)
            print(f"  per-image timings written to {args.timings_out}")
    if args.mode in ("all", "e2e"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        summary.update(e2e_report(run_e2e(mix, args), args.device))
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
