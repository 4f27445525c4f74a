"""The Hugging Face drop-in on the GPU (``make gpu-check``): ``model(**batch)`` of every family the
installed transformers has, on ``cuda:0``, against the plain model on the same device.

As in ``test_cuda.py``, two ranks share the first GPU over a ``"cpu:gloo,cuda:gloo"`` group, and
the CPU runs the same checks (two families there; ``test_hf_dropin.py`` covers every family on the
CPU). What only a GPU shows: a tensor the drop-in makes on the wrong device (a text-only rank's
dummy image and its projection touch, the grids of a plan made on the host, the balanced batch of a
video split by step, a whole video moved, a projection outside the tower), CUDA's bf16 autocast,
and where the host waits for the device in a forward planned ahead (CUDA's sync debug mode; on the
CPU, a count of the drop-in's grid reads stands in for it).
"""

from __future__ import annotations

import copy
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")

from hf_models import (
    FAMILIES,
    GLM_FAMILIES,
    LATEST_FAMILIES,
    NEWER_FAMILIES,
    available,
    make_inputs,
    tiny_model,
)
from test_cuda import DEVICES, POOL, _on_device, _tolerances, needs_cuda
from test_hf_dropin import TOL, _assert_same_grads, _summed_grads, cases_for, config_for, mixed_cases

from lightning_vit_balance import balance_vision_tower

#: Every family the drop-in takes, on the GPU; two on the CPU (Qwen2.5-VL's windowed tower, and
#: Kimi-K2.5's whole videos and projection outside the tower).
ALL_FAMILIES = (*FAMILIES, *NEWER_FAMILIES, *GLM_FAMILIES, *LATEST_FAMILIES)
ON_THE_CPU = ("qwen2_5_vl", "kimi_k25")
RUNS = [(d, f) for d in DEVICES for f in ALL_FAMILIES if d == "cuda" or f in ON_THE_CPU]


def _on(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _assert_close(where: str, got: Any, expected: Any, tol: dict[str, float], scale: float = 1.0) -> None:
    torch.testing.assert_close(
        got, expected, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=lambda m: f"{where}: {m}"
    )


def _dropin_steps(device: str, family: str) -> dict[str, Any]:
    """Two training steps of :func:`mixed_cases` (a text-only rank, then images and videos), the
    second planned on the host by ``handle.prepare`` before its batch moves to the device, then an
    evaluation forward balanced too; the plain model's losses, summed gradients and logits."""
    group = _on_device(device)
    rank = dist.get_rank()
    tol = _tolerances(device, "float32") or TOL
    plain = tiny_model(family).to(device)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, config_for(family), group, evaluation=True)
    for step, name in enumerate(mixed_cases(family)):
        where = f"{family}/{name} on {device}, rank {rank}"
        host = make_inputs(family, cases_for(family)[name][rank], seed=100 * step + rank)
        if step == 1:
            assert handle.prepare(host) is not None, where
        batch = _on(host, device)
        plain_loss = plain(**batch).loss
        loss = balanced(**batch).loss
        plain_loss.backward()
        loss.backward()
        _assert_close(f"{where}: loss", loss, plain_loss, tol)
        expected, got = _summed_grads(plain), _summed_grads(balanced)
        _assert_same_grads(where, got, expected, tol)
        with torch.no_grad():  # both take the plain model's step: step 1 starts from the same weights
            for model in (plain, balanced):
                for key, param in model.named_parameters():
                    param -= 0.5 * expected[key].to(device)
                model.zero_grad(set_to_none=True)
    _evaluation(device, family, plain, balanced, tol)
    return handle.applied_calls


def _evaluation(
    device: str, family: str, plain: nn.Module, balanced: nn.Module, tol: dict[str, float]
) -> None:
    """One evaluation forward under ``no_grad`` of the first mixed case: the plain model's logits."""
    rank = dist.get_rank()
    batch = _on(make_inputs(family, cases_for(family)[mixed_cases(family)[0]][rank], seed=7 + rank), device)
    plain.eval()
    balanced.eval()
    with torch.no_grad():
        expected, got = plain(**batch).logits, balanced(**batch).logits
    _assert_close(f"{family} evaluation on {device}, rank {rank}: logits", got, expected, tol)


@pytest.mark.parametrize(("device", "family"), RUNS)
def test_the_drop_in_trains_as_the_plain_model_on_the_device(
    multirank: Any, device: str, family: str
) -> None:
    if not available(family):
        pytest.skip(f"this transformers has no {family} of the form tested (hf_models.available)")
    with multirank(POOL) as w:
        results = w.run(_dropin_steps, device, family, timeout=180)
    # Both training steps move images (the text-only rank's dummy call too), and so does the
    # evaluation forward.
    assert results == [3] * POOL, (family, results)


def _autocast_steps(device: str, family: str) -> list[float]:
    """Each mixed case once under bf16 autocast on the device: the plain model's loss and summed
    gradients at bf16's precision; returns each step's largest gradient difference over its largest
    entry."""
    group = _on_device(device)
    rank = dist.get_rank()
    plain = tiny_model(family).to(device)
    balanced = copy.deepcopy(plain)
    balance_vision_tower(balanced, config_for(family), group)
    worst = []
    for name in mixed_cases(family):
        where = f"{family}/{name} on {device} under bf16 autocast, rank {rank}"
        batch = _on(make_inputs(family, cases_for(family)[name][rank], seed=31 + rank), device)
        with torch.autocast(device, dtype=torch.bfloat16):
            plain_loss, loss = plain(**batch).loss, balanced(**batch).loss
        plain_loss.backward()
        loss.backward()
        # Matmuls round to bf16 (3.9e-3 relative) and the balanced batch sums in another order:
        # losses agree to 1e-3, each gradient to 4% of its largest entry (test_hf_dropin's CPU
        # bounds); a misrouted image moves either at O(1).
        _assert_close(f"{where}: loss", loss, plain_loss, {"rtol": 1e-3, "atol": 0.0})
        expected, got = _summed_grads(plain), _summed_grads(balanced)
        ratios = []
        for key, grad in expected.items():
            largest = float(grad.abs().max())
            _assert_close(f"{where}: grad {key}", got[key], grad, {"rtol": 0.0, "atol": 0.04}, largest)
            ratios.append(float((got[key] - grad).abs().max()) / max(largest, 1e-30))
        worst.append(max(ratios))
        plain.zero_grad(set_to_none=True)
        balanced.zero_grad(set_to_none=True)
    return worst


#: Kimi-K2.5's largest gradient difference under the CPU's bf16 autocast was 3.0-3.9% of the largest
#: entry on two machines, too near the 4% bound for CI; on the H200 it was 0.5%.
AUTOCAST_RUNS = [
    (d, f) for d in DEVICES for f in ("qwen2_5_vl", "kimi_k25") if d == "cuda" or f == "qwen2_5_vl"
]


@pytest.mark.parametrize(("device", "family"), AUTOCAST_RUNS)
def test_bf16_autocast_on_the_device(multirank: Any, device: str, family: str) -> None:
    if not available(family):
        pytest.skip(f"this transformers has no {family} of the form tested (hf_models.available)")
    with multirank(POOL) as w:
        results = w.run(_autocast_steps, device, family, timeout=180)
    print(f"{family} on {device}, bf16 autocast: largest gradient difference / largest entry {results}")


#: Where a wait's innermost frame outside torch lies: the package's code, or the model's (Hugging
#: Face towers read ``grid_thw`` on the host), or anywhere else (the test).
_PACKAGE = str(Path(__file__).resolve().parents[1] / "lightning_vit_balance")
_TORCH = str(Path(torch.__file__).resolve().parent)


def _whose(stack: list[traceback.FrameSummary]) -> str:
    frames = [f for f in stack if not f.filename.startswith(_TORCH) and "warnings" not in f.filename]
    innermost = frames[-1].filename if frames else ""
    if innermost.startswith(_PACKAGE):
        return f"package:{Path(innermost).name}:{frames[-1].lineno}"
    return "model" if "transformers" in innermost else "other"


def _waits(model: nn.Module, batch: dict[str, Any]) -> list[str]:
    """Whose code each host wait for the device in a forward and backward of ``model`` comes from,
    by CUDA's sync debug mode (a warning at every wait, its stack taken where it is raised)."""
    found: list[str] = []
    hook = warnings.showwarning

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message).lower():
            found.append(_whose(traceback.extract_stack()[:-1]))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(**batch).loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = hook
    return found


def _drop_in_waits(family: str) -> dict[str, list[str]]:
    """The host's waits in a forward and backward of the plain model and of the balanced one, whose
    plan ``handle.prepare`` made from the batch on the host, on each :func:`mixed_cases` case."""
    group = _on_device("cuda")
    rank = dist.get_rank()
    plain = tiny_model(family).to("cuda")
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, config_for(family), group)
    found: dict[str, list[str]] = {"plain": [], "balanced": []}
    for audited in (False, True):  # the first round warms the allocator and the kernels up
        for step, name in enumerate(mixed_cases(family)):
            host = make_inputs(family, cases_for(family)[name][rank], seed=step + rank)
            batch = _on(host, "cuda")
            plain_waits = _waits(plain, batch)
            assert handle.prepare(host) is not None
            balanced_waits = _waits(balanced, batch)
            if audited:
                found["plain"] += plain_waits
                found["balanced"] += balanced_waits
        plain.zero_grad(set_to_none=True)
        balanced.zero_grad(set_to_none=True)
    assert handle.applied_calls == 2 * len(mixed_cases(family)), handle.applied_calls
    return found


@needs_cuda
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "glm4v", "kimi_k25", "paddleocr_vl"])
def test_a_prepared_balanced_forward_adds_no_host_wait_to_the_models(multirank: Any, family: str) -> None:
    if not available(family):
        pytest.skip(f"this transformers has no {family} of the form tested (hf_models.available)")
    with multirank(POOL) as w:
        results = w.run(_drop_in_waits, family, timeout=180)
    for rank, found in enumerate(results):
        counts = {k: {w: v.count(w) for w in sorted(set(v))} for k, v in found.items()}
        print(f"{family} rank {rank}: host waits for the device, by whose code: {counts}")
        ours = [w for w in found["balanced"] if w.startswith("package:")]
        # GLM-4.xV's model builds its videos' per-step grid itself, which the drop-in reads to match
        # it (test_a_forward_planned_ahead_reads_no_grid_back): one wait, on rank 0 (videos).
        allowed = 1 if family in GLM_FAMILIES and rank == 0 else 0
        assert len(ours) <= allowed, (
            f"{family} rank {rank}: the drop-in made the host wait for the device: {ours}"
        )


def _grid_reads(family: str) -> list[int]:
    """How often the drop-in read a grid's values in each balanced forward and backward of
    :func:`mixed_cases` planned ahead by ``handle.prepare`` (``grid_rows`` and ``grid_steps``, which
    wait for the device on a GPU): the CPU's stand-in for the GPU's sync audit below."""
    from lightning_vit_balance import hf

    group = _on_device("cpu")
    rank = dist.get_rank()
    model = tiny_model(family)
    handle = balance_vision_tower(model, config_for(family), group)
    reads = [0]
    originals = {name: getattr(hf, name) for name in ("grid_rows", "grid_steps")}

    def counted(name: str) -> Any:
        def read(*args: Any, **kwargs: Any) -> Any:
            reads[0] += 1
            return originals[name](*args, **kwargs)

        return read

    per_forward = []
    for step, name in enumerate(mixed_cases(family)):
        batch = make_inputs(family, cases_for(family)[name][rank], seed=step + rank)
        assert handle.prepare(batch) is not None
        reads[0] = 0
        for key in originals:
            setattr(hf, key, counted(key))
        try:
            model(**batch).loss.backward()
        finally:
            for key, value in originals.items():
                setattr(hf, key, value)
        per_forward.append(reads[0])
    assert handle.applied_calls == len(mixed_cases(family)), handle.applied_calls
    return per_forward


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "kimi_k25", "paddleocr_vl", "glm4v"])
def test_a_forward_planned_ahead_reads_no_grid_back(multirank: Any, family: str) -> None:
    """The grids' rows come from the host batch ``prepare`` read, and the model's tower calls are
    matched by the very grid tensor: no read. GLM-4.xV's model builds its videos' per-step grid itself,
    which the drop-in reads once to match it (next to the model's own reads of it)."""
    if not available(family):
        pytest.skip(f"this transformers has no {family} of the form tested (hf_models.available)")
    with multirank(POOL) as w:
        results = w.run(_grid_reads, family, timeout=120)
    expected = [[0, 0], [0, 0]]
    if family in GLM_FAMILIES:  # rank 0 has videos in the second step
        expected = [[0, 1], [0, 0]]
    assert results == expected, results
