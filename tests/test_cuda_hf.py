"""The Hugging Face drop-in on the GPU (``make gpu-check``): ``model(**batch)`` of every family the
installed transformers has, on ``cuda:0``, against the plain model on the same device.

As in ``test_cuda.py``, two ranks share the first GPU over a ``"cpu:gloo,cuda:gloo"`` group, and
the CPU runs the same checks (two families there; ``test_hf_dropin.py`` covers every family on the
CPU). What only a GPU shows: a tensor the drop-in makes on the wrong device (a text-only rank's
dummy image and its projection touch, the grids of a plan made on the host, the balanced batch of a
video split by step, a whole video moved, a projection outside the tower), and CUDA's bf16
autocast.
"""

from __future__ import annotations

import copy
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
from test_cuda import DEVICES, POOL, _on_device, _tolerances
from test_hf_dropin import TOL, cases_for, config_for, mixed_cases

from lightning_vit_balance import balance_vision_tower

#: Every family the drop-in takes, on the GPU; two on the CPU (Qwen2.5-VL's windowed tower, and
#: Kimi-K2.5's whole videos and projection outside the tower).
ALL_FAMILIES = (*FAMILIES, *NEWER_FAMILIES, *GLM_FAMILIES, *LATEST_FAMILIES)
ON_THE_CPU = ("qwen2_5_vl", "kimi_k25")
RUNS = [(d, f) for d in DEVICES for f in ALL_FAMILIES if d == "cuda" or f in ON_THE_CPU]


def _on(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _summed_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient summed over the ranks, on the host (zeros for none)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        grads[name] = grad.detach().to("cpu", copy=True)
        dist.all_reduce(grads[name])
    return grads


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
    # A weight's gradient sums products over every token: its rounding scales with its largest entry.
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
        for key, grad in expected.items():
            _assert_close(f"{where}: grad {key}", got[key], grad, tol, max(1.0, float(grad.abs().max())))
        with torch.no_grad():  # both take the plain model's step: step 1 starts from the same weights
            for model in (plain, balanced):
                for key, param in model.named_parameters():
                    param -= 0.5 * expected[key].to(device)
                model.zero_grad(set_to_none=True)
    evaluated = _evaluation(device, family, plain, balanced, tol)
    return {"applied_calls": handle.applied_calls, "evaluated": evaluated}


def _evaluation(
    device: str, family: str, plain: nn.Module, balanced: nn.Module, tol: dict[str, float]
) -> int:
    """One evaluation forward under ``no_grad`` of the first mixed case: the plain model's logits."""
    rank = dist.get_rank()
    batch = _on(make_inputs(family, cases_for(family)[mixed_cases(family)[0]][rank], seed=7 + rank), device)
    plain.eval()
    balanced.eval()
    with torch.no_grad():
        expected, got = plain(**batch).logits, balanced(**batch).logits
    _assert_close(f"{family} evaluation on {device}, rank {rank}: logits", got, expected, tol)
    return 1


@pytest.mark.parametrize(("device", "family"), RUNS)
def test_the_drop_in_trains_as_the_plain_model_on_the_device(
    multirank: Any, device: str, family: str
) -> None:
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    with multirank(POOL) as w:
        results = w.run(_dropin_steps, device, family, timeout=180)
    for result in results:
        # Both training steps move images (the text-only rank's dummy call too), and so does the
        # evaluation forward.
        assert result == {"applied_calls": 3, "evaluated": 1}, (family, results)


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "kimi_k25"])
def test_bf16_autocast_on_the_device(multirank: Any, device: str, family: str) -> None:
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    with multirank(POOL) as w:
        results = w.run(_autocast_steps, device, family, timeout=180)
    print(f"{family} on {device}, bf16 autocast: largest gradient difference / largest entry {results}")
