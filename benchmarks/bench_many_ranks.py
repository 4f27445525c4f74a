"""The balancer on many ranks: its host gathers, and its host work per call.

``make bench-ranks`` prints five tables.

**gathers**: spawns ``P`` gloo ranks on CPU (file-store rendezvous, no ports) for each ``P`` asked
for, and times the two gathers every balanced call makes on host rows (on a gloo group, or an NCCL
group's gloo twin): the metadata row (header, fingerprint and ``GATHER_CAPACITY`` runs of grid rows,
int64) and the status word (``exchange.STATUS_WORD``: eight int64). Each is gathered both ways
through ``exchange.start_row_gather``, the two ways alternating round by round:

* ``ring``: one ``dist.all_gather`` (gloo's ring: ``P - 1`` hops, each waiting for the one before);
* ``doubling``: Bruck's rounds of point-to-point messages (``ceil(log2 P)`` rounds).

Figures are wall time per gather on rank 0 (latency is the point, not CPU), the best of the rounds.
On a machine with fewer cores than ranks the processes also wait for a core, which hits the ring's
``P*(P-1)`` hops harder than the doubling rounds' ``P*log2(P)`` messages; on a cluster every rank
has its own cores and the hops' network latency is what adds up (see BENCHMARKS.md).

**host work**: what one rank's balanced call computes on the host from the gathered metadata at
``P`` = 64-1024 ranks, in one process (no communication; rows as the gather delivers them): reading
every rank's metadata row, the input and settings check, the plan (next to a plain heap LPT on the
same batch, its floor), this rank's route and the two trips' layouts (the return layout's codec
pieces included). Process CPU time, median
over repeats, 1-8 images per rank (photos and documents, one in five a 4-step video).

**return trip**: the return buffer's codec on one rank at ``P`` = 8-512, in one process (no
communication): packing the token outputs of the images this rank encoded for others
(``wire.pack_return``), reading this rank's own back in their order (``wire.unpack_return``) and
both backward, four token outputs of one float32 value per row (so that the figures are the host
work, not the copies; one thread). Two ranks of each batch: the one
with the most runs of rows to put back in order (images sent to several ranks, alternately) and
the one encoding for the most home ranks. ``pieces`` is the layout's codec pieces, made once per
plan (in ``prepare()`` when the plan is made ahead); the floor is four copies of the buffer (a
packing, an unpacking and each backward must each write every value once). Process CPU time,
median over repeats. Batches: ``photos`` (1-8 images per rank, as above) and ``many small``
(64-256 images of 64-1,024 patches per rank).

**calibration**: what ``calibrate_cost=True`` adds to a call at ``P`` = 8-1024 ranks, in one
process: ``CostCalibrator.observe`` of one step of every rank's patch counts and measured time,
once its window holds 32 steps (it refits at every call): times as a cost model says, each off
by a random 5% as measured times are (the outlier pass then drops a few rows and fits again),
and with one rank in twenty 20x slow too. Process CPU time, median of the calls.

**garbage collector**: the same host work, called again and again in a process holding a training
job's heap of long-lived Python objects (a ballast of small dicts), with the rest of each step
allocating too, once with Python's cyclic collector running through the call and once paused for
it, as the balancer pauses it (``balancer._collector_paused``). Wall time per call (mean, 99th
percentile, worst), the full collections that ran inside the calls, and the whole loop per step
(the rest of the step and the collections that ran there included).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_planning import heap_lpt

from lightning_vit_balance import CostCalibrator, ViTBalanceConfig, exchange, plan_rebalance
from lightning_vit_balance.balancer import _collector_paused
from lightning_vit_balance.encoding import raise_for_input
from lightning_vit_balance.exchange import (
    ExchangeRoute,
    PixelTrip,
    RankMetadata,
    ReturnLayout,
    grid_runs,
    metadata_of_rows,
    metadata_row,
)
from lightning_vit_balance.problems import MAX_DETAILS, InputProblem
from lightning_vit_balance.wire import pack_return, unpack_return

#: int64 values in a balanced call's metadata row: the header (6), the details (4), the
#: fingerprint (the settings' values, then the call's gather kind, cost fit and merge size) and
#: four per run of grid rows.
METADATA_VALUES = 6 + MAX_DETAILS + len(ViTBalanceConfig().fingerprint()) + 3 + 4 * exchange.GATHER_CAPACITY
STATUS_VALUES = len(exchange.STATUS_WORD)
#: Both ways, each alternately, this many rounds; each round times ``calls`` gathers.
ROUNDS = 3


def _time_gathers(row: torch.Tensor, doubling: bool, calls: int) -> float:
    """Seconds per gather of ``row`` on this rank, ``calls`` gathers between two barriers."""
    exchange.DOUBLING_FROM_RANKS = 1 if doubling else sys.maxsize
    dist.barrier()
    started = time.perf_counter()
    for _ in range(calls):
        exchange.start_row_gather(row, None).wait()
    elapsed = time.perf_counter() - started
    dist.barrier()
    return elapsed / calls


def _worker(rank: int, world: int, store: str, calls: int, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    best: dict[tuple[str, str], float] = {}
    rows = {
        "metadata": torch.arange(METADATA_VALUES, dtype=torch.int64) + rank,
        "status": torch.full((STATUS_VALUES,), rank, dtype=torch.int64),
    }
    for name, row in rows.items():
        ring = exchange.start_row_gather(row, None)  # warm up both ways; check they agree
        exchange.DOUBLING_FROM_RANKS = 1
        assert torch.equal(ring.wait(), exchange.start_row_gather(row, None).wait())
        for _ in range(ROUNDS):
            for way in ("ring", "doubling"):
                seconds = _time_gathers(row, way == "doubling", calls)
                best[name, way] = min(best.get((name, way), float("inf")), seconds)
    if rank == 0:
        results.put(best)
    dist.destroy_process_group()


def measure(world: int, calls: int) -> dict[tuple[str, str], float]:
    """Best seconds per gather on rank 0 of ``world`` spawned gloo ranks, per (row, way)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            context.Process(target=_worker, args=(rank, world, store, calls, results))
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        best = results.get(timeout=900)
        for proc in procs:
            proc.join(timeout=60)
    return best


def _gathered_rows(num_ranks: int, config: ViTBalanceConfig, seed: int) -> np.ndarray:
    """Every rank's metadata row as the gather delivers it: ``[P, header + fingerprint + 4 *
    capacity]``."""
    rng = np.random.default_rng(seed)
    fingerprint = tuple(value for _, value in config.fingerprint())
    rows = []
    for _ in range(num_ranks):
        grids = []
        for _ in range(int(rng.integers(1, 9))):
            side = 2 * int(rng.integers(4, 64 if rng.random() < 0.8 else 96))  # photos, documents
            grids.append((4 if rng.random() < 0.2 else 1, side, 2 * int(rng.integers(4, 64))))
        local = RankMetadata(InputProblem.OK, (), 1176, 0, False, tuple(grids), fingerprint)
        rows.append(metadata_row(local, grid_runs(local.grids), exchange.GATHER_CAPACITY))
    return torch.stack(rows).numpy()


def _host_work(gathered: np.ndarray, config: ViTBalanceConfig) -> dict[str, Callable[[], Any]]:
    """The host steps of rank 0's balanced call, each as a call that redoes the steps before it
    (so no cached value of a plan carries over between timed calls)."""
    names = [name for name, _ in config.fingerprint()]
    grids_at = gathered.shape[1] - 4 * exchange.GATHER_CAPACITY
    metadata = metadata_of_rows(gathered[:, :grids_at], gathered[:, grids_at:])
    counts = [list(m.patch_counts) for m in metadata]
    frames = [[t for t, _, _ in m.grids] for m in metadata]

    def plan() -> Any:
        return plan_rebalance(counts, config, frames=frames)

    def layouts() -> None:
        fresh = plan()
        route = ExchangeRoute.from_plan(fresh, 0)
        PixelTrip.from_route(route, metadata[0].patch_counts)
        layout = ReturnLayout.from_route(fresh, route, ["merged"], 2, [2048])
        _ = layout.send_pieces, layout.receive_pieces

    return {
        "read rows": lambda: metadata_of_rows(gathered[:, :grids_at], gathered[:, grids_at:]),
        "check": lambda: raise_for_input(metadata, names),
        "plan": plan,
        "heap LPT": lambda: heap_lpt(counts),
        "plan + layouts": layouts,
    }


def _cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return 1e3 * statistics.median(times)


def host_work_table(sizes: list[int], repeats: int) -> None:
    """The ``host work`` table (see the module docstring)."""
    config = ViTBalanceConfig()
    print(f"\nHost work of one balanced call on rank 0 (CPU ms, median of {repeats}; no communication;")
    print("layouts = this rank's route, pixel trip and return layout, after a fresh plan)")
    columns = ["read rows", "check", "plan", "heap LPT", "plan + layouts"]
    print(f"{'P':>5} | " + " ".join(f"{c:>14}" for c in columns) + f" | {'all but LPT':>11}")
    for num_ranks in sizes:
        steps = _host_work(_gathered_rows(num_ranks, config, seed=num_ranks), config)
        ms = {name: _cpu_ms(fn, repeats) for name, fn in steps.items()}
        total = ms["read rows"] + ms["check"] + ms["plan + layouts"]
        print(f"{num_ranks:>5} | " + " ".join(f"{ms[c]:>14.2f}" for c in columns) + f" | {total:>11.2f}")


def _calibration_steps(
    num_ranks: int, outliers: bool, steps: int
) -> list[tuple[list[list[int]], list[float]]]:
    """Random steps of 1-8 images per rank and their ranks' times (ms) under a known model, each
    off by a random 5% (``outliers``: and one rank in twenty 20x slow)."""
    rng = np.random.default_rng(num_ranks)
    out = []
    for _ in range(steps):
        counts = [rng.integers(16, 4000, int(rng.integers(1, 9))).tolist() for _ in range(num_ranks)]
        ms = [1.0 + sum(1e-6 * n * n + 1e-3 * n for n in c) for c in counts]
        slow = rng.random(num_ranks) < (0.05 if outliers else 0.0)
        out.append((counts, [t * (20.0 if s else float(rng.lognormal(0.0, 0.05))) for t, s in zip(ms, slow)]))
    return out


def _observe_ms(num_ranks: int, outliers: bool, calls: int) -> float:
    calibrator = CostCalibrator()
    steps = _calibration_steps(num_ranks, outliers, 34 + calls)
    for counts, times in steps[:34]:  # warm-up and a full window
        calibrator.observe(counts, times)
    rest = iter(steps[34:])
    return _cpu_ms(lambda: calibrator.observe(*next(rest)), calls)


def calibration_table(sizes: list[int], calls: int) -> None:
    """The ``calibration`` table (see the module docstring)."""
    print(f"\nCostCalibrator.observe per call, window full (32 steps; CPU ms, median of {calls} calls)")
    print(f"{'P':>5} | {'5% noise':>11} {'+ 20x slow':>11}")
    for num_ranks in sizes:
        ms = [_observe_ms(num_ranks, outliers, calls) for outliers in (False, True)]
        print(f"{num_ranks:>5} | {ms[0]:>11.2f} {ms[1]:>11.2f}")


def _many_small_counts(num_ranks: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [
        [4 * int(rng.integers(4, 16)) * int(rng.integers(4, 16)) for _ in range(int(rng.integers(64, 257)))]
        for _ in range(num_ranks)
    ]


def _trip_counts(batch: str, num_ranks: int, config: ViTBalanceConfig) -> list[list[int]]:
    if batch == "many small":
        return _many_small_counts(num_ranks, seed=num_ranks)
    gathered = _gathered_rows(num_ranks, config, seed=num_ranks)
    grids_at = gathered.shape[1] - 4 * exchange.GATHER_CAPACITY
    return [list(m.patch_counts) for m in metadata_of_rows(gathered[:, :grids_at], gathered[:, grids_at:])]


def _codec_steps(plan: Any, rank: int, outputs: int, width: int) -> dict[str, Callable[[], Any]]:
    """Rank ``rank``'s return-trip codec under ``plan``, each step a call (the layout made once)."""
    kinds = ["merged"] * outputs
    layout = ReturnLayout.from_plan(plan, rank, kinds, 2, [width] * outputs)
    rows = sum(plan.receive_patches(rank)) // 4
    leaves = [torch.randn(rows, width, requires_grad=True) for _ in range(outputs)]
    back = torch.randn(sum(layout.receive_splits), requires_grad=True)
    likes = [torch.empty(0, width)] * outputs
    buffer = pack_return(leaves, layout, torch.float32)
    returned = unpack_return(back, likes, layout, [width] * outputs)
    upstream = [torch.ones_like(out) for out in returned]

    def pieces() -> None:
        fresh = ReturnLayout.from_plan(plan, rank, kinds, 2, [width] * outputs)
        _ = fresh.send_pieces, fresh.receive_pieces

    def backward() -> None:
        torch.autograd.grad([buffer, *returned], [*leaves, back], [buffer, *upstream], retain_graph=True)

    def floor() -> None:
        for _ in range(2):
            buffer.detach().clone()
            back.detach().clone()

    return {
        "layout": lambda: ReturnLayout.from_plan(plan, rank, kinds, 2, [width] * outputs),
        "layout + pieces": pieces,
        "pack": lambda: pack_return(leaves, layout, torch.float32),
        "unpack": lambda: unpack_return(back, likes, layout, [width] * outputs),
        "backward": backward,
        "floor": floor,
    }


def return_trip_table(sizes: list[int], repeats: int) -> None:
    """The ``return trip`` table (see the module docstring)."""
    config = ViTBalanceConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"\nReturn trip's codec on one rank (CPU ms, median of {repeats}; 4 outputs x 1 float32, 1 thread;")
    print("pieces = layout + pieces - layout, once per plan; per call = pack + unpack + backward)")
    columns = ["runs", "homes", "layout", "pieces", "pack", "unpack", "backward", "per call", "floor"]
    print(f"{'P':>4} {'batch':>10} {'rank':>5} | " + " ".join(f"{c:>8}" for c in columns))
    for num_ranks in sizes:
        for batch in ("photos", "many small"):
            plan = plan_rebalance(_trip_counts(batch, num_ranks, config), config)
            if not plan.applied:
                continue
            layouts = [ReturnLayout.from_plan(plan, r, ["merged"], 2, [1]) for r in range(num_ranks)]
            runs = [len(lay.restore[0]) if lay.restore is not None else 0 for lay in layouts]
            homes = [sum(1 for ranges in lay.send_rows if ranges[0][1] > ranges[0][0]) for lay in layouts]
            for rank in dict.fromkeys((int(np.argmax(runs)), int(np.argmax(homes)))):
                ms = {name: _cpu_ms(fn, repeats) for name, fn in _codec_steps(plan, rank, 4, 1).items()}
                ms["pieces"] = ms["layout + pieces"] - ms["layout"]
                ms["per call"] = ms["pack"] + ms["unpack"] + ms["backward"]
                cells = [f"{runs[rank]:>8}", f"{homes[rank]:>8}"]
                cells += [f"{ms[c]:>8.3f}" for c in columns[2:]]
                print(f"{num_ranks:>4} {batch:>10} {rank:>5} | " + " ".join(cells), flush=True)
    torch.set_num_threads(threads)


def _under_collector(work: Callable[[], Any], calls: int) -> dict[str, float]:
    """``calls`` calls of ``work``, each followed by the rest of a step's allocations: wall ms per
    call (mean, p99, max), full collections inside the calls, and ms per step for the whole loop."""
    full = {"inside": 0, "now": 0}

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full["inside"] += full["now"]

    gc.collect()
    gc.callbacks.append(count)
    times = []
    try:
        started = time.perf_counter()
        for _ in range(calls):
            full["now"] = 1
            begun = time.perf_counter()
            work()
            times.append(1e3 * (time.perf_counter() - begun))
            full["now"] = 0
            rest = [{"step": k} for k in range(2000)]  # the step's own objects, freed at its end
            del rest
        loop = 1e3 * (time.perf_counter() - started) / calls
    finally:
        gc.callbacks.remove(count)
    times.sort()
    return {
        "mean": statistics.fmean(times),
        "p99": times[int(0.99 * (len(times) - 1))],
        "max": times[-1],
        "full": full["inside"],
        "loop": loop,
    }


def _one_call(steps: dict[str, Callable[[], Any]]) -> Callable[[], None]:
    """The host work of one balanced call on rank 0, from :func:`_host_work`'s steps."""

    def work() -> None:
        steps["read rows"]()
        steps["check"]()
        steps["plan + layouts"]()

    return work


def gc_table(sizes: list[int], calls: int, ballast: int) -> None:
    """The ``garbage collector`` table (see the module docstring)."""
    config = ViTBalanceConfig()
    heap = [{"kept": k} for k in range(ballast)]  # a training process's long-lived objects
    print(f"\nHost work under Python's garbage collector: {calls} calls, {len(heap):,} long-lived objects")
    print("in the process, 2,000 more allocated by the rest of each step; wall ms per call; full =")
    print("full collections that ran inside the calls; loop = ms per step, the rest of the step included")
    print(f"{'P':>5} | {'collector':>9} | {'mean':>6} {'p99':>6} {'max':>6} | {'full':>4} | {'loop':>6}")
    for num_ranks in sizes:
        work = _one_call(_host_work(_gathered_rows(num_ranks, config, seed=num_ranks), config))
        for name, call in (("running", work), ("paused", _collector_paused(work))):
            row = _under_collector(call, calls)
            print(
                f"{num_ranks:>5} | {name:>9} | {row['mean']:>6.2f} {row['p99']:>6.2f} {row['max']:>6.1f} | "
                f"{row['full']:>4} | {row['loop']:>6.2f}",
                flush=True,
            )
    del heap


def gathers_table(sizes: list[int], calls: int) -> None:
    """The ``gathers`` table (see the module docstring)."""
    print(f"Host row gathers: wall ms per gather on rank 0, best of {ROUNDS} rounds of {calls};")
    print(f"metadata = {METADATA_VALUES} int64 per rank, status = {STATUS_VALUES}; {os.cpu_count()} cores")
    print(
        f"{'P':>4} | {'rounds':>6} | {'metadata: ring':>14} {'doubling':>9} {'ratio':>6} | "
        f"{'status: ring':>12} {'doubling':>9} {'ratio':>6}"
    )
    for world in sizes:
        best = measure(world, calls)
        cells = []
        for name in ("metadata", "status"):
            ring, doubling = best[name, "ring"], best[name, "doubling"]
            width = 14 if name == "metadata" else 12
            cells.append(f"{1e3 * ring:>{width}.2f} {1e3 * doubling:>9.2f} {ring / doubling:>5.2f}x")
        print(f"{world:>4} | {(world - 1).bit_length():>6} | {cells[0]} | {cells[1]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="gathers table")
    parser.add_argument("--calls", type=int, default=20, help="gathers per timed round")
    parser.add_argument("--host-ranks", type=int, nargs="+", default=[64, 256, 1024], help="host work table")
    parser.add_argument("--host-repeats", type=int, default=15, help="host work: timed calls per step")
    parser.add_argument("--trip-ranks", type=int, nargs="+", default=[8, 64, 512], help="return trip table")
    parser.add_argument("--calibration-ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--gc-calls", type=int, default=300, help="garbage collector table: calls per row")
    parser.add_argument("--gc-ballast", type=int, default=1_000_000, help="long-lived objects in the process")
    args = parser.parse_args()
    counts = (args.ranks, args.host_ranks, args.trip_ranks, args.calibration_ranks)
    if min(min(ranks) for ranks in counts) < 2 or min(args.calls, args.host_repeats, args.gc_calls) < 1:
        parser.error(
            "need every rank count >= 2, and --calls, --host-repeats and --gc-calls >= 1; got "
            f"--ranks {args.ranks}, --host-ranks {args.host_ranks}, --trip-ranks {args.trip_ranks}, "
            f"--calibration-ranks {args.calibration_ranks}, {args.calls}, {args.host_repeats} and "
            f"{args.gc_calls}"
        )
    host_work_table(args.host_ranks, args.host_repeats)
    return_trip_table(args.trip_ranks, args.host_repeats)
    calibration_table(args.calibration_ranks, args.host_repeats)
    gc_table(args.host_ranks, args.gc_calls, args.gc_ballast)
    print()
    gathers_table(args.ranks, args.calls)


if __name__ == "__main__":
    main()
