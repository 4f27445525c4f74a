"""Balanced-vs-direct equivalence checks, run inside multi-rank workers (see multirank.py).

:func:`run_cases` builds a tower (same seed on every rank, so the same weights), then for each
case: each rank encodes its own images directly (the reference) and through
:class:`~lightning_vit_balance.ViTBalancer`, backpropagates the same probe loss through both, and
compares outputs on its own rank and parameter gradients summed over all ranks (what DDP's
all-reduce sees). It raises AssertionError naming the case on a mismatch and returns each case's
stats for further checks by the calling test.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple
from unittest import mock

import torch
import torch.distributed as dist
import towers
from multirank import subgroup

from lightning_vit_balance import ViTBalanceConfig, ViTBalancer
from lightning_vit_balance.exchange import ExchangeRoute, PixelTrip, ReturnLayout
from lightning_vit_balance.outputs import flatten_output

__all__ = [
    "APPLIED_COLLECTIVES",
    "TOWERS",
    "CollectiveCounter",
    "CompiledSources",
    "measured_around_an_evaluation",
    "probe_loss",
    "run_cases",
    "summed_grads",
    "tolerances",
]

#: Collectives of an applied balanced call in the forward pass: the metadata gather, the pixel trip,
#: the status gather after the ViT and the return trip. A skipped call makes the gather alone.
APPLIED_COLLECTIVES = 4

TOWERS: dict[str, Callable[[], torch.nn.Module]] = {
    "tensor": towers.TensorTower,
    "window": towers.WindowTower,
    "dict": towers.DictTower,
    "global": towers.GlobalTokenTower,
    "per_image": towers.PerImageTower,
    "qwen2_vl": towers.qwen2_vl_tower,
    "qwen2_5_vl": towers.qwen2_5_vl_tower,
    "qwen3_vl": towers.qwen3_vl_tower,
}

_MODELS: dict[tuple[str, str], torch.nn.Module] = {}

_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)


class CollectiveCounter:
    """Counts calls to torch.distributed collectives while active (independent of BalanceStats)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[CollectiveCounter]:
        originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return fn(*args, **kwargs)

            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances of balanced vs direct results.

    An image's rows are computed by the same ops in both runs, but inside batches of different
    sizes, so matmul blocking and the order of the gradient sums over images differ: fp32 results
    agree to a few float32 ulps (scaled by the magnitudes summed), bf16 ones to a couple of bf16
    ulps (2**-8 relative).
    """
    if dtype == torch.bfloat16:
        return {"rtol": 2e-2, "atol": 2e-2}
    return {"rtol": 1e-4, "atol": 1e-5}


def _model(name: str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    key = (name, str(dtype), device)
    if key not in _MODELS:
        torch.manual_seed(0)
        _MODELS[key] = TOWERS[name]().to(dtype=dtype, device=device)
    return _MODELS[key]


def measured_around_an_evaluation(
    training: ViTBalanceConfig, num_ranks: int, step: Callable[[int, ViTBalanceConfig, bool], Sequence[float]]
) -> str:
    """3 training steps with ``training``, 2 evaluation steps with a configuration of their own, 3
    training steps with ``training`` again; ``step(index, config, training)`` sets ``config``, runs
    one step (gradients on in training) and returns its stats' ``vit_ms``. Per step ``T`` or ``V``,
    and 1 where every one of ``num_ranks`` ranks reported a measured ViT time."""
    evaluation = dataclasses.replace(training, min_gain=1e-3)
    marks = []
    for index, config in enumerate([training] * 3 + [evaluation] * 2 + [training] * 3):
        in_training = config is training
        with torch.set_grad_enabled(in_training):
            vit_ms = step(index, config, in_training)
        marks.append(("T" if in_training else "V") + str(int(len(vit_ms) == num_ranks and min(vit_ms) >= 0)))
    return " ".join(marks)


def probe_loss(output: Any, seed: int, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """A fixed random linear function of every floating output (zero-row outputs included)."""
    leaves, _ = flatten_output(output)
    loss = torch.zeros(())
    for k, (path, leaf) in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and path not in skip:
            generator = torch.Generator().manual_seed(seed * 1000 + k)
            weights = torch.randn(leaf.shape, generator=generator).to(leaf.device)
            loss = loss.to(leaf.device) + (leaf.float() * weights).sum()
    return loss


def summed_grads(model: torch.nn.Module, group: Any) -> tuple[torch.Tensor, list[bool]]:
    """Every parameter's gradient, flat, summed over ``group`` (what DDP's all-reduce sees; zeros
    for none), and which parameters got one on this rank."""
    flat = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1)
            for p in model.parameters()
        ]
    )
    dist.all_reduce(flat, group=group)
    return flat, [p.grad is not None for p in model.parameters()]


def _compare(reference: Any, balanced: Any, where: str, tol: dict[str, float]) -> None:
    ref_leaves, ref_structure = flatten_output(reference)
    bal_leaves, bal_structure = flatten_output(balanced)
    assert type(balanced) is type(reference), f"{where}: type {type(balanced)} != {type(reference)}"
    assert ref_structure == bal_structure, f"{where}: structure differs"
    for (path, ref), (_, bal) in zip(ref_leaves, bal_leaves):
        if isinstance(ref, torch.Tensor):
            assert isinstance(bal, torch.Tensor), f"{where}: {path} is not a tensor"
            assert bal.dtype == ref.dtype and bal.shape == ref.shape, (
                f"{where}: {path} is {bal.dtype}{tuple(bal.shape)}, expected {ref.dtype}{tuple(ref.shape)}"
            )
            if ref.is_floating_point():
                torch.testing.assert_close(bal, ref, **tol, msg=lambda m, p=path: f"{where}: {p}: {m}")
            else:
                assert torch.equal(bal, ref), f"{where}: {path} differs"
        else:
            assert bal == ref, f"{where}: {path} is {bal!r}, expected {ref!r}"


def _check_empty(
    tower: torch.nn.Module, balanced: Any, pixels: torch.Tensor, where: str, layout: dict[str, str] | None
) -> None:
    """A rank without images gets the tower's structure with zero rows (passthrough outputs as is)."""
    merge = getattr(tower, "spatial_merge_size", None) or tower.config.spatial_merge_size
    grid = torch.tensor([[1, merge, merge]], device=pixels.device)
    with torch.no_grad():
        dummy = tower(
            torch.zeros(merge * merge, pixels.shape[1], dtype=pixels.dtype, device=pixels.device), grid
        )
    dummy_leaves, dummy_structure = flatten_output(dummy)
    leaves, structure = flatten_output(balanced)
    assert type(balanced) is type(dummy) and structure == dummy_structure, f"{where}: structure differs"
    for (path, ref), (_, got) in zip(dummy_leaves, leaves):
        if (layout or {}).get(path) == "passthrough":
            assert got.shape == ref.shape, f"{where}: passthrough {path} has shape {tuple(got.shape)}"
        elif isinstance(ref, torch.Tensor) and ref.dim() > 0:
            assert got.shape == (0, *ref.shape[1:]) and got.dtype == ref.dtype, (
                f"{where}: {path} is {got.dtype}{tuple(got.shape)}, expected zero rows of {ref.dtype}"
            )


def run_cases(
    n: int,
    tower_name: str,
    cases: list[dict[str, Any]],
    dtype: str = "float32",
    config: dict[str, Any] | None = None,
    output_layout: dict[str, str] | None = None,
    prepared: bool = False,
    device: str = "cpu",
    group: Any = None,
    tol: dict[str, float] | None = None,
) -> list[dict[str, Any]] | None:
    """Check balanced == direct for each case on this rank (call on every rank of the pool).

    Args:
        n: Balance over the first ``n`` ranks of the pool (see :func:`multirank.subgroup`).
        tower_name: A key of :data:`TOWERS`.
        cases: Each a dict with ``grids`` (per rank, a list of ``(T, H, W)``) and optionally
            ``pixel_grad`` (pixels require grad too), ``grid_dtype`` ("int32"/"int64").
        dtype: Tower and pixel dtype name.
        config: ``ViTBalanceConfig`` keyword arguments.
        output_layout: Passed to the balancer.
        prepared: Plan each case with ``balancer.prepare`` first (outside the counted forward),
            from the batch while it is still on the host.
        device: Where the tower, the pixels and the grids live.
        group: The process group of the first ``n`` ranks (default :func:`multirank.subgroup`).
        tol: Tolerances of outputs and gradients (default :func:`tolerances` of ``dtype``).

    Returns:
        None on ranks outside the first ``n``; else per case: ``applied``, ``reason``,
        ``collectives`` (from BalanceStats), ``counted`` (calls seen by :class:`CollectiveCounter`
        during the balanced forward), ``all_grads`` (every parameter got a gradient on this rank),
        ``moved_images``.
    """
    group = subgroup(n) if group is None else group
    rank = dist.get_rank()
    if rank >= n:
        return None
    torch_dtype = getattr(torch, dtype)
    tol = tolerances(torch_dtype) if tol is None else tol
    model = _model(tower_name, torch_dtype, device)
    balancer = ViTBalancer(ViTBalanceConfig(**(config or {})), group, output_layout=output_layout)
    run = _CaseRun(model, balancer, group, output_layout, prepared, device, tol)
    return [run.check(f"{tower_name}/{dtype}", index, case, torch_dtype) for index, case in enumerate(cases)]


class _CaseBatch(NamedTuple):
    """One rank's batch of a case, on the host, and the seed of its probe loss."""

    host_pixels: torch.Tensor  # [sum(T*H*W), channels]
    host_grid: torch.Tensor  # [images, 3]
    pixel_grad: bool
    seed: int
    has_images: bool


class _CaseRun:
    """One rank's side of :func:`run_cases`: each case encoded directly, then balanced, and compared."""

    def __init__(
        self,
        model: torch.nn.Module,
        balancer: ViTBalancer,
        group: Any,
        output_layout: dict[str, str] | None,
        prepared: bool,
        device: str,
        tol: dict[str, float],
    ) -> None:
        self.model, self.balancer, self.group = model, balancer, group
        self.output_layout, self.prepared, self.device, self.tol = output_layout, prepared, device, tol

    def check(self, name: str, index: int, case: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        """Compare case ``index``'s balanced outputs and gradients with the direct ones; its stats."""
        rank = dist.get_rank()
        where = f"{name} case {index} rank {rank} grids={case['grids']}"
        grids = [tuple(g) for g in case["grids"][rank]]
        host_pixels, host_grid = towers.make_batch(
            grids,
            seed=7919 * index + rank,
            dtype=dtype,
            grid_dtype=getattr(torch, case.get("grid_dtype", "int64")),
        )
        pixel_grad = bool(case.get("pixel_grad", False))
        batch = _CaseBatch(host_pixels, host_grid, pixel_grad, seed=31 * index + rank, has_images=bool(grids))
        reference, ref_pixel_grad, ref_grads = self._direct(batch)
        balanced, bal_pixel_grad, bal_grads, got_grads, counted = self._balanced(batch)
        if reference is not None:
            _compare(reference, balanced, where, self.tol)
        else:
            _check_empty(self.model, balanced, host_pixels.to(self.device), where, self.output_layout)
        grad_tol = dict(self.tol)
        grad_tol["atol"] = self.tol["atol"] * max(1.0, float(ref_grads.abs().max()))
        torch.testing.assert_close(bal_grads, ref_grads, **grad_tol, msg=lambda m: f"{where}: grads: {m}")
        if pixel_grad and ref_pixel_grad is not None:
            torch.testing.assert_close(
                bal_pixel_grad, ref_pixel_grad, **self.tol, msg=lambda m: f"{where}: {m}"
            )
        stats = self.balancer.last_stats
        assert stats is not None
        return {
            "applied": stats.applied,
            "reason": stats.reason,
            "collectives": stats.collectives,
            "counted": counted,
            "all_grads": all(got_grads),
            "moved_images": stats.moved_images,
            "plan_seconds": stats.plan_seconds,
            "prepare_seconds": stats.prepare_seconds,
            "status_seconds": stats.status_seconds,
            "combine_seconds": stats.combine_seconds,
            "exchange_seconds": stats.exchange_seconds,
            "made_in_forward": self.made_in_forward,
        }

    def _direct(self, batch: _CaseBatch) -> tuple[Any, torch.Tensor | None, torch.Tensor]:
        """The reference: this rank's images encoded directly (none without images), the probe
        loss's pixel gradient, and the parameter gradients summed over the group."""
        self.model.zero_grad(set_to_none=True)
        reference, pixel_gradient = None, None
        if batch.has_images:
            pixels = batch.host_pixels.to(self.device).clone().requires_grad_(batch.pixel_grad)
            reference = self.model(pixels, batch.host_grid.to(self.device))
            probe_loss(reference, batch.seed).backward()
            pixel_gradient = pixels.grad
        return reference, pixel_gradient, summed_grads(self.model, self.group)[0]

    def _balanced(self, batch: _CaseBatch) -> tuple[Any, torch.Tensor | None, torch.Tensor, list[bool], int]:
        """The same through the balancer: outputs, pixel gradient, summed parameter gradients,
        which parameters got one on this rank, and the collectives the forward made."""
        self.model.zero_grad(set_to_none=True)
        pixels = batch.host_pixels.to(self.device).clone().requires_grad_(batch.pixel_grad)
        # Prepared from the host batch, as before it moves to the device (shapes, dtype and
        # requires_grad must match the call's).
        host = batch.host_pixels.detach().requires_grad_(batch.pixel_grad)
        ticket = self.balancer.prepare(host, batch.host_grid, self.model) if self.prepared else None
        counter = CollectiveCounter()
        with counter.active(), _ExchangeValuesMade() as made:
            balanced = self.balancer(self.model, pixels, batch.host_grid.to(self.device), prepared=ticket)
        self.made_in_forward = made.count
        # A rank without images has no reference; its passthrough outputs come from the dummy
        # forward and feed no loss in the reference run, so leave them out of the loss.
        layout = self.output_layout or {}
        skip = () if batch.has_images else tuple(p for p, k in layout.items() if k == "passthrough")
        loss = probe_loss(balanced, batch.seed, skip)
        if loss.requires_grad:  # not with empty_rank_forward="no_grad" on a rank that encoded nothing
            loss.backward()
        summed, got_grads = summed_grads(self.model, self.group)
        return balanced, pixels.grad, summed, got_grads, len(counter.calls)


class _ExchangeValuesMade:
    """Counts the routes, pixel trips and return layouts made while it is entered."""

    def __enter__(self) -> _ExchangeValuesMade:
        self.count = 0
        self._patches = [
            mock.patch.object(owner, name, side_effect=self._counted(getattr(owner, name)))
            for owner, name in (
                (ExchangeRoute, "from_plan"),
                (PixelTrip, "from_route"),
                (ReturnLayout, "from_route"),
            )
        ]
        for patch in self._patches:
            patch.start()
        return self

    def _counted(self, make: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return make(*args, **kwargs)

        return counted

    def __exit__(self, *exc: object) -> None:
        for patch in reversed(self._patches):
            patch.stop()


class CompiledSources:
    """A ``torch.compile`` backend that runs each graph TorchDynamo captures as it is and keeps, per
    graph node, the source lines it was traced from (``node.meta["stack_trace"]``)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.traces: list[str] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        self.traces += [node.meta.get("stack_trace") or "" for node in graph.graph.nodes]
        return graph.forward

    def traced_from(self, path_part: str) -> int:
        """How many nodes were traced from a file whose path contains ``path_part``."""
        return sum(path_part in trace for trace in self.traces)
