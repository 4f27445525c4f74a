"""The balancer's host gathers on many ranks: gloo's ring all_gather against doubling rounds.

``make bench-gather`` spawns ``P`` gloo ranks on CPU (file-store rendezvous, no ports) for each
``P`` asked for, and times the two gathers every balanced call makes on host rows (on a gloo
group, or an NCCL group's gloo twin): the metadata row (header, fingerprint and
``GATHER_CAPACITY`` runs of grid rows, int64) and the status word (three int64). Each is gathered
both ways through ``exchange.start_row_gather``, the two ways alternating round by round:

* ``ring``: one ``dist.all_gather`` (gloo's ring: ``P - 1`` hops, each waiting for the one before);
* ``doubling``: Bruck's rounds of point-to-point messages (``ceil(log2 P)`` rounds).

Figures are wall time per gather on rank 0 (latency is the point, not CPU), the best of the rounds.
On a machine with fewer cores than ranks the processes also wait for a core, which hits the ring's
``P*(P-1)`` hops harder than the doubling rounds' ``P*log2(P)`` messages; on a cluster every rank
has its own cores and the hops' network latency is what adds up (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_vit_balance import exchange

#: int64 values in a metadata row: the header (6), the details (4), a fingerprint of about 8 and
#: four per run of grid rows.
METADATA_VALUES = 18 + 4 * exchange.GATHER_CAPACITY
STATUS_VALUES = 3
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--calls", type=int, default=20, help="gathers per timed round")
    args = parser.parse_args()
    print(f"Host row gathers: wall ms per gather on rank 0, best of {ROUNDS} rounds of {args.calls};")
    print(
        f"metadata = {METADATA_VALUES} int64 per rank, status = {STATUS_VALUES}; {os.cpu_count()} cores here"
    )
    print(
        f"{'P':>4} | {'rounds':>6} | {'metadata: ring':>14} {'doubling':>9} {'ratio':>6} | "
        f"{'status: ring':>12} {'doubling':>9} {'ratio':>6}"
    )
    for world in args.ranks:
        best = measure(world, args.calls)
        cells = []
        for name in ("metadata", "status"):
            ring, doubling = best[name, "ring"], best[name, "doubling"]
            width = 14 if name == "metadata" else 12
            cells.append(f"{1e3 * ring:>{width}.2f} {1e3 * doubling:>9.2f} {ring / doubling:>5.2f}x")
        print(f"{world:>4} | {(world - 1).bit_length():>6} | {cells[0]} | {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
