"""The CUDA paths of a balanced call, on the GPU of whatever machine runs them (``make gpu-check``).

Every check also runs on the CPU over the same kind of group, so the checks themselves stay tested
where there is no GPU (CI). On a machine with one, two ranks share ``cuda:0`` over a
``"cpu:gloo,cuda:gloo"`` group: NCCL refuses two ranks on one device, and gloo carries CUDA
tensors through pinned host buffers. That checks everything but NCCL itself: tensors on the
device end to end (the balanced batch, the dummy image of a rank left without images, the return
trip, gradients), the plan made on the host before the forward, the overlapped pixel trip, CUDA
events read a call later, and that the forward never makes the host wait for the device outside
the ViT (CUDA only: it reads CUDA's sync debug mode), and a prepared call's grid values compared
on the device and reported at the next gather (CUDA only; the CPU twin is in ``test_prepared.py``).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import towers
from equivalence import APPLIED_COLLECTIVES, probe_loss, run_cases
from multirank import caught, subgroup

from lightning_vit_balance import ViTBalanceConfig, ViTBalancer

#: Where the checks run: the CPU, and the GPU when the machine has one.
DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
needs_cuda = pytest.mark.skipif("cuda" not in DEVICES, reason="no GPU: run `make gpu-check` on a GPU machine")

#: A group that carries both CPU and CUDA tensors (the pool's default group is plain gloo, which
#: the balancer accepts for CPU tensors only).
BACKEND = "cpu:gloo,cuda:gloo"
POOL = 2
THRESHOLD_0 = {"trigger_threshold": 0.0}

#: Two ranks: a heavy rank beside an empty one, videos with int32 grid rows, no images at all, and
#: pixels that require grad (the forward trip's backward).
CASES: list[dict[str, Any]] = [
    {"grids": [[(1, 8, 8), (1, 8, 8), (1, 4, 4), (2, 4, 4)], []]},
    {"grids": [[(2, 4, 4), (1, 4, 8)], [(3, 6, 6)]], "grid_dtype": "int32"},
    {"grids": [[], []]},
    {"grids": [[(1, 6, 6), (1, 6, 6), (2, 2, 2)], [(1, 2, 2)]], "pixel_grad": True},
]


def _tolerances(device: str, dtype: str) -> dict[str, float] | None:
    """On CUDA, cuBLAS and cuDNN pick kernels by shape, so an image's rows inside a batch of
    another size are summed in another order: float32 results agree to about 1e-6 relative, so
    the bound is 10x the CPU's. An image routed to the wrong rows differs by O(1)."""
    if device != "cuda" or dtype != "float32":
        return None
    return {"rtol": 1e-3, "atol": 1e-4}


def _on_device(device: str) -> Any:
    """In a worker: use the device, and return the group over it."""
    if device == "cuda":
        torch.cuda.set_device(0)
        # TF32 rounds float32 products to 10 mantissa bits, differently per kernel and shape.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return subgroup(POOL, BACKEND)


def _equivalence(device: str, tower: str, dtype: str, config: dict[str, Any], prepared: bool) -> Any:
    group = _on_device(device)
    settings = {**THRESHOLD_0, **config}
    tol = _tolerances(device, dtype)
    return run_cases(
        POOL, tower, CASES, dtype, settings, prepared=prepared, device=device, group=group, tol=tol
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("tower", "dtype", "config", "prepared"),
    [
        ("tensor", "float32", {}, False),
        ("window", "float32", {}, False),
        ("dict", "float32", {}, False),
        ("qwen2_vl", "float32", {}, False),
        ("qwen2_5_vl", "float32", {}, False),
        ("qwen3_vl", "float32", {}, False),
        ("window", "bfloat16", {}, False),
        ("tensor", "float32", {}, True),
        ("dict", "float32", {"overlap_pixel_trip": True}, False),
        ("qwen2_5_vl", "float32", {"overlap_pixel_trip": True}, True),
        ("dict", "float32", {"empty_rank_forward": "no_grad"}, False),
        # Each temporal step of a video an item (the Hugging Face towers attend per step).
        ("qwen3_vl", "float32", {"split_videos": True}, False),
        ("qwen2_5_vl", "float32", {"split_videos": True}, True),
    ],
)
def test_balanced_equals_direct_on_the_device(
    multirank: Any, device: str, tower: str, dtype: str, config: dict[str, Any], prepared: bool
) -> None:
    with multirank(POOL) as w:
        results = w.run(_equivalence, device, tower, dtype, config, prepared)
    for rank_results in results:
        assert rank_results[0]["applied"] and rank_results[0]["moved_images"] > 0, rank_results[0]
        assert not rank_results[2]["applied"], rank_results[2]
        for r in rank_results:
            # Skipped and prepared: nothing, or the status word where no rank has images.
            skipped = int(r["reason"] == "no-images") if prepared else 1
            forward = (APPLIED_COLLECTIVES - prepared) if r["applied"] else skipped
            assert r["collectives"] == forward and r["counted"] == forward, r


def _host_waits_outside_the_vit() -> dict[str, Any]:
    """Warnings of CUDA's sync debug mode during a prepared balanced forward on CUDA, split into
    those the tower's own forward raised and the rest (the balancer's)."""
    group = _on_device("cuda")
    torch.manual_seed(0)
    model = towers.TensorTower().to("cuda")
    tower_forward = model.forward
    caught: list[warnings.WarningMessage] = []
    inside: set[int] = set()  # ids of the warnings raised within the tower's forward

    def counted(pixels: torch.Tensor, grid: torch.Tensor) -> Any:
        before = len(caught)
        output = tower_forward(pixels, grid)
        inside.update(map(id, caught[before:]))
        return output

    model.forward = counted  # type: ignore[method-assign]
    grids = [(1, 8, 8)] * 3 if dist.get_rank() == 0 else [(1, 2, 2)]
    host_pixels, host_grid = towers.make_batch(grids, seed=dist.get_rank())
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), group)
    for audited in (False, True):  # the first call warms the allocators and kernels up
        ticket = balancer.prepare(host_pixels, host_grid, model)
        pixels, grid = host_pixels.to("cuda"), host_grid.to("cuda")
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            caught = records
            inside.clear()
            torch.cuda.set_sync_debug_mode("warn" if audited else 0)
            try:
                output = balancer(model, pixels, grid, prepared=ticket)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        probe_loss(output, seed=1).backward()
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    stats = balancer.last_stats
    assert stats is not None
    return {
        "applied": stats.applied,
        "in_the_tower": sum(id(w) in inside for w in syncs),
        "outside": [f"{w.filename}:{w.lineno}: {w.message}" for w in syncs if id(w) not in inside],
    }


@needs_cuda
def test_a_prepared_forward_never_makes_the_host_wait_outside_the_vit(multirank: Any) -> None:
    with multirank(POOL) as w:
        results = w.run(_host_waits_outside_the_vit)
    for rank, r in enumerate(results):
        assert r["applied"], r
        # The tower's own waits are its business (Hugging Face towers read grid_thw on the host).
        assert not r["outside"], f"rank {rank}: the balancer made the host wait: {r['outside']}"


def _grid_values_on_the_device() -> str:
    """A prepared call whose grid on the GPU holds other values (same rows) than its plan's: the
    comparison runs on the device, its result reaches the host through pinned memory, and the next
    gather raises on every rank."""
    group = _on_device("cuda")
    torch.manual_seed(0)
    model = towers.TensorTower().to("cuda")
    grids = [(1, 8, 8), (1, 8, 8)] if dist.get_rank() == 0 else [(1, 4, 8)]
    host_pixels, host_grid = towers.make_batch(grids, seed=dist.get_rank())
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), group)
    ticket = balancer.prepare(host_pixels, host_grid, model)
    swapped = torch.tensor([[1, 8, 4]]) if dist.get_rank() == 1 else host_grid
    balancer(model, host_pixels.to("cuda"), swapped.to("cuda"), prepared=ticket)
    torch.cuda.synchronize()  # the comparison's event has completed: the next gather reads it
    with caught(ValueError) as outcome:
        balancer.prepare(host_pixels, host_grid, model)
    return outcome.message


@needs_cuda
def test_grid_values_that_differ_on_the_device_fail_every_rank_at_the_next_gather(multirank: Any) -> None:
    with multirank(POOL) as w:
        messages = w.run(_grid_values_on_the_device)
    assert len(set(messages)) == 1, messages
    assert "rank 1: an earlier call given a prepared plan" in messages[0], messages


def _vit_milliseconds(device: str, calls: int) -> dict[str, Any]:
    """Each call's gathered per-rank ViT milliseconds (the previous call's, carried in the
    metadata gather), its trip milliseconds (the previous call's, this rank's) and whether it moved
    images, and the tower's forward timed directly with the host waiting for it."""
    group = _on_device(device)
    torch.manual_seed(0)
    model = towers.TensorTower().to(device)
    grids = [(1, 16, 16), (1, 8, 8)] if dist.get_rank() == 0 else [(1, 2, 2)]
    host_pixels, host_grid = towers.make_batch(grids, seed=dist.get_rank())
    pixels, grid = host_pixels.to(device), host_grid.to(device)
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), group)
    gathered, trips, applied = [], [], []
    for _ in range(calls):
        probe_loss(balancer(model, pixels, grid), seed=2).backward()
        stats = balancer.last_stats
        assert stats is not None
        gathered.append(list(stats.vit_ms))
        trips.append(stats.trip_ms)
        applied.append(stats.applied)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    model(pixels, grid)
    if device == "cuda":
        torch.cuda.synchronize()
    direct_ms = 1000.0 * (time.perf_counter() - start)
    return {"gathered": gathered, "trips": trips, "applied": applied, "direct_ms": direct_ms}


@pytest.mark.parametrize("device", DEVICES)
def test_vit_milliseconds_are_measured_and_gathered(multirank: Any, device: str) -> None:
    calls = 4
    with multirank(POOL) as w:
        results = w.run(_vit_milliseconds, device, calls)
    first, second = results
    assert first["gathered"] == second["gathered"], "every rank must see the same figures"
    gathered = first["gathered"]
    assert gathered[0] == [-1.0] * POOL, f"no figures before the first call: {gathered[0]}"
    # On CUDA a call's events are read at the next call; a pair still running reads as unknown
    # (-1) once, so from the third call on every rank's figure is known.
    for ms in gathered[2:]:
        assert all(0.0 < m < 60_000.0 for m in ms), gathered
    # Of the order of a direct forward: not microseconds of launch, not a stale or summed figure.
    slowest = max(r["direct_ms"] for r in results)
    assert max(max(ms) for ms in gathered[2:]) < 50.0 * slowest + 50.0, (gathered, slowest)
    # Trips: every call that moved images is reported by the next (on CUDA, from the third call
    # on, as above); a call reports -1 when nothing is due.
    for result in results:
        trips, applied = result["trips"], result["applied"]
        assert all(applied), f"every call moves the heavy rank's images: {applied}"
        assert trips[0] == -1.0, trips
        assert all(0.0 < ms < 60_000.0 for ms in trips[2:]), trips
