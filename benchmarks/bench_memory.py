"""Peak tensor memory per rank of one ViT forward and backward, without and with balancing.

``make bench-memory`` spawns 2 gloo ranks on CPU (file-store rendezvous, one thread each) that
draw their batches as ``bench_e2e.py`` does (the demo's tower, config and
:class:`SyntheticVLMDataset` batches, split as ``DistributedSampler(shuffle=False)`` splits them)
and run, per step and on the same batch, with gradients cleared before each:

* *unbalanced*: ``vit(pixel_values, grid_thw)``;
* *balanced*: ``ViTBalancer(config)(vit, pixel_values, grid_thw)`` with the demo's config;
* *overlap*: the same with ``overlap_pixel_trip=True``;
* *prepared*: ``ticket = balancer.prepare(...)`` before the measurement, then
  ``balancer(vit, pixel_values, grid_thw, prepared=ticket)``;
* *plan_only*: the ViT alone on the balanced batch the plan gives this rank, made before the
  measurement, with no exchange: the floor balancing would reach without any buffer of its own.

**Method**: ``torch.profiler`` with ``profile_memory=True`` around the forward, the loss and the
backward. The CPU allocator's allocations and frees, read from the profiler's event tree in time
order, give the running total of tensor bytes allocated inside the step; its peak is the figure.
Tensors alive before the step (the input pixels, plan_only's balanced batch, the parameters) are the
baseline and not counted. The profiler does not see a free made on another thread, and gloo's
worker thread sometimes drops the last reference to a collective's buffers, so the ranks make the
main thread drop it (``_main_thread_frees``). The method is checked first on cases with known
answers (``--validate`` stops there).

Printed: each rank's peak per step, the max over ranks (what decides an out-of-memory error) and
its ratio to unbalanced; the mean over steps of that max; the balancer's own extra on each rank
(a balanced variant's peak minus plan_only's, mean over steps); and the largest relative
difference of a balanced variant's loss from the unbalanced loss (the same images: 0 expected).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_e2e import Mix, _balanced_batch, demo_mix, exit_without_teardown, make_tower, rank_batch, vit_loss
from tiny_vlm import SyntheticVLMDataset

# The allocator's frees are only in the profiler's event tree (function_events lists allocations
# alone), and its event types are only exported from this private module.
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_vit_balance import ViTBalancer

MIB = 1024 * 1024
VARIANTS = ("unbalanced", "balanced", "overlap", "prepared", "plan_only")
BALANCED = ("balanced", "overlap", "prepared")
BACKWARD_MARK = "bench_memory.backward"
TOLERANCE_MIB = 0.1  # validation: the profiler's own bookkeeping allocates nothing this large


# -- the method -----------------------------------------------------------------------------------


def memory_timeline(prof: profile) -> dict[str, float]:
    """Running total of CPU tensor bytes allocated inside a profile, from its allocation events.

    Args:
        prof: A finished ``torch.profiler.profile`` run with ``profile_memory=True``.

    Returns:
        MiB above the start: ``peak``, ``peak_forward`` (before the :data:`BACKWARD_MARK` range),
        ``at_backward`` (when it starts) and ``end``.
    """
    events: list[tuple[int, int]] = []
    backward_start: int | None = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.alloc_size))  # a free is < 0
        elif event.tag == _EventType.TorchOp and event.name == BACKWARD_MARK:
            backward_start = event.start_time_ns
        stack.extend(event.children)
    events.sort(key=lambda e: e[0])
    total = peak = peak_forward = 0
    at_backward = None
    for started, size in events:
        if backward_start is not None and started >= backward_start and at_backward is None:
            at_backward = total
        total += size
        peak = max(peak, total)
        if backward_start is None or started < backward_start:
            peak_forward = max(peak_forward, total)
    at_backward = total if at_backward is None else at_backward
    return {
        "peak": peak / MIB,
        "peak_forward": peak_forward / MIB,
        "at_backward": at_backward / MIB,
        "end": total / MIB,
    }


def measure(fn: Callable[[], Any]) -> dict[str, float]:
    """:func:`memory_timeline` of one call of ``fn``; garbage of earlier steps is collected first,
    so that a cyclic collection inside the step frees none of it."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    return memory_timeline(prof)


def _free_on_other_thread() -> None:
    """Allocate 100 MiB, free it on another thread, then allocate and free 100 MiB."""
    box = {"x": torch.empty(100 * MIB // 4)}
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    y = torch.empty(100 * MIB // 4)
    del y


def _two_alive() -> None:
    """Two 100 MiB tensors alive at once, never three."""
    a = torch.ones(100 * MIB // 4)
    b = a * 2
    del a
    c = b + 1
    del b, c


def _relu_matmul() -> None:
    """A small autograd graph whose forward and backward peaks are known."""
    w = torch.randn(1024, 1024, requires_grad=True)  # 4 MiB
    x = torch.randn(4096, 1024)  # 16 MiB
    y = (x @ w).relu()  # the product (16, freed after relu) and relu's output (16, saved)
    with record_function(BACKWARD_MARK):
        y.sum().backward()  # the ones (16), relu's gradient (16), then w.grad (4) over x, w, y


def validate() -> bool:
    """Measure cases with known answers; prints one line each.

    Returns:
        Whether every case gave its expected values within :data:`TOLERANCE_MIB`.
    """
    cases: list[tuple[str, Callable[[], Any], dict[str, float]]] = [
        ("100 MiB allocated, freed", lambda: torch.empty(100 * MIB // 4).fill_(1), {"peak": 100, "end": 0}),
        ("b = a*2; del a; c = b+1 (100 MiB each)", _two_alive, {"peak": 200, "end": 0}),
        (
            "relu(x@w) forward+backward, w 4 MiB, x 16 MiB",
            _relu_matmul,
            {"peak_forward": 52, "at_backward": 36, "peak": 56},
        ),
        # The profiler's blind spot, expected as measured: the free on the other thread is missed.
        ("100 MiB freed on another thread, then 100 MiB", _free_on_other_thread, {"peak": 200, "end": 100}),
    ]
    ok = True
    for label, fn, expected in cases:
        got = measure(fn)
        line = ", ".join(f"{key} {got[key]:.2f} (expect {value})" for key, value in expected.items())
        ok &= all(abs(got[key] - value) <= TOLERANCE_MIB for key, value in expected.items())
        print(f"validate: {label}: {line}")
    print("validate: " + ("all as expected" if ok else "MISMATCH: the method does not hold here, stopping"))
    return ok


def _main_thread_frees() -> None:
    """Make the main thread drop the last reference to a finished collective and its buffers.

    gloo's worker thread sometimes still holds the work when ``wait()`` returns; its buffers are
    then freed on that thread, which the profiler misses, and look alive for the rest of the step.
    A short sleep before the main thread drops the work lets the worker let go first. The tensors
    are freed at the same point of the program either way; only the thread changes.
    """
    from lightning_vit_balance import exchange

    def wait(self: exchange.PendingExchange) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            time.sleep(0.005)
            self._work = None
        return self._output

    class WaitedDist:
        """``torch.distributed`` as exchange.py sees it, but a synchronous ``all_to_all_single``
        runs asynchronously and is waited here, so that this thread holds and drops the work."""

        def __getattr__(self, name: str) -> Any:
            return getattr(dist, name)

        @staticmethod
        def all_to_all_single(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            work = dist.all_to_all_single(*args, async_op=True, **kwargs)
            if async_op:
                return work
            work.wait()
            time.sleep(0.005)
            del work
            return None

    exchange.PendingExchange.wait = wait
    exchange.dist = WaitedDist()  # type: ignore[assignment]


# -- the ranks ------------------------------------------------------------------------------------


def _forward_backward(call: Callable[[], Any], losses: dict[str, float], name: str) -> Callable[[], None]:
    """The measured step: ``call``, the loss (kept in ``losses[name]``) and the backward."""

    def run() -> None:
        loss = vit_loss(call())
        losses[name] = float(loss.detach())
        with record_function(BACKWARD_MARK):
            loss.backward()

    return run


def _step(
    tower: torch.nn.Module,
    balancers: dict[str, ViTBalancer],
    dataset: SyntheticVLMDataset,
    mix: Mix,
    step: int,
) -> dict[str, Any]:
    """Every variant's peak on this rank at ``step``, with the batch's sizes and the losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pixels, grid = rank_batch(dataset, step, rank, world, mix.batch_size)
    ticket = balancers["prepared"].prepare(pixels, grid)
    planned, planned_grid = _balanced_batch(dataset, ticket.plan, step, rank, mix, pixels.device)
    calls: dict[str, Callable[[], Any]] = {
        "unbalanced": lambda: tower(pixels, grid),
        "balanced": lambda: balancers["balanced"](tower, pixels, grid),
        "overlap": lambda: balancers["overlap"](tower, pixels, grid),
        "prepared": lambda: balancers["prepared"](tower, pixels, grid, prepared=ticket),
        "plan_only": lambda: tower(planned, planned_grid),
    }
    losses: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for name, call in calls.items():
        tower.zero_grad(set_to_none=True)
        dist.barrier()
        if name == "plan_only" and not len(planned_grid):
            peaks[name] = 0.0  # the plan gives this rank no image: the ViT does not run
            continue
        peaks[name] = measure(_forward_backward(call, losses, name))["peak"]
    stats = balancers["balanced"].last_stats
    return {
        "rows": int(pixels.shape[0]),
        "balanced_rows": int(planned.shape[0]),
        "peaks": peaks,
        "losses": losses,
        "sent": stats.bytes_sent / MIB,
        "received": stats.bytes_received / MIB,
        "applied": bool(stats.applied),
    }


def _worker(rank: int, world: int, store_path: str, out_dir: str, mix: Mix, steps: int) -> None:
    """One rank: every step's records, written to ``out_dir/rank_{rank}.json``."""
    torch.set_num_threads(1)  # one core per rank: ranks must not steal each other's cores
    _main_thread_frees()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        tower = make_tower(mix, torch.device("cpu"))
        dataset = SyntheticVLMDataset(
            (steps + 1) * world * mix.batch_size, patch_dim=tower.patch_dim, scale=mix.scale, seed=mix.seed
        )
        balancers = {
            "balanced": ViTBalancer(mix.config),
            "overlap": ViTBalancer(dataclasses.replace(mix.config, overlap_pixel_trip=True)),
            "prepared": ViTBalancer(mix.config),
        }
        records = [_step(tower, balancers, dataset, mix, step) for step in range(steps)]
        Path(out_dir, f"rank_{rank}.json").write_text(json.dumps(records))
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


def run_ranks(mix: Mix, ranks: int, steps: int) -> list[list[dict[str, Any]]]:
    """Spawn the ranks; returns each rank's records, one per step."""
    with tempfile.TemporaryDirectory() as tmp:
        store_path = str(Path(tmp) / "store")
        mp.spawn(_worker, args=(ranks, store_path, tmp, mix, steps), nprocs=ranks, join=True)
        return [json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(ranks)]


# -- the report -----------------------------------------------------------------------------------


def peak_table(results: list[list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Print each rank's peak per step, the max over ranks and its ratio to unbalanced.

    Returns:
        Each variant's max-over-ranks peak per step (MiB).
    """
    print("\nPeak MiB of tensors allocated inside one forward+backward, above the step's start;")
    print("per step each rank, then the max over ranks and its ratio to unbalanced")
    print(
        f"{'step':>4} {'rank':>4} {'rows':>6} {'bal.rows':>8} "
        + " ".join(f"{v:>10}" for v in VARIANTS)
        + f" {'moved MiB sent/recv':>20}"
    )
    maxima: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step in range(len(results[0])):
        records = [per_rank[step] for per_rank in results]
        for rank, r in enumerate(records):
            peaks = " ".join(f"{r['peaks'][v]:>10.2f}" for v in VARIANTS)
            moved = f"{r['sent']:.2f}/{r['received']:.2f}"
            print(f"{step:>4} {rank:>4} {r['rows']:>6} {r['balanced_rows']:>8} {peaks} {moved:>20}")
        top = {v: max(r["peaks"][v] for r in records) for v in VARIANTS}
        applied = "applied" if records[0]["applied"] else "not applied"
        print(
            f"{step:>4} {'max':>4} {'':>15} "
            + " ".join(f"{top[v]:>10.2f}" for v in VARIANTS)
            + f" {applied:>20}"
        )
        print(
            f"{'':>4} {'/unb':>4} {'':>15} "
            + " ".join(f"{top[v] / top['unbalanced']:>10.3f}" for v in VARIANTS)
        )
        for v in VARIANTS:
            maxima[v].append(top[v])
    return maxima


def summary(results: list[list[dict[str, Any]]], maxima: dict[str, list[float]]) -> dict[str, float]:
    """Print the mean max-over-ranks peaks, the balancer's extra per rank and the loss check.

    Returns:
        The printed figures, by name.
    """
    figures: dict[str, float] = {}
    unbalanced = statistics.fmean(maxima["unbalanced"])
    print("\nMean over steps of the max-over-ranks peak (MiB) and its ratio to unbalanced:")
    for v in VARIANTS:
        figures[f"{v} mean max peak"] = mean = statistics.fmean(maxima[v])
        figures[f"{v} ratio"] = mean / unbalanced
        print(f"  {v:<11} {mean:8.2f}  x{mean / unbalanced:.3f}")
    print("\nThe balancer's own extra: a variant's peak minus plan_only's, same rank (MiB, mean over steps)")
    print(f"{'rank':>6} " + " ".join(f"{v:>10}" for v in BALANCED))
    for rank, records in enumerate(results):
        extra = {
            v: statistics.fmean(r["peaks"][v] - r["peaks"]["plan_only"] for r in records) for v in BALANCED
        }
        figures.update({f"{v} extra rank {rank}": extra[v] for v in BALANCED})
        print(f"{rank:>6} " + " ".join(f"{extra[v]:>10.2f}" for v in BALANCED))
    figures["loss difference"] = worst = max(
        abs(r["losses"][v] - r["losses"]["unbalanced"]) / max(1.0, abs(r["losses"]["unbalanced"]))
        for records in results
        for r in records
        for v in BALANCED
    )
    print(f"\nLosses: max relative |variant - unbalanced| over ranks, steps, balanced variants = {worst:.2e}")
    return figures


# -- entry point ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--validate`` only checks the method."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="samples per rank and step (demo: 2)")
    parser.add_argument("--validate", action="store_true", help="only check the method")
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.steps < 1:
        parser.error("need --ranks >= 2 and --steps >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Validate the method, run the ranks, print the tables; returns the summary figures."""
    args = parse_args(argv)
    started = time.perf_counter()
    if not validate():
        sys.exit(1)
    if args.validate:
        return {}
    mix = demo_mix()
    if args.batch_size is not None:
        mix = dataclasses.replace(mix, batch_size=args.batch_size)
    print(
        f"\ntower {mix.tower_kwargs}\nscale {mix.scale}, {mix.batch_size} samples a rank, {args.ranks} ranks"
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_ranks(mix, args.ranks, args.steps)
    figures = summary(results, peak_table(results))
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)")
    return figures


if __name__ == "__main__":
    main()
