"""The Hugging Face drop-in: ``balance_vision_tower(model)``, then ``model(**batch)`` unchanged.

Tiny random Qwen-VL and GLM-4.xV ``*ForConditionalGeneration`` models (see
:mod:`hf_models`, nothing downloaded) on 3 real gloo ranks: images, videos and text-only ranks
mixed, two consecutive training steps per case, each rank's loss and the gradients summed over
ranks against the plain model. Then a 2-rank Lightning DDP fit with
``find_unused_parameters=False``, the eval/no-grad rule, bad input, ``remove()`` and the
contract checks.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import dataclasses
import functools
import inspect
import itertools
import json
import math
import pickle
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
# The examples (the fine-tuning scripts, the dashboard) import as modules, here and in the pool.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import lightning as L
from equivalence import CollectiveCounter, CompiledSources, measured_around_an_evaluation
from hf_models import (
    CHANNELS,
    FAMILIES,
    GLM_FAMILIES,
    IMAGE_ONLY_FAMILIES,
    LATEST_FAMILIES,
    NEWER_FAMILIES,
    REFUSED_FAMILIES,
    WHOLE_VIDEO_FAMILIES,
    available,
    generation_prompt,
    generation_settings,
    make_inputs,
    tiny_config,
    tiny_model,
    tower_of,
)
from lightning.pytorch.strategies import DDPStrategy
from lightning_fit_script import quiet_trainer
from multirank import (
    World,
    caught,
    groups_taken_for_nccl,
    launched_by_torchrun,
    reinit_default_group,
    set_launcher_variables,
    skip_without_fsdp2,
)
from transformers import TrainerCallback

import lightning_vit_balance.lightning.mixin as mixin_module
import lightning_vit_balance.prepared as prepared_module
from lightning_vit_balance import (
    BalancedVisionTower,
    CostCalibrator,
    CostModel,
    ViTBalanceConfig,
    ViTBalanceMixin,
    ViTBalancer,
    ViTBalanceTrainerCallback,
    balance_vision_tower,
    encode_visual,
    hf,
)
from lightning_vit_balance.exchange import grid_steps
from lightning_vit_balance.hf import _host_grid_rows, _modality_rows, rows_to_plan
from lightning_vit_balance.outputs import OutputLayout, flatten_output

RANKS = 3
# Balance whenever the plan lowers the makespan at all, so most cases move images; each temporal
# step of a video is an item of its own, as in the drop-in's default configuration.
CONFIG = {"trigger_threshold": 0.0, "split_videos": True}
# The same per-image maths runs in batches of other sizes (matmul blocking) and the gradient sums
# over images and ranks add in another order: float32 rounding (~1e-7 relative per operation)
# over these tiny models stays far below 1e-5; a misrouted row changes results at O(1).
TOL = {"rtol": 1e-5, "atol": 1e-6}
SGD_LR = 0.5

# Per rank, the samples of its batch: {"images": [(T, H, W), ...], "videos": [...]}; {} is text only.
CASES: dict[str, list[list[dict[str, Any]]]] = {
    "every_rank_images": [
        [{"images": [(1, 8, 8)]}, {"images": [(1, 4, 4)]}],
        [{"images": [(1, 4, 4)]}],
        [{"images": [(1, 2, 2), (1, 4, 2)]}],
    ],
    "text_only_rank": [
        [{"images": [(1, 8, 8), (1, 4, 4)]}],
        [{}],
        [{"images": [(1, 2, 2)]}, {}],
    ],
    "images_and_videos_next_to_images": [
        [{"images": [(1, 4, 4)], "videos": [(2, 4, 4)]}, {"videos": [(1, 4, 2)]}],
        [{"images": [(1, 2, 2)]}],
        [{"images": [(1, 4, 4)]}, {}],
    ],
    "only_videos_on_one_rank": [
        [{"videos": [(2, 4, 4), (1, 2, 2)]}],
        [{"images": [(1, 2, 2)]}],
        [{"images": [(1, 4, 2)]}, {}],
    ],
    "one_big_image_others_text_only": [[{"images": [(1, 12, 12)]}], [{}], [{}]],
    "every_rank_text_only": [[{}], [{}], [{}]],
}
# GLM-4.xV takes no rank batch with images and videos together (a video's frames are image tokens):
# its videos sit next to other ranks' images instead, one rank with several.
GLM_CASES = {
    **{name: case for name, case in CASES.items() if name != "images_and_videos_next_to_images"},
    "videos_next_to_images": [
        [{"videos": [(2, 4, 4)]}, {"videos": [(3, 4, 2), (1, 2, 2)]}],
        [{"images": [(1, 2, 2)]}],
        [{"images": [(1, 4, 4)]}, {}],
    ],
}

# ERNIE-4.5-VL's resampler merges a video's frames in pairs: the same cases, each video's T even.
EVEN_STEP_CASES = {
    name: [
        [
            {
                kind: [(t + t % 2 if kind == "videos" else t, h, w) for t, h, w in grids]
                for kind, grids in s.items()
            }
            for s in rank
        ]
        for rank in case
    ]
    for name, case in CASES.items()
}


# Towers attending over a whole video: two videos of 2 and 3 steps leave rank 0 whole (its image stays).
WHOLE_VIDEO_CASES = {
    **CASES,
    "videos_moved_whole": [
        [{"images": [(1, 8, 8)], "videos": [(2, 4, 4)]}, {"videos": [(3, 2, 4)]}],
        [{}],
        [{"images": [(1, 2, 2)]}],
    ],
}


def cases_for(family: str) -> dict[str, list[list[dict[str, Any]]]]:
    if family == "ernie4_5_vl_moe":
        return EVEN_STEP_CASES
    if family in WHOLE_VIDEO_FAMILIES:
        return WHOLE_VIDEO_CASES
    return GLM_CASES if family in GLM_FAMILIES else CASES


def mixed_cases(family: str) -> tuple[str, str]:
    """Two cases that mix modalities across ranks: a text-only rank, then videos on one rank only
    (with images there too, but in GLM). The sharded tests' ``generate()`` calls and mixed steps run
    them, and so do the families tested on two cases."""
    if family in IMAGE_ONLY_FAMILIES:
        return ("text_only_rank", "every_rank_images")
    return (
        "text_only_rank",
        "videos_next_to_images" if family in GLM_FAMILIES else "images_and_videos_next_to_images",
    )


def config_for(family: str) -> ViTBalanceConfig:
    """:data:`CONFIG`, without ``split_videos`` for a tower attending over a whole video."""
    return ViTBalanceConfig(**{**CONFIG, "split_videos": family not in WHOLE_VIDEO_FAMILIES})


def _summed_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over ranks (what DDP's all-reduce sees), zeros for none, on
    the host (the pool's default group is plain gloo, for CPU tensors)."""
    import torch.distributed as dist

    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        grads[name] = grad.detach().to("cpu", copy=True)
        dist.all_reduce(grads[name])
    return grads


def _assert_same_grads(
    where: str, got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: dict[str, float] = TOL
) -> None:
    """Every gradient of ``got`` equals ``expected``'s (both as :func:`_summed_grads` gives them),
    within ``tol`` (:data:`TOL` by default).

    A weight's gradient sums products over every token of the batch, so its rounding scales with
    its largest entries, not with each entry: ``atol`` scales with the gradient's largest entry
    above 1 (GLM-OCR's merger reaches 3.6 after a step, and an entry near 0 then differs by 5e-6,
    1.3e-6 of that largest; a misrouted row changes it at O(1))."""
    for key, grad in expected.items():
        atol = tol["atol"] * max(1.0, float(grad.abs().max()))
        torch.testing.assert_close(
            got[key], grad, rtol=tol["rtol"], atol=atol, msg=lambda m, k=key: f"{where}: grad {k}: {m}"
        )


def _sgd(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param -= SGD_LR * grads[name]
    model.zero_grad(set_to_none=True)


def _step(model: nn.Module, batch: dict[str, Any], counter: CollectiveCounter | None = None) -> Any:
    """One forward/backward; with a counter, the collectives of each pass."""
    if counter is None:
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), None
    forward, backward = CollectiveCounter(), CollectiveCounter()
    with forward.active():
        loss = model(**batch).loss
    with backward.active():
        loss.backward()
    return loss.detach(), (len(forward.calls), len(backward.calls))


def _check_case(family: str, name: str, ahead: str | None = None) -> dict[str, Any]:
    """Two training steps of the plain and the balanced model on this rank; compare; summarise.
    ``ahead``: each balanced forward's plan made ahead, by ``handle.prepare(batch)`` (``"prepare"``)
    or in the forward from the grids of ``handle.plan_ahead``'s collator (``"collator"``)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, config_for(family))
    tower_name = next(n for n, module in balanced.named_modules() if module is handle.tower)
    steps = []
    for step in range(2):
        where = f"{family}/{name} step {step} rank {rank}"
        # Step 1 swaps the batches of ranks 0 and 1: the load moves, weights have changed.
        source = rank if step == 0 else {0: 1, 1: 0}.get(rank, rank)
        batch = make_inputs(family, cases_for(family)[name][source], seed=100 * step + rank)
        plain_loss, _ = _step(plain, batch)
        calls_before = handle.calls
        if ahead == "prepare":
            assert handle.prepare(batch) is not None, where
        elif ahead == "collator":
            batch = handle.plan_ahead(_first)([batch])
        balanced_loss, counts = _step(balanced, batch, CollectiveCounter())
        if ahead == "collator":  # the forward's own plan ahead: one gather, then no ticket left
            counts = (counts[0] - 1, counts[1])
            assert handle._ticket is None, where
        assert handle.calls == calls_before + 1, f"{where}: {handle.calls - calls_before} exchanges"
        assert handle.unmatched_calls == 0, f"{where}: a tower call was encoded apart"
        torch.testing.assert_close(balanced_loss, plain_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
        plain_grads, balanced_grads = _summed_grads(plain), _summed_grads(balanced)
        _assert_same_grads(where, balanced_grads, plain_grads)
        tower_grads = [g for k, g in plain_grads.items() if k.startswith(f"{tower_name}.")]
        stats = handle.last_stats
        steps.append(
            {
                "applied": stats.applied,
                "reason": stats.reason,
                "forward_collectives": counts[0],
                "backward_collectives": counts[1],
                "stats_collectives": stats.collectives,
                "tower_grad_norm": float(torch.cat([g.reshape(-1) for g in tower_grads]).norm()),
            }
        )
        # Both models take the plain model's step, so step 1 starts from the same weights: stepping
        # each with its own gradients carries step 0's rounding into step 1 amplified (100x on
        # Muse Spark's patch embedding, 2.6e-6 against 4.5e-8, on an AVX-512 machine), a measure
        # of the tiny model's conditioning, not of the exchange.
        _sgd(plain, plain_grads)
        _sgd(balanced, plain_grads)
    return {"steps": steps, "calls": handle.calls, "applied_calls": handle.applied_calls}


def _checkpointed_model_steps(family: str, steps: int) -> dict[str, Any]:
    """The whole model's forward inside a non-reentrant ``torch.utils.checkpoint``, with the cost
    fit and ``handle.plan_ahead``'s collator, one step recomputing another's grids: the plain model's
    losses and gradients, each forward counted once, and no plan made again in the backward pass
    (the collator's route planned there too, taking the forward's remembered plan)."""
    import dataclasses

    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from lightning_vit_balance.recompute import in_backward_pass

    rank = dist.get_rank()
    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, dataclasses.replace(config_for(family), calibrate_cost=True))
    prepared_in_backward = []
    prepare = handle.prepare

    def noting_prepare(batch: Any) -> Any:
        prepared_in_backward.append(in_backward_pass())
        return prepare(batch)

    handle.prepare = noting_prepare  # type: ignore[method-assign]
    names = tuple(cases_for(family))
    for step in range(steps):
        where = f"{family} step {step} rank {rank}"
        batch = make_inputs(family, cases_for(family)[names[step % 3]][rank], seed=100 * step + rank)
        plain_loss, _ = _step(plain, batch)
        keys = sorted(key for key, value in batch.items() if value is not None)
        planned = handle.plan_ahead(_first)([batch])
        values = [planned[key] for key in keys]
        calls_before = handle.calls

        def forward(*values: Any, planned: dict[str, Any] = planned, keys: list[str] = keys) -> Any:
            return balanced(**{**planned, **dict(zip(keys, values))}).loss

        balanced_loss = checkpoint(forward, *values, use_reentrant=False)
        balanced_loss.backward()
        assert handle.calls == calls_before + 1, f"{where}: {handle.calls - calls_before} counted"
        torch.testing.assert_close(
            balanced_loss.detach(), plain_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}"
        )
        plain_grads = _summed_grads(plain)
        _assert_same_grads(where, _summed_grads(balanced), plain_grads)
        _sgd(plain, plain_grads)
        _sgd(balanced, plain_grads)
    return {"prepared_in_backward": sum(prepared_in_backward), "prepared": len(prepared_in_backward)}


def test_a_checkpointed_model_forward_recomputes_with_its_plan(multirank: Any) -> None:
    with multirank(RANKS) as w:
        per_rank = w.run(_checkpointed_model_steps, "qwen2_5_vl", 6, timeout=240)
    assert per_rank == [{"prepared_in_backward": 0, "prepared": 6}] * RANKS, per_rank


def _outside_a_group() -> list[str]:
    """A rank that ``new_group`` left out passes the placeholder it got: refused where it is passed."""
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    if dist.get_rank() < 2:
        return []
    messages = []
    handle = balance_vision_tower(tiny_model("qwen2_5_vl"))
    for make in (lambda: balance_vision_tower(tiny_model("qwen2_5_vl"), group=pair), handle.settings):
        handle.group = pair  # set after the handle was made, as a subclass's setting may be
        with caught(ValueError) as outcome:
            make()
        messages.append(outcome.message)
    return messages


def test_a_group_that_does_not_hold_the_rank_is_refused(multirank: Any) -> None:
    with multirank(RANKS) as w:
        per_rank = w.run(_outside_a_group)
    assert per_rank[:2] == [[], []], per_rank
    assert len(per_rank[2]) == 2, per_rank
    assert all(
        "group is a group that does not hold this process (global rank 2)" in m for m in per_rank[2]
    ), per_rank


def _check_cases(family: str, names: tuple[str, ...], ahead: str | None = None) -> dict[str, Any]:
    return {name: _check_case(family, name, ahead) for name in names}


@pytest.mark.parametrize("family", [*FAMILIES, *NEWER_FAMILIES, "glm4v"])
def test_model_forward_matches_plain_model(multirank: Any, family: str) -> None:
    """Each case: no hang, one exchange per forward, equal losses and summed gradients, 2 steps."""
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    with multirank(RANKS) as w:
        per_rank = w.run(_check_cases, family, tuple(cases_for(family)), timeout=240)
    applied = _assert_cases(per_rank, tuple(cases_for(family)))
    assert applied >= 6, "most cases should move images, else the equivalence proves little"
    assert per_rank[0]["one_big_image_others_text_only"]["steps"][0]["reason"] != "applied"


@pytest.mark.parametrize("family", [*GLM_FAMILIES[1:], *LATEST_FAMILIES])
def test_more_families_match_the_plain_model(multirank: Any, family: str) -> None:
    """The other GLM-4.xV models (GLM-4.1V's code) and transformers 5.24's and 5.25's other families
    that meet the contract (LFM3-VL's, ERNIE-4.5-VL's and Dots3-Note's towers under
    ``vision_tower``): the checks above on the two :func:`mixed_cases`. The GLM models pass their
    tower a video's temporal steps themselves; for the others, whose towers attend within each step,
    the drop-in's default configuration splits videos by step."""
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    handle = balance_vision_tower(tiny_model(family))
    steps = family.startswith("glm")
    assert handle.step_grid_keys == (("video_grid_thw",) if steps else ())
    per_step = not steps and family not in (*WHOLE_VIDEO_FAMILIES, *IMAGE_ONLY_FAMILIES)
    assert handle.default_config().split_videos is per_step
    with multirank(RANKS) as w:
        per_rank = w.run(_check_cases, family, mixed_cases(family), timeout=240)
    assert _assert_cases(per_rank, mixed_cases(family)) >= 2, (
        "images should move, else equality proves little"
    )


@pytest.mark.parametrize(
    ("family", "ahead"),
    [
        ("qwen2_5_vl", "prepare"),
        ("glm4v", "prepare"),
        ("qwen3_vl", "collator"),
        ("glm4v", "collator"),
        ("ovis2_5", "collator"),  # its projection before its embeddings, a text-only rank
    ],
)
def test_plans_made_ahead_by_the_handle_train_as_the_plain_model(
    multirank: Any, family: str, ahead: str
) -> None:
    """``handle.prepare(batch)`` before each forward, without Lightning, or the grids of
    ``handle.plan_ahead``'s collator, planned from in the forward: the same losses and gradients as
    the plain model, and the balanced call makes no metadata gather (only the trips and the status
    gather, or nothing when the plan skips)."""
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    names = tuple(cases_for(family))
    with multirank(RANKS) as w:
        per_rank = w.run(_check_cases, family, names, ahead, timeout=240)
    assert _assert_cases(per_rank, names) >= 6
    for result in per_rank:
        for step in (s for case in result.values() for s in case["steps"]):
            # A skipped call makes none, but the status word where no rank has images.
            skipped = int(step["reason"] == "no-images")
            assert step["forward_collectives"] == (3 if step["applied"] else skipped), step


def _with_a_host_twin() -> dict[str, Any]:
    """The drop-in on a group taken for an NCCL group (:func:`groups_taken_for_nccl`): its
    balancer makes its small gathers on the gloo twin it creates."""
    import torch.distributed as dist

    rank = dist.get_rank()
    with groups_taken_for_nccl():
        plain = tiny_model(FIT_FAMILY)
        balanced = copy.deepcopy(plain)
        handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
        batch = make_inputs(FIT_FAMILY, CASES["every_rank_images"][rank], seed=rank)
        handle.prepare(batch)
        plain_loss, _ = _step(plain, batch)
        balanced_loss, _ = _step(balanced, batch)
        host = handle._balancer.host_group
        twin_ranks = dist.get_process_group_ranks(host) if host is not None else None
        handle._balancer_for(ViTBalanceConfig(**CONFIG, min_gain=0.1), None)  # another configuration
        same_twin = handle._balancer.host_group is host
        names = [host.group_name]
        del host
        # The end of a Trainer's training destroys the twin; the next forward makes another.
        callback = ViTBalanceTrainerCallback()
        callback.on_init_end(None, None, None, model=balanced)
        callback.on_train_end(None, None, None)
        handle.prepare(batch)
        again_loss, _ = _step(balanced, batch)
        _step(plain, batch)  # the gradients of both accumulate twice
        names.append(handle._balancer.host_group.group_name)
        handle.remove()  # destroys that one
        held = [name in dist.distributed_c10d._world.pg_names.values() for name in names]
    torch.testing.assert_close(balanced_loss, plain_loss, **TOL)
    torch.testing.assert_close(again_loss, plain_loss, **TOL)  # the same weights: no optimizer step
    _assert_same_grads(f"twin rank {rank}", _summed_grads(balanced), _summed_grads(plain))
    return {
        "twin_ranks": twin_ranks,
        "same_twin": same_twin,
        "applied": handle.last_stats.applied,
        "names": names,
        "held": held,
    }


def test_the_drop_in_gathers_on_a_gloo_twin_of_an_nccl_group(multirank: Any) -> None:
    """Where the group is NCCL (every process of the world), the handle's metadata and status
    gathers go through a gloo twin made once at its first plan, so none waits for the device. The
    end of a Trainer's training destroys it (the next forward makes another), as does
    ``handle.remove()``."""
    with multirank(RANKS) as w:
        results = w.run(_with_a_host_twin, timeout=120)
    assert all(r["twin_ranks"] == list(range(RANKS)) and r["same_twin"] for r in results), results
    assert all(r["applied"] and r["held"] == [False, False] for r in results), results
    assert all(r["names"][0] != r["names"][1] for r in results), results


def _across_default_groups(stores: list[str], twin: bool) -> list[str]:
    """One handle on the default group (``group=None``) kept while that group is destroyed and
    initialised again: each round trains as the plain model, on the group that exists then (and,
    with ``twin``, on a gloo twin made for it)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    plain = tiny_model(FIT_FAMILY)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
    reasons = []
    with groups_taken_for_nccl() if twin else contextlib.nullcontext():
        for round_, store in enumerate([None, *stores]):
            if store is not None:
                reinit_default_group(store)
            batch = make_inputs(FIT_FAMILY, CASES["every_rank_images"][rank], seed=10 * round_ + rank)
            if round_ == 2:
                handle.prepare(batch)
            plain_loss, _ = _step(plain, batch)
            balanced_loss, _ = _step(balanced, batch)
            torch.testing.assert_close(balanced_loss, plain_loss, **TOL)
            _assert_same_grads(f"round {round_} rank {rank}", _summed_grads(balanced), _summed_grads(plain))
            reasons.append(handle.last_stats.reason)
            host = handle._balancer.host_group
            assert (host is not dist.group.WORLD) == twin and host in dist.distributed_c10d._world.pg_names
    return reasons


@pytest.mark.parametrize("twin", [False, True], ids=["gloo", "twin"])
def test_a_handle_on_the_default_group_follows_it_when_it_is_made_again(
    multirank: Any, tmp_path: Path, twin: bool
) -> None:
    """A sweep under one launcher destroys the default group between trials and initialises it
    again: a handle made with ``group=None`` balances over the new one (it had kept a balancer, and a
    twin, of the destroyed group: every rank raised "not initialized in the world group map")."""
    stores = [str(tmp_path / f"store{k}") for k in range(2)]
    with multirank(RANKS) as w:
        results = w.run(_across_default_groups, stores, twin, timeout=120)
        w.close()  # its ranks are in a world of the test's own (see reinit_default_group)
    assert results == [["applied"] * 3] * RANKS, results


def _assert_cases(per_rank: list[dict[str, Any]], names: tuple[str, ...]) -> int:
    """The checks every case's result passes (see :func:`_check_case`); returns the applied calls."""
    applied = 0
    for name in names:
        results = [r[name] for r in per_rank]
        for rank_result in results:
            assert rank_result["calls"] == 2
            for step in rank_result["steps"]:
                # The forward issues exactly the balanced call's collectives, nothing more.
                assert step["forward_collectives"] == step["stats_collectives"], (name, step)
                # The backward repeats the return trip when images moved (pixels need no grad).
                assert step["backward_collectives"] == (1 if step["applied"] else 0), (name, step)
        # Every rank made the same plan.
        assert len({tuple(s["applied"] for s in r["steps"]) for r in results}) == 1
        applied += results[0]["applied_calls"]
        if name != "every_rank_text_only":
            assert results[0]["steps"][0]["tower_grad_norm"] > 0, name  # the tower was trained
    return applied


def _mixed_steps(family: str, rank: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """Four steps of this rank's batches, a text-only rank and images next to videos in turn."""
    for step, name in enumerate(mixed_cases(family) * 2):
        batch = make_inputs(family, cases_for(family)[name][rank], seed=100 * step + rank)
        yield f"{family}/{name} step {step} rank {rank}", batch


def _assert_averaged(
    where: str,
    params: dict[str, nn.Parameter],
    expected: dict[str, torch.Tensor],
    size: int,
    full: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Gradients averaged over ranks (DDP, FSDP) against the plain model's gradients summed over them."""
    for key, param in params.items():
        assert param.grad is not None, f"{where}: {key} got no gradient"
        got = full(param.grad) * size
        torch.testing.assert_close(got, expected[key], **TOL, msg=lambda m, k=key: f"{where}: grad {k}: {m}")


def _ddp_with_checkpointing(family: str) -> dict[str, Any]:
    """The balanced model under DDP with one bucket per layer and HF's gradient checkpointing."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, size = dist.get_rank(), dist.get_world_size()
    plain = tiny_model(family)
    plain.gradient_checkpointing_enable()  # HF's default: reentrant in transformers 4.x, not in 5
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
    # Tiny buckets: from the second backward on (DDP rebuilds its buckets after the first), the
    # all-reduces start while the backward runs, in between the drop-in's backward exchange.
    model = DistributedDataParallel(balanced, bucket_cap_mb=0.0005)
    for where, batch in _mixed_steps(family, rank):
        plain(**batch).loss.backward()
        model(**batch).loss.backward()
        expected = _summed_grads(plain)
        _assert_averaged(where, dict(balanced.named_parameters()), expected, size, lambda grad: grad)
        _sgd(plain, expected)
        _sgd(balanced, expected)
    return {
        "applied_calls": handle.applied_calls,
        "buckets_reduced": int(model._get_ddp_logging_data()["num_buckets_reduced"]),
    }


def test_ddp_buckets_and_gradient_checkpointing_interleave_with_the_exchange(multirank: Any) -> None:
    """DDP's all-reduces fire during the backward next to the return trip's: same gradients, no hang."""
    with multirank(RANKS) as w:
        results = w.run(_ddp_with_checkpointing, "qwen2_5_vl", timeout=180)
    assert all(r["applied_calls"] == 4 and r["buckets_reduced"] > 1 for r in results), results


#: Families whose base model projects the tower's outputs outside the tower: the children a
#: text-only rank touches (``BalancedVisionTower.projection``). Every other family has none.
PROJECTIONS = {
    "cosmos3_edge": ("projector",),
    "lfm3_vl": ("multi_modal_projector",),
    "ernie4_5_vl_moe": ("resampler_model",),
    "hyperclovax_vision_v2": ("projector",),
    "muse_spark": ("vision_adapter", "vision_projection"),
    "muse_glimmer": ("vision_adapter", "vision_projection"),
    "minimax_m3_vl": ("multi_modal_projector",),
    "paddleocr_vl": ("projector",),
    "kimi_k25": ("mm_projector",),
    "ovis2_5": ("multi_modal_projector",),
}


def _ddp_text_only_rank(families: tuple[str, ...]) -> dict[str, int]:
    """Per family, DDP as it comes (``find_unused_parameters=False``): a text-only rank, then images
    and videos on every rank; the plain model's gradients averaged, the same weights at each step.
    An audio tower, which no step uses on any rank, is frozen (DDP would otherwise wait for it)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, size = dist.get_rank(), dist.get_world_size()
    applied = {}
    for family in families:
        plain = tiny_model(family)
        audio = getattr(plain.model, "audio_tower", None)
        if audio is not None:
            audio.requires_grad_(False)
        balanced = copy.deepcopy(plain)
        handle = balance_vision_tower(balanced, config_for(family))
        assert handle.projection == PROJECTIONS[family], (family, handle.projection)
        model = DistributedDataParallel(balanced)
        trained = {key: p for key, p in balanced.named_parameters() if p.requires_grad}
        for step, name in enumerate(mixed_cases(family)):
            where = f"{family}/{name} step {step} rank {rank}"
            batch = make_inputs(family, cases_for(family)[name][rank], seed=100 * step + rank)
            plain(**batch).loss.backward()
            model(**batch).loss.backward()
            expected = _summed_grads(plain)
            _assert_averaged(where, trained, expected, size, lambda grad: grad)
            _sgd(plain, expected)
            _sgd(balanced, expected)
        applied[family] = handle.applied_calls
    return applied


def test_ddp_with_a_text_only_rank_where_the_projection_is_outside_the_tower(multirank: Any) -> None:
    """Kimi-K2.5, MiniMax-M3-VL and the others of :data:`PROJECTIONS` under DDP without
    ``find_unused_parameters``: a text-only rank never calls the projection, yet every rank gives
    its parameters a gradient, and the averaged gradients are the plain model's (DDP raised "Expected
    to have finished reduction in the prior iteration" at the next step before)."""
    _two_moves_in_each_family(multirank, _ddp_text_only_rank, tuple(PROJECTIONS))


def _two_moves_in_each_family(multirank: Any, worker: Callable[..., Any], families: tuple[str, ...]) -> None:
    """``worker(families)`` on every rank, over the families this transformers has: each family's
    two balanced steps moved images."""
    families = tuple(family for family in families if available(family))
    if not families:
        pytest.skip("this transformers has none of these families")
    with multirank(RANKS) as w:
        results = w.run(worker, families, timeout=240)
    assert results == [dict.fromkeys(families, 2)] * RANKS, results


def test_projection_names_the_children_outside_the_tower() -> None:
    """``projection`` per family (none where the merger is in the tower); a name that is not a child
    of the base model is refused when set, not at a text-only rank's forward."""
    for family in (*FAMILIES, *NEWER_FAMILIES, *GLM_FAMILIES, *LATEST_FAMILIES):
        if available(family):
            handle = balance_vision_tower(tiny_model(family))
            assert handle.projection == PROJECTIONS.get(family, ()), family
            handle.remove()
    handle = balance_vision_tower(tiny_model("qwen2_5_vl"))
    handle.projection = ("language_model",)
    assert handle.projection == ("language_model",)
    for bad, says in (
        (("mlp1",), "not children: ['mlp1']"),
        ("merger", "not a string (a one-name projection"),
    ):
        with pytest.raises(
            ValueError, match=r"BalancedVisionTower.projection = .* expected a sequence of names"
        ) as raised:
            handle.projection = bad
        assert says in str(raised.value)


def test_the_towers_blocks_become_zero3_leaves_until_removed() -> None:
    """ZeRO-3 leaves (DeepSpeed's ``_z3_leaf`` flag, read by ``deepspeed.initialize``): the tower's
    blocks everywhere, PaddleOCR-VL's projector (called once per forward), not a projection called
    once per modality (LFM3-VL's); flags set before stay, the drop-in's go with ``remove()``; a model
    whose modules an engine registered already (``ds_id``) is left as it is."""
    for family, projected in (("qwen2_5_vl", None), ("lfm3_vl", False), ("paddleocr_vl", True)):
        if not available(family):
            continue
        model = tiny_model(family)
        tower = tower_of(model)
        blocks = [m for m in tower.modules() if type(m).__name__.endswith(("Block", "Layer"))]
        assert blocks, family
        blocks[0]._z3_leaf = True  # the user's own
        handle = balance_vision_tower(model)
        assert all(getattr(block, "_z3_leaf", False) for block in blocks), family
        assert not getattr(tower, "_z3_leaf", False), family
        for name in handle.projection:
            assert getattr(getattr(handle.base, name), "_z3_leaf", False) is projected, family
        handle.remove()
        assert blocks[0]._z3_leaf and not any(hasattr(block, "_z3_leaf") for block in blocks[1:]), family
        assert not any(hasattr(getattr(handle.base, name), "_z3_leaf") for name in handle.projection)
    # Registered by an engine already: left as it is, with a warning where the model needs leaves
    # (LFM3-VL's blocks call a submodule once per image) and the user set none.
    for family, warned in (("qwen2_5_vl", False), ("lfm3_vl", True), ("paddleocr_vl", True)):
        if not available(family):
            continue
        for set_by_user in (False, True):
            model = tiny_model(family)
            for module in model.modules():
                module.ds_id = 0  # as deepspeed.initialize leaves them
                if set_by_user:
                    module._z3_leaf = True
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                balance_vision_tower(model)
            late = [w for w in caught if "cannot make its tower's blocks" in str(w.message)]
            assert len(late) == (warned and not set_by_user), (family, set_by_user, caught)
            assert all(hasattr(module, "_z3_leaf") is set_by_user for module in model.modules()), family


class _Scale(nn.Module):
    """A module of a kind the touch does not know by its class: a 1-d ``weight``, as an RMSNorm's."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * self.weight


class _Embedded(nn.Module):
    """A base model's two parts a text-only rank's touch concerns: token embeddings, a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(5, 3)
        # As Kimi-K2.5's and PaddleOCR-VL's: a LayerNorm first, whose backward hands its weight
        # over before its bias (a Linear's, its bias first); an RMSNorm-like module last.
        layers = [nn.LayerNorm(2), nn.Linear(2, 4), nn.GELU(), nn.Linear(4, 3), _Scale(3)]
        self.projector = nn.Sequential(*layers)
        with torch.no_grad():  # signed zeros, an infinity and a NaN, which the touch keeps
            self.embed_tokens.weight[0] = torch.tensor([-0.0, float("inf"), float("nan")])

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens


def test_a_text_only_ranks_projection_touch_is_exact_and_comes_before_the_embeddings() -> None:
    """The touch at the token embeddings keeps their values bit for bit, and its backward reaches
    the projection right before the embeddings, its parameters in the order a backward through the
    projection hands them over (ZeRO-2 buckets them in that order), as a model projecting images
    does; a forward that embeds nothing is touched at its end. Each way the projection gets an
    all-zero gradient."""
    from lightning_vit_balance.hf import _ProjectionTouch, _touch_zero

    model = _Embedded()
    projected: list[str] = []
    for name, param in model.projector.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _, n=name, seen=projected: seen.append(n))
    model.projector(torch.randn(4, 2)).sum().backward()
    assert projected[:2] == ["4.weight", "3.bias"] and projected[-2:] == ["0.weight", "0.bias"], projected
    for embeds in (True, False):
        model = _Embedded()
        arrived: list[str] = []
        for name, param in model.named_parameters():
            param.register_post_accumulate_grad_hook(lambda _, n=name, seen=arrived: seen.append(n))
        touch = _ProjectionTouch.arm(functools.partial(_touch_zero, [model.projector]), model)
        ids = torch.tensor([0, 1, 0])
        plain = model.embed_tokens.weight[ids].detach()
        hidden = model.embed_tokens(ids) if embeds else model.embed_tokens.weight[ids]
        assert hidden.detach().numpy().tobytes() == plain.numpy().tobytes()
        zero = touch.finish(None)
        assert (zero is None) == embeds and not model.embed_tokens._forward_hooks
        loss = hidden[1:2].sum() if zero is None else hidden[1:2].sum() - zero
        loss.backward()
        assert all(not p.grad.any() for p in model.projector.parameters()), embeds
        order = [*(f"projector.{name}" for name in projected), "embed_tokens.weight"]
        assert arrived == order if embeds else set(arrived) == set(order), arrived


#: Where the FSDP2 units go: each vision block, or the tower as one unit (sharded before or after
#: balance_vision_tower); each decoder layer and the root in every layout.
FSDP2_LAYOUTS = ("blocks", "tower before", "tower after")


def _fsdp2_step(
    plain: nn.Module, balanced: nn.Module, batch: dict[str, Any], where: str, *, skip_unused: bool = False
) -> None:
    """One step of the plain model and its FSDP2-sharded balanced copy: the balanced gradients (each
    rank a DTensor shard, averaged over ranks) against the plain model's summed over ranks, then
    both take the plain model's SGD step. ``skip_unused``: parameters the plain model gives no
    gradient on any rank (all zeros) and the sharded model none are not compared."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    plain(**batch).loss.backward()
    balanced(**batch).loss.backward()
    expected = _summed_grads(plain)
    params = dict(balanced.named_parameters())
    compared = {
        key: param
        for key, param in params.items()
        if not skip_unused or param.grad is not None or expected[key].any()
    }
    _assert_averaged(where, compared, expected, dist.get_world_size(), lambda grad: grad.full_tensor())
    with torch.no_grad():
        for key, param in params.items():
            param -= distribute_tensor(SGD_LR * expected[key], param.device_mesh, param.placements)
            param.grad = None
    _sgd(plain, expected)


def _fsdp2_units(family: str) -> dict[str, Any]:
    """FSDP2 in each of :data:`FSDP2_LAYOUTS`: the plain model's gradients; then a tower replaced by a
    wrapper, or compiled whole, after balance_vision_tower."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    applied = {}
    for layout in FSDP2_LAYOUTS:
        plain = tiny_model(family)
        balanced = copy.deepcopy(plain)
        tower = balanced.model.visual
        if layout == "tower before":
            fully_shard(tower)
        handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
        units = [*tower.blocks] if layout == "blocks" else [tower] if layout == "tower after" else []
        for unit in [*units, *balanced.model.language_model.layers, balanced]:
            fully_shard(unit)
        for where, batch in _mixed_steps(family, rank):
            _fsdp2_step(plain, balanced, batch, f"{layout}: {where}")
        applied[layout] = handle.applied_calls
    errors = []
    # A new module in the tower's place would run once per modality a rank has: it must raise.
    batch = make_inputs(family, CASES["images_and_videos_next_to_images"][rank], seed=rank)
    for when in ("wrapped after", "compiled after"):
        model = tiny_model(family)
        try:
            balance_vision_tower(model, ViTBalanceConfig(**CONFIG))
            if when == "wrapped after":  # what FSDP1 does: a new module in the tower's place
                model.model.visual = _Wrapper(model.model.visual)
            else:  # lazy: nothing compiles before the first call
                model.model.visual.compile()
            model(**batch)
        except ValueError as err:
            errors.append(str(err))
    return {"applied_calls": applied, "errors": errors}


#: The families added last, each of another tower design: MoE blocks (Dots3-Note), a tower under
#: ``vision_model`` (HyperCLOVAX), outputs merged by the config (Muse Spark), a batch dimension on
#: the outputs (MiniMax-M3-VL), patch-image rows and images only (PaddleOCR-VL), frames pooled in
#: the tower (Kimi-K2.5). Not Ovis2.5: with its tower an FSDP2 unit the plain model fails too (its
#: projection reads the tower's hidden states, which transformers records by the tower's class, and
#: ``fully_shard`` gives the tower a class of its own that records none).
FSDP2_TOWER_FAMILIES = (
    "dots3_note",
    "hyperclovax_vision_v2",
    "muse_spark",
    "minimax_m3_vl",
    "paddleocr_vl",
    "kimi_k25",
)


def _fsdp2_tower_unit(families: tuple[str, ...]) -> dict[str, int]:
    """Per family: the tower an FSDP2 unit (sharded after ``balance_vision_tower``) and the model
    the root; a step with a text-only rank, then one with images on every rank and videos next to
    them (none for PaddleOCR-VL); the plain model's gradients, the same weights at every step. All
    but Dots3-Note project the tower's outputs outside it: on the text-only rank that projection
    gets its all-zero gradient from the drop-in, so FSDP2's root reduce-scatter is the same on
    every rank (without it gloo aborted, as the plain model does). Returns each family's balanced
    calls that moved images."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    applied = {}
    for family in families:
        plain = tiny_model(family)
        balanced = copy.deepcopy(plain)
        handle = balance_vision_tower(balanced, config_for(family))
        fully_shard(handle.tower)
        fully_shard(balanced)
        for step, name in enumerate(mixed_cases(family)):
            where = f"{family}/{name} step {step} rank {rank}"
            batch = make_inputs(family, cases_for(family)[name][rank], seed=100 * step + rank)
            # Parameters no rank's forward uses (Dots3-Note's sparse-attention indexer) get none.
            _fsdp2_step(plain, balanced, batch, where, skip_unused=True)
        assert handle.unmatched_calls == 0, f"{family}: a tower call was encoded apart"
        applied[family] = handle.applied_calls
    return applied


def test_fsdp2_tower_unit_in_the_newest_families(multirank: Any) -> None:
    """The tower as one FSDP2 unit in each of :data:`FSDP2_TOWER_FAMILIES`: the plain model's
    gradients, each step's images moved."""
    skip_without_fsdp2()
    _two_moves_in_each_family(multirank, _fsdp2_tower_unit, FSDP2_TOWER_FAMILIES)


def _fsdp2_projection_unit(family: str) -> tuple[int, list[float]]:
    """The projection outside the tower an FSDP2 unit of its own, next to the tower's and the root's:
    that unit gathers its parameters at each call, and the model calls it once per modality a rank
    holds, so a rank without one calls it on a dummy image. Images on every rank, a text-only rank,
    then videos on one rank: the plain model's gradients. Each step is planned ahead
    (``handle.prepare``), a plan the steps with dummy images drop. Returns the balanced calls that
    moved images and each step's ``prepare_seconds``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, config_for(family))
    for name in handle.projection:
        fully_shard(getattr(handle.base, name))
    fully_shard(handle.tower)
    fully_shard(balanced)
    prepared = []
    for step, name in enumerate(("every_rank_images", *mixed_cases(family))):
        batch = make_inputs(family, cases_for(family)[name][rank], seed=100 * step + rank)
        assert handle.prepare(batch) is not None
        _fsdp2_step(plain, balanced, batch, f"{family}/{name} rank {rank}")
        assert handle.last_stats is not None
        prepared.append(handle.last_stats.prepare_seconds)
    return handle.applied_calls, prepared


@pytest.mark.parametrize("family", ["kimi_k25", "ernie4_5_vl_moe"])
def test_fsdp2_projection_unit_with_ranks_of_other_modalities(multirank: Any, family: str) -> None:
    """Kimi-K2.5's ``mm_projector`` (ERNIE-4.5-VL's resampler, which takes a video's temporal steps
    in pairs) as an FSDP2 unit of its own, with a text-only rank and with videos on one rank only:
    the plain model's gradients (without the dummy images gloo aborted)."""
    skip_without_fsdp2()
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    with multirank(RANKS) as w:
        results = w.run(_fsdp2_projection_unit, family, timeout=120)
    assert [applied for applied, _ in results] == [3] * RANKS
    # Every step's preparation counts in its stats, also where the dummy images made the call
    # plan again (it was lost there).
    assert all(seconds > 0.0 for _, prepared in results for seconds in prepared), results


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


def test_fsdp2_units_on_the_blocks_or_the_tower(multirank: Any) -> None:
    """Blocks or the whole tower as FSDP2 units: the plain model's gradients. A tower replaced, or
    compiled whole, after balance_vision_tower: an error on every rank, not a hang."""
    skip_without_fsdp2()
    with multirank(RANKS) as w:
        results = w.run(_fsdp2_units, "qwen2_5_vl", timeout=240)
    for r in results:
        assert r["applied_calls"] == dict.fromkeys(FSDP2_LAYOUTS, 4), r
        assert len(r["errors"]) == 2, r["errors"]
        assert "visual was replaced by a _Wrapper after balance_vision_tower" in r["errors"][0], r
        assert "is compiled as a whole" in r["errors"][1] and "block.compile()" in r["errors"][1], r


def _fsdp2_adamw_text_only_steps(hsdp: bool) -> dict[str, Any]:
    """FSDP2 (the tower and each decoder layer units, on a 1-D mesh; or HSDP's 2-D mesh of 2
    replicas of 2 shards) and AdamW with weight decay, the plain FSDP2 model beside the balanced
    one: images on every rank, text alone on every rank twice (the plain model never calls the
    tower, so its gradients stay unset and AdamW skips it), images again. Returns each step's
    losses and largest tower difference, and whether the balanced tower's gradients were unset
    after each step as the plain model's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, size = dist.get_rank(), dist.get_world_size()
    shape, names = ((2, size // 2), ("replicate", "shard")) if hsdp else ((size,), ("shard",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    plain = tiny_model("qwen2_5_vl")
    balanced = copy.deepcopy(plain)
    balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
    for model in (plain, balanced):
        for unit in (model.model.visual, *model.model.language_model.layers, model):
            fully_shard(unit, mesh=mesh)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=ADAMW_LR, weight_decay=0.1) for m in (plain, balanced)]
    images = [{"images": [(1, 8, 4 + 2 * rank)]}, {"images": [(1, 2, 2)] * (rank + 1)}]
    steps = {"images": images, "text": [{}], "text again": [{}], "images again": images[::-1]}
    results: dict[str, Any] = {}
    for step, (name, samples) in enumerate(steps.items()):
        batch = make_inputs("qwen2_5_vl", samples, seed=10 * step + rank)
        losses = []
        for model, optimizer in zip((plain, balanced), optimizers):
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()  # the drop-in's drop comes first (its optimizer step pre-hook)
            losses.append(float(loss.detach()))
        towers = [list(model.model.visual.parameters()) for model in (plain, balanced)]
        apart = max(float((a - b).full_tensor().abs().max()) for a, b in zip(*towers))
        unset = [[p.grad is None for p in tower] for tower in towers]
        results[name] = (losses, apart, unset[0] == unset[1], all(unset[1]))
    return results


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp"])
def test_fsdp2_steps_of_text_alone_leave_the_tower_to_adamw_as_the_plain_model(
    multirank: Any, hsdp: bool
) -> None:
    """Under FSDP2 and HSDP a step of text alone on every rank unsets the sharded tower's zero
    gradients as the plain model leaves them, so AdamW's weight decay and momentum skip it: the
    plain model's losses and weights, step by step (apart by 0.0077 after the first such step
    and 0.7% in the next step's losses before, when only unsharded gradients were unset)."""
    skip_without_fsdp2()
    with multirank(4 if hsdp else 2) as w:
        results = w.run(_fsdp2_adamw_text_only_steps, hsdp, timeout=180)
    for rank, per_step in enumerate(results):
        for name, (losses, apart, unset_alike, all_unset) in per_step.items():
            # Both models compute the same sums on the same shards: bit for bit, so exact.
            assert losses[0] == losses[1] and apart == 0.0, (rank, name, losses, apart)
            assert unset_alike and all_unset == name.startswith("text"), (rank, name)


def _compiled_whole(family: str) -> dict[str, Any]:
    """The balanced model compiled as a whole (``torch.compile(model)``, what the ``Trainer``'s
    ``torch_compile=True`` does) and its tower's blocks compiled too: the plain model's losses and
    summed gradients in both mixed cases, one balanced exchange per forward; TorchDynamo compiles
    the model's own code and none of the drop-in's or the engine's."""
    import torch.distributed as dist

    rank = dist.get_rank()
    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
    sources, block_sources = CompiledSources(), CompiledSources()
    for block in balanced.model.visual.blocks:
        block.compile(backend=block_sources)
    compiled = torch.compile(balanced, backend=sources)
    for step, name in enumerate(mixed_cases(family)):  # a text-only rank, then videos too
        where = f"{name} rank {rank}"
        batch = make_inputs(family, cases_for(family)[name][rank], seed=100 * step + rank)
        calls = handle.calls
        plain_loss = plain(**batch).loss
        plain_loss.backward()
        loss = compiled(**batch).loss
        loss.backward()
        assert handle.calls == calls + 1, f"{where}: {handle.calls - calls} balanced calls"
        # The eager backend runs the captured graphs' own ops: the plain model's values.
        torch.testing.assert_close(loss, plain_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
        _assert_same_grads(where, _summed_grads(balanced), _summed_grads(plain))
        plain.zero_grad(set_to_none=True)
        balanced.zero_grad(set_to_none=True)
    return {
        "applied_calls": handle.applied_calls,
        "drop_in_nodes": sources.traced_from("lightning_vit_balance"),
        "model_nodes": sources.traced_from(f"modeling_{family}.py"),
        "block_graphs": block_sources.graphs,
    }


def test_model_compiled_whole_matches_plain_model(multirank: Any) -> None:
    """``torch.compile(model)`` after balance_vision_tower: the plain model's losses and gradients.
    The drop-in's own forwards had TorchDynamo rebuild the tower's original forward as the patched
    one, which then called itself until Python's recursion limit; now they run eagerly, the model's
    forwards they call are compiled, and so are the tower's blocks inside the balanced call."""
    with multirank(2) as w:  # rank 1 text-only, then with images (TorchDynamo's tracing takes long)
        results = w.run(_compiled_whole, "qwen2_5_vl", timeout=240)
    for r in results:
        assert r["applied_calls"] == 2 and r["drop_in_nodes"] == 0, r
        assert r["model_nodes"] > 0 and r["block_graphs"] > 0, r


def _fsdp1_units(family: str, use_orig_params: bool) -> dict[str, Any]:
    """FSDP1 (``FullyShardedDataParallel`` on the CPU device, gloo) with each vision block and decoder
    layer a unit: the plain model's losses over four SGD steps, with ``use_orig_params`` its
    gradients too, then its evaluation losses and ``generate()`` tokens; then the tower's class in
    the wrap policy."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    rank, size = dist.get_rank(), dist.get_world_size()
    plain = tiny_model(family)
    inner = copy.deepcopy(plain)
    handle = balance_vision_tower(inner, ViTBalanceConfig(**CONFIG), evaluation=True)
    units = {type(inner.model.visual.blocks[0]), type(inner.model.language_model.layers[0])}
    cpu = torch.device("cpu")  # FSDP1 looks for an accelerator unless told the device
    policy = ModuleWrapPolicy(units)
    model = FSDP(inner, auto_wrap_policy=policy, use_orig_params=use_orig_params, device_id=cpu)
    for where, batch in _mixed_steps(family, rank):
        plain_loss, _ = _step(plain, batch)
        loss, _ = _step(model, batch)
        torch.testing.assert_close(loss, plain_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
        expected = _summed_grads(plain)
        if use_orig_params:  # the full gradients, averaged over ranks, under their own names
            with FSDP.summon_full_params(model, with_grads=True):
                _assert_averaged(where, _unwrapped_names(inner), expected, size, lambda g: g)
        _sgd(plain, expected)
        with torch.no_grad():
            if use_orig_params:  # the plain model's step, so the next starts from the same weights
                with FSDP.summon_full_params(model, writeback=True):
                    weights = dict(plain.named_parameters())
                    for key, param in _unwrapped_names(inner).items():
                        param.copy_(weights[key])
            else:  # SGD on the summed gradients: the next steps' losses are their only check
                for param in model.parameters():
                    if param.grad is not None:  # None: no element of this rank's shard is used
                        param -= SGD_LR * size * param.grad
        model.zero_grad(set_to_none=True)
    model.eval()
    plain.eval()
    with torch.no_grad():  # evaluation forwards gather the blocks too: balanced, every rank calls
        for where, batch in _mixed_steps(family, rank):
            torch.testing.assert_close(model(**batch).loss, plain(**batch).loss, **TOL, msg=where)
    # generate() on the wrapped module, the root's parameters gathered around it (the blocks gather
    # their own): its image encoding is balanced, as FSDP1's units are collectives.
    with FSDP.summon_full_params(model, recurse=False, writeback=False):
        assert_generates_as_plain(inner, plain, family)
    tower_unit = ModuleWrapPolicy({*units, type(inner.model.visual)})
    wrapped = FSDP(balance_vision_tower(tiny_model(family)).model, auto_wrap_policy=tower_unit, device_id=cpu)
    try:
        wrapped(**make_inputs(family, CASES["text_only_rank"][rank], seed=rank))
        error = None
    except ValueError as err:
        error = str(err)
    return {"calls": handle.calls, "applied_calls": handle.applied_calls, "error": error}


def _unwrapped_names(model: nn.Module) -> dict[str, nn.Parameter]:
    return {key.replace("_fsdp_wrapped_module.", ""): param for key, param in model.named_parameters()}


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_fsdp1_units_on_the_blocks(multirank: Any, use_orig_params: bool) -> None:
    """FSDP1 with the blocks and decoder layers as units: the plain model's losses, gradients,
    evaluation losses and generated tokens where ranks differ in modalities (the plain model aborts
    there: its text-only rank skips the blocks' parameter gathers). The tower's class in the wrap
    policy: an error naming the fix."""
    with multirank(RANKS) as w:
        results = w.run(_fsdp1_units, "qwen2_5_vl", use_orig_params, timeout=240)
    generated = len(mixed_cases("qwen2_5_vl"))
    for r in results:  # four training and four evaluation forwards, and each generate()
        assert r["calls"] == 2 * 4 + generated and r["applied_calls"] >= 2 * 4, r
        assert "visual was replaced by a FullyShardedDataParallel" in r["error"], r


#: LoRA on the decoder's attention and the vision blocks' ``qkv``, both adapters random (PEFT's
#: default zero ``B`` would leave ``A`` without a gradient in the first step).
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "qkv"], "init_lora_weights": False}


def _with_lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)  # the same adapters for the plain and the balanced model
    return get_peft_model(model, LoraConfig(**LORA))


def _lora_steps(family: str) -> dict[str, Any]:
    """PEFT LoRA applied before and after :func:`balance_vision_tower`: the plain LoRA model's losses
    and summed gradients over two steps of each mixed case; only the adapters train."""
    import torch.distributed as dist

    rank = dist.get_rank()
    results = {}
    for order in ("before", "after"):
        base = tiny_model(family)
        plain = _with_lora(copy.deepcopy(base))
        if order == "before":
            balanced = _with_lora(base)
            handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
        else:
            handle = balance_vision_tower(base, ViTBalanceConfig(**CONFIG))
            balanced = _with_lora(base)
        assert BalancedVisionTower.of(balanced) is handle
        applied, tower_grad = [], 0.0
        for step, batch in _mixed_steps(family, rank):
            where = f"LoRA {order} {step}"
            plain_loss, _ = _step(plain, batch)
            balanced_loss, _ = _step(balanced, batch)
            torch.testing.assert_close(
                balanced_loss, plain_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}"
            )
            plain_grads, balanced_grads = _summed_grads(plain), _summed_grads(balanced)
            _assert_same_grads(where, balanced_grads, plain_grads)
            tower_grad += sum(
                float(g.norm()) for k, g in balanced_grads.items() if ".visual." in k and "lora_" in k
            )
            applied.append(handle.last_stats.applied)
            _sgd(plain, plain_grads)
            _sgd(balanced, plain_grads)  # the same weights next step (see _check_case)
        trainable = sorted(k for k, p in balanced.named_parameters() if p.requires_grad)
        results[order] = {"applied": applied, "tower_lora_grad": tower_grad, "trainable": trainable}
    return results


def _autocast_steps(family: str) -> dict[str, Any]:
    """Each mixed case once under CPU bf16 autocast (what Lightning's ``bf16-mixed`` runs), from the
    same weights: the plain model's loss and summed gradients at bf16's precision."""
    import torch.distributed as dist

    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
    once = len(mixed_cases(family))
    for where, batch in itertools.islice(_mixed_steps(family, dist.get_rank()), once):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected_loss, got_loss = plain(**batch).loss, balanced(**batch).loss
        expected_loss.backward()
        got_loss.backward()
        # Matmuls round to bf16 (8 significant bits, 3.9e-3) and the balanced batches sum in
        # another order: losses agree to 1e-3 and each gradient to 4% of its largest entry (0.9%
        # at most seen); a misrouted image moves either at O(1).
        torch.testing.assert_close(got_loss, expected_loss, rtol=1e-3, atol=0.0, msg=where)
        got, expected = _summed_grads(balanced), _summed_grads(plain)
        for key, grad in expected.items():
            atol = 0.04 * float(grad.abs().max())
            label = f"{where}: grad {key}"
            torch.testing.assert_close(got[key], grad, rtol=0, atol=atol, msg=lambda m, w=label: f"{w}: {m}")
        plain.zero_grad(set_to_none=True)
        balanced.zero_grad(set_to_none=True)
    return {"applied_calls": handle.applied_calls}


def test_bf16_autocast_matches_the_plain_model(multirank: Any) -> None:
    """Under bf16 autocast the towers' outputs are bf16 on every rank (a text-only rank's dummy
    call too), so they travel back as bf16; losses and gradients are the plain model's at bf16's
    precision (Qwen2.5-VL: window attention)."""
    with multirank(RANKS) as w:
        results = w.run(_autocast_steps, "qwen2_5_vl", timeout=120)
    assert all(r["applied_calls"] == len(mixed_cases("qwen2_5_vl")) for r in results), results


@pytest.mark.timeout(180)
def test_peft_lora_before_or_after_the_drop_in(multirank: Any) -> None:
    """LoRA adapters in the vision blocks train through the balanced call, whichever is applied first."""
    pytest.importorskip("peft")
    with multirank(RANKS) as w:
        results = w.run(_lora_steps, "qwen2_5_vl", timeout=150)
    for order in ("before", "after"):
        per_rank = [r[order] for r in results]
        assert len({tuple(r["applied"]) for r in per_rank}) == 1  # every rank made the same plans
        assert any(per_rank[0]["applied"]), per_rank[0]
        assert all(r["tower_lora_grad"] > 0 for r in per_rank), per_rank
        # Only adapters train, in the decoder and in the tower.
        trainable = per_rank[0]["trainable"]
        assert trainable and all("lora_" in k for k in trainable), trainable
        assert any(".visual." in k for k in trainable), trainable


def _tower_hooks(family: str) -> list[dict[str, Any]]:
    """Forward hooks on the tower module itself, counted per balanced forward on this rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = tiny_model(family)
    handle = balance_vision_tower(model, ViTBalanceConfig(**CONFIG))
    tower = model.model.visual
    calls: dict[str, int] = {"pre": 0, "post": 0, "late": 0}

    def count(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            calls[name] += 1

        return hook

    tower.register_forward_pre_hook(count("pre"))
    tower.register_forward_hook(count("post"))
    late: list[Any] = []

    def register_late(*_: Any) -> None:
        # A hook registered on the tower while the model's own tower calls are answered is kept.
        if not late:
            late.append(tower.register_forward_hook(count("late")))

    model.model.language_model.layers[0].register_forward_pre_hook(register_late)
    seen = []
    for where, batch in _mixed_steps(family, rank):
        before = dict(calls)
        model(**batch).loss.backward()
        seen.append({"where": where, **{k: calls[k] - before[k] for k in calls}})
    return [*seen, {"applied_calls": handle.applied_calls}]


def test_tower_hooks_run_once_per_forward_on_every_rank(multirank: Any) -> None:
    """The tower's own hooks run for the balanced call only, not for the model's per-modality tower
    calls the drop-in answers (one per modality a rank has): the same count on every rank, as
    ZeRO-3, which records the order of module calls and requires it identical on every rank, needs."""
    with multirank(RANKS) as w:
        results = w.run(_tower_hooks, "qwen2_5_vl", timeout=120)
    for per_rank in results:
        *steps, summary = per_rank
        assert summary["applied_calls"] == 4, per_rank
        for i, step in enumerate(steps):
            # Registered during the first forward, so it runs from the second on.
            assert (step["pre"], step["post"], step["late"]) == (1, 1, int(i > 0)), step


def _eval_and_no_grad_are_direct(family: str) -> dict[str, Any]:
    """Rank 0 alone runs an eval forward and a no-grad training-mode forward, then ``generate()``
    with evaluation forwards balanced: nothing collective."""
    import torch.distributed as dist

    rank = dist.get_rank()
    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
    generating = copy.deepcopy(plain)
    generating_handle = balance_vision_tower(generating, ViTBalanceConfig(**CONFIG), evaluation=True)
    counter = CollectiveCounter()
    if rank == 0:
        batch = make_inputs(family, [{"images": [(1, 4, 4)], "videos": [(2, 2, 2)]}], seed=5)
        with counter.active():
            with torch.no_grad():
                train_mode = balanced(**batch).logits
                # A batch made to be planned ahead: a no-grad forward plans nothing either.
                planned_ahead = balanced(**handle.plan_ahead(_first)([dict(batch)])).logits
            balanced.eval()
            eval_mode = balanced(**batch).logits
        plain.eval()
        reference = plain(**batch).logits
        assert torch.equal(eval_mode, reference)
        torch.testing.assert_close(train_mode, reference, **TOL)
        torch.testing.assert_close(planned_ahead, reference, **TOL)
        prompt = generation_prompt(generating, batch)
        generating.eval()
        with counter.active():
            tokens = generating.generate(**prompt, max_new_tokens=3, do_sample=False)
        assert torch.equal(tokens, plain.generate(**prompt, max_new_tokens=3, do_sample=False))
    calls = handle.calls + generating_handle.calls
    return {"collectives": len(counter.calls), "calls": calls}


def test_eval_no_grad_and_generate_forwards_are_not_balanced(multirank: Any) -> None:
    with multirank(RANKS) as w:
        results = w.run(_eval_and_no_grad_are_direct, "qwen2_vl", timeout=120)
    assert results == [{"collectives": 0, "calls": 0}] * RANKS


def assert_generates_as_plain(model: nn.Module, plain: nn.Module, family: str) -> None:
    """``generate()`` of the :func:`mixed_cases` on every rank (``synced_gpus``, as sharded
    parameters need), each rank a different number of tokens: ``model``'s tokens are ``plain``'s."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for name in mixed_cases(family):
        prompt = generation_prompt(plain, make_inputs(family, cases_for(family)[name][rank], seed=11 + rank))
        settings = generation_settings(rank)
        with torch.no_grad():
            tokens = model.generate(**prompt, **settings, synced_gpus=True)
            assert torch.equal(tokens, plain.generate(**prompt, **settings)), f"generate {name}"


def _evaluation_under_fsdp2(family: str) -> dict[str, Any]:
    """FSDP2 (blocks and layers as units) and ``evaluation=True``: eval and no-grad forwards of a
    text-only rank next to images and videos are balanced, with the plain model's losses; so is
    ``generate()``'s image encoding, with the plain model's tokens."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    plain = tiny_model(family).eval()
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG), evaluation=True)
    for unit in [*balanced.model.visual.blocks, *balanced.model.language_model.layers, balanced]:
        fully_shard(unit)
    for where, batch in _mixed_steps(family, rank):
        expected = plain(**batch).loss
        with torch.no_grad():
            got = balanced(**batch).loss
        torch.testing.assert_close(got, expected, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
    # Its image encoding (before the first forward in transformers 5, in it in 4) is balanced.
    assert_generates_as_plain(balanced, plain, family)
    return {"calls": handle.calls, "applied_calls": handle.applied_calls}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "glm4v"])
def test_evaluation_forwards_balanced_under_fsdp2(multirank: Any, family: str) -> None:
    """Without ``evaluation`` these forwards and ``generate()`` calls crash (a text-only rank skips
    the tower's parameter gathers), as with the plain model. GLM-4.1V: its videos one temporal step
    per grid row, in the forward and in ``generate()``'s encoding (transformers 5)."""
    skip_without_fsdp2()
    with multirank(RANKS) as w:
        results = w.run(_evaluation_under_fsdp2, family, timeout=120)
    # 4 forwards and 2 generate() encodings, all balanced (images move in every one).
    assert results == [{"calls": 6, "applied_calls": 6}] * RANKS


def _generate_under_fsdp2_with_a_projection(family: str) -> list[int]:
    """FSDP2 with the tower's blocks, the tower and the decoder layers as units, the projection
    outside the tower in the root unit or a unit of its own: training forwards and backwards, then
    evaluation forwards with the plain model's losses and ``generate()`` with its tokens, ranks
    differing in modalities throughout. Returns the balanced calls per layout."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_vit_balance.hf import _zero3_leaves

    rank = dist.get_rank()
    calls = []
    for own_unit in (False, True):
        plain = tiny_model(family)
        balanced = copy.deepcopy(plain)
        handle = balance_vision_tower(balanced, config_for(family), evaluation=True)
        projection = [getattr(handle.base, name) for name in handle.projection] if own_unit else []
        layers = [*getattr(handle.base.language_model, "layers", [])]
        for unit in [*_zero3_leaves(handle.tower, []), handle.tower, *projection, *layers, balanced]:
            fully_shard(unit)
        for _, batch in _mixed_steps(family, rank):
            balanced(**batch).loss.backward()
        balanced.eval()
        plain.eval()
        for where, batch in _mixed_steps(family, rank):
            with torch.no_grad():
                got, expected = balanced(**batch).loss, plain(**batch).loss
            torch.testing.assert_close(got, expected, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
        assert_generates_as_plain(balanced, plain, family)
        calls.append(handle.calls)
    return calls


@pytest.mark.parametrize("family", ["kimi_k25", "paddleocr_vl"])
def test_generate_under_fsdp2_where_the_projection_is_outside_the_tower(multirank: Any, family: str) -> None:
    """``generate()`` encodes images outside the forward (transformers 5), where the projection's
    parameters are gathered only by its unit (the root's or its own): balanced, every rank calls it
    alike, and the tokens are the plain model's."""
    skip_without_fsdp2()
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    with multirank(RANKS) as w:
        results = w.run(_generate_under_fsdp2_with_a_projection, family, timeout=120)
    # Per layout: 4 training forwards, 4 evaluation forwards and 2 generate() encodings.
    assert results == [[10, 10]] * RANKS, results


#: One long video on rank 0 and little elsewhere: whole, it outweighs the mean load on its own.
LONG_VIDEO = [[{"videos": [(4, 4, 4)]}], [{}], [{"images": [(1, 2, 2)]}]]


def _long_video(families: tuple[str, ...]) -> dict[str, Any]:
    """The drop-in's default configuration (``split_videos``) spreads the video's temporal steps
    over the ranks, with the plain model's loss and gradients; with whole videos the step skips."""
    import torch.distributed as dist

    rank = dist.get_rank()
    seen = {}
    for family in families:
        plain = tiny_model(family)
        batch = make_inputs(family, LONG_VIDEO[rank], seed=rank)
        plain_loss, _ = _step(plain, batch)
        expected = _summed_grads(plain)
        for name, config in (("default", None), ("whole videos", ViTBalanceConfig())):
            model = copy.deepcopy(plain)
            model.zero_grad(set_to_none=True)
            handle = balance_vision_tower(model, config)
            loss, _ = _step(model, batch)
            where = f"{family}, {name}"
            torch.testing.assert_close(loss, plain_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
            _assert_same_grads(where, _summed_grads(model), expected)
            stats = handle.last_stats
            seen[where] = (stats.reason, stats.num_images, stats.moved_images)
    return seen


def test_a_long_video_is_spread_step_by_step(multirank: Any) -> None:
    with multirank(RANKS) as w:
        results = w.run(_long_video, ("qwen2_5_vl", "qwen3_vl"), timeout=120)
    assert all(r == results[0] for r in results), results
    for family in ("qwen2_5_vl", "qwen3_vl"):
        reason, items, moved = results[0][f"{family}, default"]
        # 4 temporal steps and 1 image; the steps go where the load is lowest.
        assert (reason, items) == ("applied", 5) and moved >= 2, results[0]
        # Whole, the video outweighs the mean load: no plan lowers the makespan enough.
        assert results[0][f"{family}, whole videos"] == ("no-gain", 2, 0), results[0]


def _videos_step_by_step(family: str) -> dict[str, Any]:
    """A model that breaks the contract at run time: it passes the tower its videos one temporal
    step per grid row (GLM's way) where the drop-in expects the whole grid. That call matches no
    modality, and the video rank encodes it directly: the plain model's losses and gradients."""
    import warnings

    import torch.distributed as dist

    from lightning_vit_balance.exchange import grid_steps

    rank = dist.get_rank()
    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    for model in (plain, balanced):
        base = model.model
        encode = type(base).get_video_features
        base.get_video_features = lambda pixels, grid, *a, b=base, f=encode, **k: f(
            b, pixels, grid_steps(grid), *a, **k
        )
    handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            batch = make_inputs(
                family, CASES["images_and_videos_next_to_images"][rank], seed=10 * step + rank
            )
            plain_loss, _ = _step(plain, batch)
            balanced_loss, _ = _step(balanced, batch)
            torch.testing.assert_close(balanced_loss, plain_loss, **TOL)
            plain_grads, balanced_grads = _summed_grads(plain), _summed_grads(balanced)
            _assert_same_grads(f"step {step} rank {rank}", balanced_grads, plain_grads)
            _sgd(plain, plain_grads)
            _sgd(balanced, plain_grads)  # the same weights next step (see _check_case)
    # Not the once-said note that CONFIG leaves the tower's cost model and split_videos behind.
    warned = [
        str(w.message)
        for w in caught
        if issubclass(w.category, RuntimeWarning) and "replaces the drop-in's default" not in str(w.message)
    ]
    return {"unmatched": handle.unmatched_calls, "calls": handle.calls, "warned": warned}


def test_a_tower_call_matching_no_modality_is_encoded_directly(multirank: Any) -> None:
    """No error and no rank left waiting: only the rank with videos makes such a call, and warns once."""
    with multirank(RANKS) as w:
        results = w.run(_videos_step_by_step, "qwen2_vl", timeout=120)
    assert [r["calls"] for r in results] == [2] * RANKS
    assert [r["unmatched"] for r in results] == [2, 0, 0]
    assert len(results[0]["warned"]) == 1 and "encoded directly" in results[0]["warned"][0], results[0]
    assert results[1]["warned"] == results[2]["warned"] == []


def _hidden_state_losses(family: str, return_dict: bool) -> dict[str, Any]:
    """A loss on the decoder's last hidden state as ``output_hidden_states=True`` gives it
    (``hidden_states[-1]``, the very tensor ``last_hidden_state`` is: pooled embeddings, value heads),
    rank 1 text only: it reaches the balanced call there too, or the other ranks wait in the
    backward exchange. The plain model's losses and summed gradients. Transformers 4.x's models
    for generation record their own ``hidden_states``, the last one before the final norm (README
    "Limitations"): there the base model's."""
    import torch.distributed as dist
    import transformers

    rank = dist.get_rank()
    whole = not transformers.__version__.startswith("4.")
    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, config_for(family))
    samples = [[{"images": [(1, 8, 8)]}, {"images": [(1, 4, 4)]}], [{}], [{"images": [(1, 2, 2)]}]][rank]
    batch = make_inputs(family, samples, seed=rank)
    batch.pop("labels")
    losses = []
    for model in (plain, balanced):
        forward = model if whole else model.model
        output = forward(**batch, output_hidden_states=True, return_dict=return_dict)
        # As a tuple: the field of the layers' [B, L, D] states (the cache is an object).
        tuples = [f for f in output if isinstance(f, tuple) and all(isinstance(t, torch.Tensor) for t in f)]
        hidden_states = output.hidden_states if return_dict else next(f for f in tuples if f[0].dim() == 3)
        losses.append(hidden_states[-1].float().pow(2).mean())
        losses[-1].backward()
    torch.testing.assert_close(losses[1], losses[0], **TOL)
    _assert_same_grads(f"rank {rank}", _summed_grads(balanced), _summed_grads(plain))
    return {"applied": handle.applied_calls}


@pytest.mark.parametrize("return_dict", [True, False])
def test_a_loss_on_the_last_hidden_state_reaches_every_rank(multirank: Any, return_dict: bool) -> None:
    with multirank(RANKS) as w:
        results = w.run(_hidden_state_losses, FIT_FAMILY, return_dict, timeout=120)
    assert results == [{"applied": 1}] * RANKS, results


def _retrieval_inputs(rank: int, seed: int) -> dict[str, Any]:
    """ColQwen2's inputs: a document page (one image per sample, its rows padded to the longest) on
    ranks 0 and 2, a text query alone on rank 1."""
    pages = [[(1, 8, 8), (1, 4, 6)], [], [(1, 6, 6)]][rank]
    batch = make_inputs("qwen2_vl", [{"images": [page]} for page in pages] or [{}], seed=seed)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if pages:
        rows = [t * h * w for t, h, w in pages]
        padded = torch.zeros(len(pages), max(rows), batch["pixel_values"].shape[1])
        for i, (start, count) in enumerate(zip([0, *itertools.accumulate(rows)], rows)):
            padded[i, :count] = batch["pixel_values"][start : start + count]
        inputs.update(pixel_values=padded, image_grid_thw=batch["image_grid_thw"])
    return inputs


def _retrieval_model_steps() -> dict[str, Any]:
    """ColQwen2 calls its Qwen2-VL tower itself, then the base forward with the embeddings: the
    drop-in cannot balance that call. It is encoded as the plain model does, with one warning on
    each rank that makes it, and no rank waits: the plain model's embeddings and gradients."""
    import warnings

    import torch.distributed as dist
    import transformers

    rank = dist.get_rank()
    torch.manual_seed(0)
    plain = transformers.ColQwen2ForRetrieval(
        transformers.ColQwen2Config(vlm_config=tiny_config("qwen2_vl"), embedding_dim=8)
    ).train()
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced, ViTBalanceConfig(**CONFIG))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            inputs = _retrieval_inputs(rank, seed=10 * step + rank)
            losses = []
            for model in (plain, balanced):
                embeddings = model(**inputs).embeddings
                weights = torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(step))
                losses.append((embeddings * weights).sum())
                losses[-1].backward()
            torch.testing.assert_close(losses[1], losses[0], **TOL)
            plain_grads, balanced_grads = _summed_grads(plain), _summed_grads(balanced)
            _assert_same_grads(f"step {step} rank {rank}", balanced_grads, plain_grads)
            _sgd(plain, plain_grads)
            _sgd(balanced, plain_grads)  # the same weights next step (see _check_case)
    warned = [str(w.message) for w in caught if "vision tower outside" in str(w.message)]
    return {"unmatched": handle.unmatched_calls, "calls": handle.calls, "warned": warned}


def test_a_model_calling_its_tower_itself_is_told_it_is_not_balanced(multirank: Any) -> None:
    """No silent no-op: the ranks whose model calls the tower itself (ColQwen2's pages) warn once."""
    import transformers

    if not hasattr(transformers, "ColQwen2ForRetrieval"):
        pytest.skip("this transformers has no ColQwen2")
    with multirank(RANKS) as w:
        results = w.run(_retrieval_model_steps, timeout=120)
    assert [r["calls"] for r in results] == [2] * RANKS  # the base forward's call, empty everywhere
    assert [r["unmatched"] for r in results] == [2, 0, 2]
    assert [len(r["warned"]) for r in results] == [1, 0, 1], results
    assert (
        "ColQwen2ForRetrieval called its vision tower outside Qwen2VLModel.forward" in results[0]["warned"][0]
    )


def _bad_input_on_rank_1(family: str, ahead: str | None, grid: str) -> str:
    """Rank 1 passes image pixels without their grid (``grid="none"``), with a grid of 4 columns
    (``"4 columns"``) or as flat rows where the tower takes patch images (``"flat pixels"``),
    or prepares a tuple of the batch's values (``"tuple"``), planned in the forward or ahead
    (``ahead``, as in :func:`_check_case`); every rank must raise, none may hang."""
    import torch.distributed as dist

    model = tiny_model(family)
    handle = balance_vision_tower(model, config_for(family))
    # Rows cut after the plan are seen in a call that moves images (one that moves none raises at
    # the next gather): one of rank 0's three images moves.
    images = 3 if grid == "short rows" and dist.get_rank() == 0 else 1
    batch = make_inputs(family, [{"images": [(1, 4, 4)] * images}], seed=dist.get_rank())
    prepared: Any = batch
    if dist.get_rank() == 1 and grid == "flat pixels":
        batch["pixel_values"] = batch["pixel_values"].reshape(16, -1)
    elif dist.get_rank() == 1 and grid == "tuple":
        prepared = tuple(batch.values())
    elif dist.get_rank() == 1 and grid in ("none", "4 columns"):
        batch["image_grid_thw"] = None if grid == "none" else torch.tensor([[1, 4, 4, 1]])
    with caught(ValueError) as outcome:
        if ahead == "prepare":
            handle.prepare(prepared)
        elif ahead == "collator":
            batch = handle.plan_ahead(_first)([batch])
        if dist.get_rank() == 1 and grid == "short rows":  # after the plan, which holds all of them
            batch = {**batch, "pixel_values": batch["pixel_values"][:-4]}
        model(**batch)
    return outcome.message


@pytest.mark.parametrize(
    ("ahead", "grid", "says"),
    [
        (None, "none", "image_grid_thw is None"),
        (None, "4 columns", "image_grid_thw is a tensor of shape (1, 4)"),
        ("prepare", "none", "grid_thw is None, not a torch.Tensor"),
        ("prepare", "4 columns", "grid_thw has shape (1, 4)"),
        ("collator", "4 columns", "grid_thw has shape (1, 4)"),
        ("prepare", "tuple", "On this rank: the batch is a tuple, not a mapping"),
        # Rows the drop-in cannot join with their grid: every rank names that cause (the others had
        # read a missing grid_thw, a type error nobody made); with a plan made ahead, the cause itself.
        (None, "short rows", "rank 1: its images and videos could not be encoded together"),
        ("prepare", "short rows", "could not be encoded together: pixel_values has 12 rows"),
    ],
)
def test_bad_input_on_one_rank_raises_on_every_rank(
    multirank: Any, ahead: str | None, grid: str, says: str
) -> None:
    """Also when the plan is made ahead: reading the grid rows there raised on the rank at fault
    alone, and the others waited in the gather (until the backend's timeout)."""
    with multirank(RANKS) as w:
        messages = w.run(_bad_input_on_rank_1, "qwen3_vl", ahead, grid, timeout=120)
    assert all("rank 1" in m for m in messages), messages
    assert says in messages[1], messages[1]
    if grid == "short rows":
        assert all(says in m for m in messages), messages


def test_rows_that_disagree_with_the_plan_name_which_side_is_off() -> None:
    """Rows that match their own grid but not the prepared plan's rows (the plan made from the
    modalities in another order): the detail said the grid held the plan's count."""
    rows, grid = torch.zeros(4, 3), torch.tensor([[1, 2, 2]])
    planned = _modality_rows("images[0]", rows, "images[1]", grid, (), ((2, 2, 2),))
    assert planned == "images[0] has 4 rows, as images[1] says; the prepared plan holds 8", planned
    unplanned = _modality_rows("images[0]", torch.zeros(5, 3), "images[1]", grid, (), None)
    assert unplanned == "images[0] has 5 rows: images[1] says 4", unplanned
    neither = _modality_rows("images[0]", torch.zeros(5, 3), "images[1]", grid, (), ((2, 2, 2),))
    assert neither == "images[0] has 5 rows: images[1] says 4; the prepared plan holds 8", neither
    meta = _modality_rows("images[0]", rows, "images[1]", grid.to("meta"), (), ((2, 2, 2),))
    assert meta == "images[0] has 4 rows: the prepared plan holds 8", meta  # no values to read
    assert _modality_rows("images[0]", rows, "images[1]", grid, (), ((1, 2, 2),))[1] == ((1, 2, 2),)


def test_kimi_k25_moves_videos_whole_and_refuses_what_would_differ(multirank: Any) -> None:
    """Kimi-K2.5's tower attends over a whole video and pools its frames: videos move whole (two of
    2 and 3 steps here), planned ahead from its patch-image pixels, and the pooled rows the model
    reads are the plain model's. ``split_videos`` (which would change them) is refused before any
    collective, and flat pixel rows on one rank raise on every rank, also where the plan is made
    ahead (flat rows would plan, then fail in the forward on that rank alone)."""
    if not available("kimi_k25"):
        pytest.skip("this transformers has no kimi_k25")
    handle = balance_vision_tower(tiny_model("kimi_k25"))
    assert handle.output_layout == OutputLayout(merge_size=2)  # no spatial_merge_size to read
    with pytest.raises(ValueError, match=r"split_videos=True\) is invalid for Kimi_K25Model"):
        handle._balancer_for(ViTBalanceConfig(split_videos=True), None)
    names = ("videos_moved_whole",)
    with multirank(RANKS) as w:
        per_rank = w.run(_check_cases, "kimi_k25", names, "prepare", timeout=240)
        refusals = [
            w.run(_bad_input_on_rank_1, "kimi_k25", ahead, "flat pixels", timeout=120)
            for ahead in (None, "prepare")
        ]
    assert _assert_cases(per_rank, names) >= 2
    says = "pixel_values is a tensor of shape (16, 12): expected a tensor [S, 3, 2, 2]"
    for messages in refusals:
        assert all("rank 1" in m for m in messages), messages
        assert says in messages[1], messages[1]


# --------------------------------------------------------------------------- encode_visual


def _encode_visual_worker(tower_name: str, prepared: bool = False) -> dict[str, Any]:
    """Images and videos in one exchange == two direct calls; a rank with neither takes part. With
    ``prepared``, the plan is made first from the images' rows followed by the videos', and the call
    reads no grid's values (``grid_rows`` in :mod:`lightning_vit_balance.hf`, counted)."""
    import torch.distributed as dist
    import towers

    rank = dist.get_rank()
    torch.manual_seed(0)
    vit = towers.WindowTower() if tower_name == "window" else towers.qwen3_vl_tower().train()
    given = {
        0: {"images": [(1, 8, 8), (1, 2, 2)], "videos": [(2, 4, 4)]},
        1: {"videos": [(1, 4, 2)]},
        2: {},
    }[rank]
    inputs = {}
    for seed, kind in enumerate(("images", "videos")):
        if kind in given:
            inputs[kind] = towers.make_batch(given[kind], seed=10 * rank + seed)
        elif tower_name == "window":
            # This tower's config does not tell C: an absent modality is passed as zero rows.
            inputs[kind] = (torch.zeros(0, CHANNELS), torch.zeros(0, 3, dtype=torch.long))
        else:
            inputs[kind] = None
    # The test tower attends over a whole video: its videos must stay whole.
    balancer = ViTBalancer(ViTBalanceConfig(**{**CONFIG, "split_videos": tower_name != "window"}))
    ticket, reads = None, []
    if prepared:
        given_inputs = [value for value in (inputs["images"], inputs["videos"]) if value is not None]
        pixels = torch.cat([p for p, _ in given_inputs]) if given_inputs else torch.zeros(0, CHANNELS)
        grid = (
            torch.cat([g for _, g in given_inputs]) if given_inputs else torch.zeros(0, 3, dtype=torch.long)
        )
        ticket = balancer.prepare(pixels, grid, vit)
    original = hf.grid_rows
    hf.grid_rows = lambda grid: reads.append(grid) or original(grid)  # type: ignore[assignment]
    counter = CollectiveCounter()
    try:
        with counter.active():
            image_out, video_out = encode_visual(
                vit, inputs["images"], inputs["videos"], balancer=balancer, prepared=ticket
            )
    finally:
        hf.grid_rows = original  # type: ignore[assignment]
    loss = torch.zeros(())
    for out in (image_out, video_out):
        for k, (_, leaf) in enumerate(flatten_output(out)[0]):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                loss = loss + (leaf * (k + 1)).sum()
    loss.backward()
    for kind, out in (("images", image_out), ("videos", video_out)):
        if kind not in given:
            continue
        direct = vit(*inputs[kind])
        for (path, got), (_, want) in zip(flatten_output(out)[0], flatten_output(direct)[0]):
            if isinstance(want, torch.Tensor) and want.is_floating_point():
                torch.testing.assert_close(got, want, **TOL, msg=lambda m, p=f"{kind} {path}": f"{p}: {m}")
            elif isinstance(want, torch.Tensor):
                assert torch.equal(got, want), (kind, path)  # the window index, renumbered per modality
    rows = [
        leaf.shape[0]
        for out in (image_out, video_out)
        for _, leaf in flatten_output(out)[0]
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
    ]
    return {
        "collectives": len(counter.calls),
        "stats_collectives": balancer.last_stats.collectives,
        "applied": balancer.last_stats.applied,
        "rows": rows,
        "tower_grads": all(p.grad is not None for p in vit.parameters()),
        "grid_reads": len(reads),
    }


@pytest.mark.parametrize(
    ("tower_name", "prepared"), [("window", False), ("qwen3_vl", False), ("window", True), ("qwen3_vl", True)]
)
def test_encode_visual_encodes_images_and_videos_in_one_exchange(
    multirank: Any, tower_name: str, prepared: bool
) -> None:
    with multirank(RANKS) as w:
        results = w.run(_encode_visual_worker, tower_name, prepared, timeout=120)
    assert all(r["applied"] for r in results)
    assert all(r["collectives"] == r["stats_collectives"] == results[0]["collectives"] for r in results)
    # With a plan made ahead the grid rows are the plan's: none is read (a device-to-host copy on a GPU).
    reads = [r["grid_reads"] for r in results]
    assert reads == [0] * RANKS if prepared else reads[0] == 2, reads  # rank 0: its images' and videos' grids
    assert results[2]["rows"] and not any(results[2]["rows"])  # zero rows on the rank with nothing
    assert all(r["tower_grads"] for r in results)


def test_encode_visual_without_a_balancer_calls_the_vit_once() -> None:
    import towers

    torch.manual_seed(0)
    vit = towers.WindowTower()
    images, videos = towers.make_batch([(1, 4, 4)], seed=1), towers.make_batch([(2, 2, 2)], seed=2)
    image_out, video_out = encode_visual(vit, images, videos)
    torch.testing.assert_close(image_out[0], vit(*images)[0], **TOL)
    assert torch.equal(video_out[1], vit(*videos)[1])
    empty = (torch.zeros(0, CHANNELS), torch.zeros(0, 3, dtype=torch.long))
    nothing, _ = encode_visual(vit, empty, None)
    assert nothing[0].shape == (0, 24) and nothing[1].shape == (0,)
    with pytest.raises(TypeError, match=r"encode_visual\(images=a tensor"):
        encode_visual(vit, images[0])
    for name, expected in (("balancer", "ViTBalancer"), ("prepared", "PreparedPlan")):
        with pytest.raises(
            TypeError, match=rf"encode_visual\({name}=an? int\) is invalid: expected a {expected}"
        ):
            encode_visual(vit, images, **{name: 3})  # had met an AttributeError of its own
    # Rows that do not match their grid, with a balancer that calls the ViT directly (one process,
    # or disabled): refused by name, as without one (they had reached the ViT as a grid object); a
    # tower whose config tells no width is not told "no rows were given" as well.
    short = (images[0][:-4], images[1])
    for balancer in (None, ViTBalancer(ViTBalanceConfig()), ViTBalancer(ViTBalanceConfig(enabled=False))):
        with pytest.raises(ValueError, match=r"images\[0\] has 12 rows: images\[1\] says 16\.$"):
            encode_visual(towers.TensorTower(), short, None, balancer=balancer)


PER_IMAGE = {"pooled": "image", "queries": "image", "sizes": "image"}
# Per rank: (images, videos); rank 2 has neither.
PER_IMAGE_GRIDS = [([(1, 8, 8), (1, 4, 4)], [(2, 4, 4)]), ([(1, 2, 2)], []), ([], [])]


def _per_image_visual_worker() -> dict[str, Any]:
    """encode_visual of a tower with rows per image: each modality gets its own images' rows."""
    import torch.distributed as dist
    import towers

    rank = dist.get_rank()
    torch.manual_seed(0)
    vit = towers.PerImageTower()
    images, videos = (
        towers.make_batch(grids, seed=10 * rank + k) for k, grids in enumerate(PER_IMAGE_GRIDS[rank])
    )
    balancer = ViTBalancer(ViTBalanceConfig(trigger_threshold=0.0), output_layout=PER_IMAGE)
    image_out, video_out = encode_visual(vit, images, videos, balancer=balancer)
    for out, (pixels, grid) in ((image_out, images), (video_out, videos)):
        want = (
            vit(pixels, grid)
            if grid.shape[0]
            else {k: v[:0] for k, v in vit(*towers.make_batch([(1, 2, 2)], 0)).items()}
        )
        for key, value in want.items():
            torch.testing.assert_close(out[key], value, **TOL, msg=lambda m, k=key: f"rank {rank} {k}: {m}")
    sum(
        out[key].float().sum() for out in (image_out, video_out) for key in ("tokens", "pooled", "queries")
    ).backward()
    return {
        "applied": balancer.last_stats.applied,
        "rows": [tuple(out["pooled"].shape) for out in (image_out, video_out)],
    }


def test_encode_visual_cuts_rows_per_image_between_images_and_videos(multirank: Any) -> None:
    with multirank(RANKS) as w:
        results = w.run(_per_image_visual_worker, timeout=120)
    assert all(r["applied"] for r in results)
    assert [r["rows"] for r in results] == [[(2, 24), (1, 24)], [(1, 24), (0, 24)], [(0, 24), (0, 24)]]


def test_encode_visual_without_a_balancer_takes_an_output_layout() -> None:
    import towers

    torch.manual_seed(0)
    vit = towers.PerImageTower()
    images, videos = towers.make_batch([(1, 4, 4), (1, 2, 2)], seed=1), towers.make_batch([(2, 2, 2)], seed=2)
    image_out, video_out = encode_visual(vit, images, videos, output_layout=PER_IMAGE)
    for out, given in ((image_out, images), (video_out, videos)):
        for key, value in vit(*given).items():
            torch.testing.assert_close(out[key], value, **TOL)
    with pytest.raises(ValueError, match="'pooled' has 3 rows, as many as its batch's images"):
        encode_visual(vit, images, videos)
    # Neither modality: zero rows of every output, per image too; outputs named "drop" are None.
    empty = (torch.zeros(0, towers.CHANNELS), torch.zeros(0, 3, dtype=torch.long))
    nothing, _ = encode_visual(vit, empty, None, output_layout=PER_IMAGE)
    assert nothing["queries"].shape == (0, 3, 24) and nothing["sizes"].shape == (0,)
    image_out, video_out = encode_visual(vit, images, videos, output_layout={**PER_IMAGE, "tokens": "drop"})
    assert image_out["tokens"] is None and video_out["tokens"] is None
    balancer = ViTBalancer(ViTBalanceConfig(), output_layout={"pooled": "image"})
    with pytest.raises(ValueError, match=r"encode_visual\(output_layout=.*\) is invalid: the balancer's is"):
        encode_visual(vit, images, videos, balancer=balancer, output_layout=PER_IMAGE)


# --------------------------------------------------------------------------- one process


def test_one_process_calls_the_model_unchanged() -> None:
    """Without torch.distributed (or with one rank) nothing is balanced: the forward is recorded as
    ``single-rank``, as ``ViTBalancer`` records its own direct calls."""
    plain = tiny_model("qwen2_5_vl")
    balanced = copy.deepcopy(plain)
    handle = balance_vision_tower(balanced)
    batch = make_inputs("qwen2_5_vl", [{"images": [(1, 4, 4)], "videos": [(2, 2, 2)]}, {}], seed=0)
    assert torch.equal(balanced(**batch).loss, plain(**batch).loss)
    assert (handle.calls, handle.applied_calls, handle.last_stats.reason) == (0, 0, "single-rank")


def _snapshot(module: nn.Module) -> dict[str, Any]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_the_plan_ahead_collator_keeps_the_grids_on_the_host(tmp_path: Path) -> None:
    """``handle.plan_ahead(collate)``: the grids ride beside the batch untouched where accelerate
    and the Trainer move its tensors; the model's forward takes them out (here, with no process
    group, nothing is planned: the forward is the plain model's); workers can take the collator;
    ``remove()`` undoes the model's patched forward too."""
    from accelerate.utils import send_to_device
    from transformers import Trainer, TrainingArguments

    from lightning_vit_balance.hf import GRIDS_KEY

    model = tiny_model("qwen2_5_vl")
    batch = make_inputs("qwen2_5_vl", [{"images": [(1, 4, 4)], "videos": [(2, 2, 2)]}], seed=3)
    logits = model(**batch).logits
    handle = balance_vision_tower(model)
    collate = handle.plan_ahead(_first)
    assert handle.plan_ahead(_first) is not collate and "forward" in model.__dict__
    collated = pickle.loads(pickle.dumps(collate))([dict(batch)])
    grids = collated[GRIDS_KEY]
    assert [key for key, _ in grids.grids] == ["image_grid_thw", "video_grid_thw"]
    assert all(torch.equal(value, batch[key]) for key, value in grids.grids)
    trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))
    moved = trainer._prepare_inputs(send_to_device(collated, torch.device("cpu")))
    assert moved[GRIDS_KEY] is grids
    assert torch.equal(model(**moved).logits, logits)
    # A loop of one's own that moves every value of the batch.
    by_hand = {key: value.to("cpu", non_blocking=True).cpu() for key, value in collated.items()}
    assert by_hand[GRIDS_KEY] is grids
    assert torch.equal(model(**by_hand).logits, logits)
    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    with pytest.raises(TypeError, match=r"plan_ahead: the collator returned a tuple: expected a mutable"):
        handle.plan_ahead(tuple)([1])
    with pytest.raises(TypeError, match=r"plan_ahead\(collate_fn=None\) is invalid"):
        handle.plan_ahead(None)  # type: ignore[arg-type]
    handle.remove()
    assert "forward" not in model.__dict__


def test_the_default_configuration_is_the_towers_own_and_a_start_for_ones_own() -> None:
    """README: a configuration of one's own replaces the default whole; starting from
    ``handle.default_config()`` keeps the tower's cost model and ``split_videos``."""
    from lightning_vit_balance import CostModel

    handle = balance_vision_tower(tiny_model("qwen2_5_vl"))
    default = handle.default_config()
    assert handle.config is None and default.split_videos and default.cost_per_frame_attention
    assert default == CostModel.from_vit(handle.tower).to_config(ViTBalanceConfig(split_videos=True))
    assert default.cost_linear > 0 and default.cost_windowed > 0  # not the seed's l**2
    handle.config = dataclasses.replace(handle.default_config(), trigger_threshold=0.1)
    assert dataclasses.replace(handle.config, trigger_threshold=default.trigger_threshold) == default


def test_a_configuration_that_drops_the_towers_defaults_is_told_once() -> None:
    """``config=ViTBalanceConfig(plan_ahead=True)``, written to change one setting, also drops the
    tower's video splitting and cost model: said once (at the first forward's settings), and not for
    a configuration made from the default or one that sets its own cost model."""
    handle = balance_vision_tower(tiny_model("qwen2_5_vl"), config=ViTBalanceConfig(enabled=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle.settings()  # balancing off: nothing to say yet
    handle.config = ViTBalanceConfig(plan_ahead=True)
    dropped = r"keeps ViTBalanceConfig\(\)'s split_videos=False .* and cost model"
    with pytest.warns(RuntimeWarning, match=dropped):
        handle.settings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle.settings()  # once
        for config in (
            dataclasses.replace(handle.default_config(), plan_ahead=True),
            ViTBalanceConfig(split_videos=True, cost_linear=2.0),
        ):
            balance_vision_tower(tiny_model("qwen2_5_vl"), config=config).settings()
    seed_cost = r"keeps ViTBalanceConfig\(\)'s cost model, the seed's l\*\*2"
    with pytest.warns(RuntimeWarning, match=seed_cost) as told:
        balance_vision_tower(tiny_model("qwen2_5_vl"), config=ViTBalanceConfig(split_videos=True)).settings()
    default = handle.default_config()
    assert f"in a YAML configuration, add cost_quadratic: {default.cost_quadratic}, " in str(told[0].message)
    # A configuration that keeps the defaults first, then one that drops them: still told.
    kept = dataclasses.replace(default, plan_ahead=True)
    later = balance_vision_tower(tiny_model("qwen2_5_vl"), config=kept)
    later.settings()
    later.config = ViTBalanceConfig(plan_ahead=True)
    with pytest.warns(RuntimeWarning, match="split_videos: true, cost_quadratic"):
        later.settings()


def _told_of_a_configuration_dropping_the_defaults() -> int:
    """Worker, or here: how many warnings a configuration that drops the tower's defaults gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        balance_vision_tower(tiny_model("qwen2_5_vl"), config=ViTBalanceConfig(plan_ahead=True)).settings()
    return sum("replaces the drop-in's default whole" in str(w.message) for w in caught)


def test_a_warning_every_rank_decides_alike_is_said_by_rank_zero_alone(
    multirank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Said on every rank, a configuration's warning was 512 lines at 512 ranks. Global rank 0
    says it: the process group's, or before one exists the launcher's (``RANK``, then the
    variables Lightning reads)."""
    with multirank(2) as pool:
        assert pool.run(_told_of_a_configuration_dropping_the_defaults) == [1, 0]
    for rank, told in (("1", 0), ("0", 1), ("not a rank", 1)):
        monkeypatch.setenv("RANK", rank)
        assert _told_of_a_configuration_dropping_the_defaults() == told, rank
    # Lightning's own launcher sets LOCAL_RANK alone (SLURM its SLURM_PROCID), as Lightning reads.
    monkeypatch.delenv("RANK")
    for variable in ("LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.setenv(variable, "1")
        assert _told_of_a_configuration_dropping_the_defaults() == 0, variable
        monkeypatch.delenv(variable)


class _TowerModule(ViTBalanceMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_model("qwen2_5_vl")
        self.handle = self.balance_vision_tower(self.model)


def test_the_mixins_handle_takes_the_modules_configuration_and_says_so() -> None:
    """``handle.config = ...`` on the mixin's handle was ignored without a word (the module's
    ``vit_balance_config`` balances); it is refused, naming what to set. A module configuration
    that drops the tower's defaults is told once, as the engine's handle tells its own."""
    module = _TowerModule()
    assert module.handle.config is None
    refused = r"handle.config=.* is not used .* Set self.vit_balance_config instead"
    with pytest.raises(AttributeError, match=refused):
        module.handle.config = ViTBalanceConfig(trigger_threshold=100.0)
    module.handle.config = None  # what the handle holds
    default = module.handle.default_config()
    assert module.handle.balancing_config(ViTBalanceConfig()) == default  # no vit_balance_config: the default
    module.vit_balance_config = ViTBalanceConfig(plan_ahead=True)
    own = module.resolved_vit_balance_config()
    with pytest.warns(RuntimeWarning, match=r"in a LightningModule, as self.vit_balance_config"):
        assert module.handle.balancing_config(own) == own
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module.handle.balancing_config(own)  # once


class _OwnLoopModule(ViTBalanceMixin, L.LightningModule):
    """A LightningModule run by a loop of one's own (Fabric's, say), training on the default group."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.vit_balance_config = ViTBalanceConfig(**CONFIG)
        self.vit_balance_group = torch.distributed.group.WORLD
        self.model = model


def _collated_then_changed(mixin: bool) -> dict[str, str]:
    """Batches of the drop-in's collator (the handle's, or the mixin's with ``mixin``) changed before
    their forward: fewer pixel rows (a batch split by sample after collation), then one image's grid
    transposed (the same rows). Each forward's error, on this rank."""
    rank = torch.distributed.get_rank()
    model = tiny_model(FIT_FAMILY)
    if mixin:
        handle = _OwnLoopModule(model).balance_vision_tower(model)
    else:
        handle = balance_vision_tower(model, ViTBalanceConfig(**CONFIG))
    collate = handle.plan_ahead(_first)
    errors = {}
    images = [(1, 8, 8), (1, 8, 4)] if rank == 0 else [(1, 2, 2)]  # the plan moves one
    for change in ("rows", "grid"):
        batch = collate([make_inputs(FIT_FAMILY, [{"images": images}], seed=rank)])
        if change == "rows":
            batch["pixel_values"] = batch["pixel_values"][:-4]
        elif rank == 0:
            batch["image_grid_thw"] = batch["image_grid_thw"][:, [0, 2, 1]]
        try:
            model(**batch)
        except ValueError as err:
            errors[change] = str(err)
    return errors


@pytest.mark.parametrize("mixin", [False, True], ids=["handle", "mixin"])
def test_a_collated_batch_changed_after_collation_is_named_in_the_error(multirank: Any, mixin: bool) -> None:
    """The errors named only the forward's own pixel rows and grids (which agree with each other)
    and told the user to pass the plan prepared for the batch, which a collator's user never
    handles: they name the grids the collator carried, the mixin's handle's too."""
    with multirank(FIT_RANKS) as w:
        errors = w.run(_collated_then_changed, mixin)
    assert errors[0] == errors[1] and set(errors[0]) == {"rows", "grid"}, errors
    for message in errors[0].values():
        assert "the plan was made from the grids handle.plan_ahead's collator carried" in message, message
        assert "pass the plan prepared for this batch" not in message, message


def _collated_and_planned_by_the_mixin(case: str) -> tuple[int, float, float]:
    """A loop of one's own with the mixin's handle and its collator: the batch planned ahead by the
    mixin (``prepare_vit_balance``) or by the handle (``prepare``), then its forward; with
    ``copied on rank 1``, that rank's forward gets a deep copy of it (an augmentation of its own).
    The plans made on this rank, and the loss beside the plain model's."""
    rank = torch.distributed.get_rank()
    model = tiny_model(FIT_FAMILY)
    module = _OwnLoopModule(model)
    handle = module.balance_vision_tower(model)
    samples = [{"images": [(1, 8, 8)]}, {"images": [(1, 8, 4)]}] if rank == 0 else [{"images": [(1, 2, 2)]}]
    batch = handle.plan_ahead(_first)([make_inputs(FIT_FAMILY, samples, seed=rank)])
    with mock.patch.object(ViTBalancer, "prepare", autospec=True, side_effect=ViTBalancer.prepare) as prepare:
        if case == "by the handle":
            handle.prepare(batch)
        else:
            module.prepare_vit_balance(batch)
        given = copy.deepcopy(batch) if case == "copied on rank 1" and rank == 1 else batch
        loss = float(model(**given).loss)
    plain = float(tiny_model(FIT_FAMILY)(**make_inputs(FIT_FAMILY, samples, seed=rank)).loss)
    return prepare.call_count, loss, plain


@pytest.mark.parametrize("case", ["by the mixin", "by the handle", "copied on rank 1"])
def test_a_batch_the_mixin_planned_ahead_is_not_planned_again_from_its_collated_grids(
    multirank: Any, case: str
) -> None:
    """The mixin's handle took a plan made ahead only for the very object of grids its batch carried:
    a rank whose batch was copied planned again while the others did not, and waited in that
    gather (30 s, then every rank failed); ``handle.prepare`` on the mixin's handle did not count."""
    with multirank(FIT_RANKS) as w:
        results = w.run(_collated_and_planned_by_the_mixin, case, timeout=60)
    for plans, loss, plain in results:
        assert plans == 1, results
        assert loss == pytest.approx(plain, rel=1e-5), results  # float32 sums in another order


def test_remove_restores_the_model_bit_for_bit() -> None:
    model = tiny_model("qwen3_vl").eval()
    base, tower = model.model, model.model.visual
    before = {
        "state": _snapshot(model),
        "model": dict(model.__dict__),
        "base": dict(base.__dict__),
        "tower": dict(tower.__dict__),
    }
    batch = make_inputs("qwen3_vl", [{"images": [(1, 4, 4)], "videos": [(2, 2, 2)]}], seed=3)
    logits = model(**batch).logits

    handle = balance_vision_tower(model)
    assert BalancedVisionTower.of(model) is handle
    # The tower stays the same module: class, parameter names, the attributes HF reads.
    assert type(tower) is type(model.model.visual) and model.model.visual is tower
    assert list(model.state_dict()) == list(before["state"])
    assert (tower.dtype, tower.spatial_merge_size, tower.config) == (
        torch.float32,
        before["tower"]["spatial_merge_size"],
        before["tower"]["config"],
    )
    assert inspect.signature(base.forward) == inspect.signature(type(base).forward.__get__(base))
    with pytest.raises(ValueError, match="already balanced"):
        balance_vision_tower(model)
    with pytest.raises(
        ValueError, match=r"balance_vision_tower\(evaluation='False'\) is invalid: expected a bool"
    ):
        balance_vision_tower(tiny_model("qwen2_5_vl"), evaluation="False")
    # Pickling (what ddp_spawn does) keeps the model balanced, by a fresh handle of its own.
    copied = pickle.loads(pickle.dumps(model))
    assert BalancedVisionTower.of(copied) is not handle and BalancedVisionTower.of(copied) is not None
    assert torch.equal(copied(**batch).logits, logits)

    handle.remove()
    handle.remove()  # again: nothing left to undo
    assert BalancedVisionTower.of(model) is None
    assert base.__dict__.keys() == before["base"].keys() and "forward" not in base.__dict__
    assert tower.__dict__.keys() == before["tower"].keys() and "forward" not in tower.__dict__
    # transformers 5: generate()'s encoding step, patched on the model, is gone too.
    assert model.__dict__.keys() == before["model"].keys()
    after = model.state_dict()
    assert list(after) == list(before["state"])
    assert all(torch.equal(after[k], v) for k, v in before["state"].items())
    assert torch.equal(model(**batch).logits, logits)
    balance_vision_tower(model).remove()  # installs again after removal


def test_a_forward_patched_before_is_kept_and_restored() -> None:
    """An instance forward found at install time (accelerate hooks set one) is called and restored."""
    model = tiny_model("qwen2_vl")
    base = model.model
    seen = []

    def hooked(*args: Any, **kwargs: Any) -> Any:
        seen.append(True)
        return type(base).forward(base, *args, **kwargs)

    base.forward = hooked
    handle = balance_vision_tower(model)
    model(**make_inputs("qwen2_vl", [{"images": [(1, 2, 2)]}], seed=0))
    assert seen == [True]
    handle.remove()
    assert base.__dict__["forward"] is hooked


class _NoVideosModel(nn.Module):
    """A base model whose forward knows no videos, and a tower without ``spatial_merge_size``."""

    def __init__(self) -> None:
        super().__init__()
        self.visual = nn.Linear(2, 2)

    def forward(self, input_ids: Any = None, pixel_values: Any = None, image_grid_thw: Any = None) -> Any:
        return input_ids


class _LossInsideModel(nn.Module):
    """The layout of transformers before 4.52: the tower on a model that computes the loss itself."""

    def __init__(self) -> None:
        super().__init__()
        import towers

        self.visual = towers.qwen2_vl_tower()

    def forward(
        self,
        input_ids: Any = None,
        pixel_values: Any = None,
        pixel_values_videos: Any = None,
        image_grid_thw: Any = None,
        video_grid_thw: Any = None,
        labels: Any = None,
    ) -> Any:
        return input_ids


def test_a_model_breaking_the_contract_gets_an_error_naming_what_is_missing() -> None:
    with pytest.raises(ValueError, match="no submodule with a child module named 'visual'") as info:
        balance_vision_tower(nn.Sequential(nn.Linear(2, 2)))
    assert "vision encoder" not in str(info.value)
    # A model whose encoder has another name (HY-V4-VL's vision_tower; of the models with one, only
    # the allow-listed model types' are taken as towers) is told where it is and how to balance it.
    other = nn.Module()
    other.model = nn.Module()
    other.model.vision_tower = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"Its vision encoder is model\.model\.vision_tower, which the drop-in"
    ):
        balance_vision_tower(other)
    with pytest.raises(ValueError, match="several vision towers"):
        balance_vision_tower(nn.ModuleList([_NoVideosModel(), _NoVideosModel()]))
    with pytest.raises(ValueError) as info:
        balance_vision_tower(_NoVideosModel())
    message = str(info.value)
    for missing in (
        "forward has no parameter 'pixel_values_videos'",
        "forward has no parameter 'video_grid_thw'",
        "Linear.forward has no parameter 'grid_thw'",
        "no int attribute 'spatial_merge_size'",
        "Linear.config has no int 'in_channels'",
    ):
        assert missing in message
    # A model's form changes between releases: the error says which transformers it met.
    import transformers

    assert f"transformers {transformers.__version__} is installed, the drop-in is tested with" in message
    with pytest.raises(ValueError) as info:
        balance_vision_tower(_LossInsideModel())
    assert "forward takes 'labels', so it computes the loss itself" in str(info.value)
    assert "has no" not in str(info.value)  # the tower and the other parameters meet the contract
    for in_place in (True, False):  # lazy either way: nothing compiles before the first call
        model = tiny_model("qwen2_vl")
        if in_place:
            model.model.visual.compile()
        else:
            model.model.visual = torch.compile(model.model.visual)
        with pytest.raises(ValueError, match="is compiled as a whole"):
            balance_vision_tower(model)
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.Module"):
        balance_vision_tower("model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a ViTBalanceConfig"):
        balance_vision_tower(tiny_model("qwen2_vl"), {"enabled": True})  # type: ignore[arg-type]


#: What :func:`balance_vision_tower` says of each of :data:`REFUSED_FAMILIES` as it is, then with its
#: ``vision_tower`` taken by model type: the contract points it breaks.
REFUSALS = {
    "hunyuan_vl": (
        "model.model.vision_tower",
        ["no parameter 'pixel_values_videos'", "'spatial_merge_size'"],
    ),
    "glm_image": ("GlmImageModel.forward has no parameter 'pixel_values_videos'", []),
    "minicpmv4_6": (
        "model.model.vision_tower",
        ["no parameter 'image_grid_thw'", "has no parameter 'grid_thw'"],
    ),
    "hy_v4_vl": ("model.model.vision_tower", ["no int attribute 'spatial_merge_size'"]),
}


@pytest.mark.parametrize("family", REFUSED_FAMILIES)
def test_models_of_another_design_are_refused_before_anything_is_patched(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HunYuanVL, GLM-Image and MiniCPM-V break the contract (see :data:`REFUSED_FAMILIES`): an error
    saying where the encoder is or what breaks, and nothing patched. Taken by its model type, a
    ``vision_tower`` is still refused, by the contract check: an allow-list entry alone never
    balances a model of another design into other outputs."""
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    model = tiny_model(family)
    where, broken = REFUSALS[family]
    with pytest.raises(ValueError, match=re.escape(where)):
        balance_vision_tower(model)
    if broken:
        monkeypatch.setattr(hf, "_VISION_TOWER_MODEL_TYPES", frozenset({model.model.config.model_type}))
        with pytest.raises(ValueError, match="does not meet the drop-in's contract") as info:
            balance_vision_tower(model)
        assert all(problem in str(info.value) for problem in broken), str(info.value)
    assert not any("forward" in vars(module) for module in model.modules())


# --------------------------------------------------------------------------- Lightning


FIT_STEPS = 4
FIT_RANKS = 2
FIT_FAMILY = "qwen3_vl"
# Per step, each rank's samples: text-only ranks, images next to videos, videos alone, then a step
# of text alone on every rank (its batches hold no pixel keys at all).
FIT_BATCHES: list[list[list[dict[str, Any]]]] = [
    [[{"images": [(1, 8, 8)], "videos": [(2, 4, 4)]}], [{}]],
    [[{}], [{"videos": [(2, 4, 4)]}, {"images": [(1, 2, 2)]}]],
    [[{"images": [(1, 4, 4)]}], [{"images": [(1, 8, 4), (1, 2, 2)]}]],
    [[{}], [{}]],
]


# GLM-4.1V: one long video next to a text-only rank, then videos alone, then images, then text.
GLM_FIT_BATCHES: list[list[list[dict[str, Any]]]] = [
    [[{"videos": [(3, 8, 4)]}], [{}]],
    [[{}], [{"videos": [(2, 4, 4)]}, {"videos": [(1, 2, 2)]}]],
    [[{"images": [(1, 4, 4)]}], [{"images": [(1, 8, 4), (1, 2, 2)]}]],
    [[{}], [{}]],
]


def fit_batch(step: int, rank: int, family: str = FIT_FAMILY) -> dict[str, Any]:
    batches = GLM_FIT_BATCHES if family in GLM_FAMILIES else FIT_BATCHES
    return make_inputs(family, batches[step][rank], seed=1000 + 10 * step + rank)


def _first(items: list[Any]) -> Any:
    return items[0]


class HFFinetune(ViTBalanceMixin, L.LightningModule):
    """A user's fine-tuning module: ``self.model(**batch).loss``, plus ``balance_vision_tower``."""

    def __init__(
        self, out_dir: str, balanced: bool, plan_ahead: bool = False, family: str = FIT_FAMILY
    ) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.family = family
        whole_videos = family in WHOLE_VIDEO_FAMILIES
        self.vit_balance_config = ViTBalanceConfig(
            **{**CONFIG, "split_videos": not whole_videos}, plan_ahead=plan_ahead
        )
        self.model = tiny_model(family)
        if balanced:
            self.balance_vision_tower(self.model)
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.vit_balance_config.plan_ahead:
            for tower in self._vit_balance_towers:
                # The rows a plan made ahead read on the host: the forward's step grids (GLM-4.xV)
                # are indexed from them, not read on the device (nor from an earlier batch's).
                assert tower._ticket_rows == _host_grid_rows(batch, tower.step_grid_keys)
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_end(self) -> None:
        path = Path(self.out_dir) / f"losses_rank_{self.global_rank}.json"
        path.write_text(json.dumps(self.losses))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=SGD_LR)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        batches = [fit_batch(step, self.global_rank, self.family) for step in range(FIT_STEPS)]
        return torch.utils.data.DataLoader(batches, batch_size=1, collate_fn=_first)


def _reference(
    model: nn.Module,
    batch_for: Callable[[int, int], dict[str, Any]] = fit_batch,
    steps: int = FIT_STEPS,
    ranks: int = FIT_RANKS,
    lr: float = SGD_LR,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.SGD,
) -> list[torch.Tensor]:
    """DDP by hand: each step, the mean of the ranks' losses (DDP averages gradients), then SGD
    (or ``optimizer_class``).

    Returns ``losses[rank]``: that rank's loss at each step, as a tensor."""
    optimizer = optimizer_class(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        per_rank = [model(**batch_for(step, rank)).loss for rank in range(ranks)]
        (sum(per_rank) / ranks).backward()
        optimizer.step()
        losses.append([float(loss.detach()) for loss in per_rank])
    return list(torch.tensor(losses).T)


#: Images (a text-only rank), text alone on every rank, then images: FIT_BATCHES' steps.
TEXT_ONLY_STEPS = (0, 3, 2)
ADAMW_LR = 1e-2


def _adamw_steps(
    drop: bool, zero_after_forward: bool = False, watched: bool = True
) -> tuple[list[float], list[bool]]:
    """DDP (``find_unused_parameters=False``: the drop-in gives every rank's tower a gradient) and
    AdamW on :data:`TEXT_ONLY_STEPS`; with ``drop``, ``handle.drop_text_only_grads()`` before each
    step, else the drop-in's own at the step (not ``watched``: none); ``zero_after_forward``:
    ``zero_grad`` between the forward and the backward, as Lightning's closure calls it. This
    rank's losses, and what each call unset."""
    from torch.nn.parallel import DistributedDataParallel

    if not watched:
        with mock.patch("lightning_vit_balance.hf._end_watched_steps"):
            return _adamw_steps(drop, zero_after_forward)
    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model, ViTBalanceConfig(**CONFIG))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    losses, unset = [], []
    for step in TEXT_ONLY_STEPS:
        if not zero_after_forward:
            optimizer.zero_grad()
        loss = ddp(**fit_batch(step, torch.distributed.get_rank())).loss
        if zero_after_forward:
            optimizer.zero_grad()
        loss.backward()
        if drop:
            unset.append(handle.drop_text_only_grads())
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, unset


def _text_only_steps_with_other_gradients() -> dict[str, bool]:
    """Steps of text alone on every rank where the tower's gradients are not only the drop-in's
    zeros, or where a forward that no optimizer step follows came first: what
    ``drop_text_only_grads`` did each time."""
    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model, ViTBalanceConfig(**CONFIG), evaluation=True)
    text, rank = fit_batch(3, torch.distributed.get_rank()), torch.distributed.get_rank()
    weight = next(handle.tower.parameters())
    done: dict[str, bool] = {}
    # A loss term on a tower weight: a real gradient, which the plain model's optimizer steps; the
    # other weights' zeros are the drop-in's.
    (model(**text).loss + weight.square().sum()).backward()
    handle.drop_text_only_grads()
    kept = [id(param) for param in handle.tower.parameters() if param.grad is not None]
    done["penalty_alone_kept"] = kept == [id(weight)]
    model.zero_grad()
    # The tower called outside the balanced forward (ColQwen2 encodes its images itself).
    image = make_inputs(FIT_FAMILY, [{"images": [(1, 4, 4)]}], seed=rank)
    encoded = handle.tower(image["pixel_values"], grid_thw=image["image_grid_thw"])
    (model(**text).loss + flatten_output(encoded)[0][0][1].sum()).backward()
    handle.drop_text_only_grads()
    done["own_tower_call_kept"] = weight.grad is not None
    model.zero_grad()
    # An evaluation forward with images and gradients on, then a training step of text alone.
    model.eval()
    model(**fit_batch(2, rank)).loss.backward()
    model.train().zero_grad()
    model(**text).loss.backward()
    done["after_evaluation"] = handle.drop_text_only_grads() and weight.grad is None
    # A run that raised after a forward with images (no optimizer step): the next run's step of
    # text alone is its own, once the handle let go of the run (ViTBalanceTrainerCallback's end).
    model(**fit_batch(2, rank))
    handle.release()
    model.zero_grad()
    model(**text).loss.backward()
    done["after_release"] = handle.drop_text_only_grads()
    return done


class _Watched:
    """What :func:`lightning_vit_balance.hf._end_watched_steps` asks of a watched handle."""

    def __init__(self, order: int, asked: list[int]) -> None:
        self._order, self.asked = order, asked

    def _before_optimizer_step(self, optimizer: Any) -> None:
        self.asked.append(self._order)


def test_watched_handles_end_their_steps_in_the_order_they_were_made() -> None:
    """Each handle's drop of sharded gradients is a collective, so the handles of several models in
    one optimizer must end their steps in the same order on every rank: not in the watch set's
    order, which follows object ids (made here against the handles' order)."""
    asked: list[int] = []
    handles = [_Watched(order, asked) for order in reversed(range(8))]
    with mock.patch.object(hf, "_STEP_WATCH", weakref.WeakSet(handles)):
        hf._end_watched_steps(torch.optim.SGD([nn.Parameter(torch.ones(1))]))
    assert asked == list(range(8)), asked


def _unset_at_the_step(steps: Callable[[nn.Module, Any, torch.optim.Optimizer], None]) -> bool:
    """Whether the tower's first weight was left without a gradient when ``steps(model, handle,
    optimizer)`` (a fresh drop-in, SGD) stepped last, without calling ``drop_text_only_grads``."""
    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model, ViTBalanceConfig(**CONFIG))
    optimizer = torch.optim.SGD(model.parameters(), lr=ADAMW_LR)
    steps(model, handle, optimizer)
    return next(handle.tower.parameters()).grad is None


def _the_drop_in_at_the_step() -> dict[str, bool]:
    """The drop-in's own drop at an optimizer step (a loop that never calls ``drop_text_only_grads``,
    as Fabric's and accelerate's): after a step where no rank had images, and only then; also when
    another model's optimizer stepped between the forward and the backward (a GAN's)."""
    rank = torch.distributed.get_rank()
    text, images = fit_batch(3, rank), fit_batch(2, rank)

    def text_alone(model: nn.Module, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        model(**text).loss.backward()
        optimizer.step()

    def images_then_text(model: nn.Module, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        for batch in (images, text):  # micro-batches of one step: the images' gradients are real
            model(**batch).loss.backward()
        optimizer.step()

    def another_model_stepped_first(model: nn.Module, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        loss = model(**text).loss
        other = nn.Linear(2, 1)
        other(torch.ones(1, 2)).sum().backward()
        torch.optim.SGD(other.parameters(), lr=0.1).step()  # before this step's backward
        loss.backward()
        optimizer.step()

    def own_tower_call(model: nn.Module, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        image = make_inputs(FIT_FAMILY, [{"images": [(1, 4, 4)]}], seed=rank)
        encoded = handle.tower(image["pixel_values"], grid_thw=image["image_grid_thw"])
        (model(**text).loss + flatten_output(encoded)[0][0][1].sum()).backward()
        optimizer.step()

    def tower_called_on_one_rank(model: nn.Module, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        # Outside the loss, on rank 0 alone (features logged): every rank decides alike.
        if rank == 0:
            image = make_inputs(FIT_FAMILY, [{"images": [(1, 4, 4)]}], seed=rank)
            handle.tower(image["pixel_values"], grid_thw=image["image_grid_thw"])
        text_alone(model, handle, optimizer)

    def with_a_closure(model: nn.Module, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        # As Lightning steps: the forward and backward run in the closure, after the step's hooks.
        text_alone(model, handle, optimizer)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = model(**text).loss
            loss.backward()
            return loss

        optimizer.step(closure)

    def unfrozen_later(model: nn.Module, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        handle.tower.requires_grad_(False)
        text_alone(model, handle, optimizer)
        handle.tower.requires_grad_(True)
        optimizer.zero_grad()
        text_alone(model, handle, optimizer)

    def prepared_in_eval_mode(model: nn.Module, handle: Any, optimizer: torch.optim.Optimizer) -> None:
        # Eval forwards encode directly here: no plan (it would wait for the next training batch).
        model.eval()
        assert handle.prepare(text) is None
        model.train()
        model(**images).loss.backward()
        assert handle.last_stats is not None and handle.last_stats.prepare_seconds == 0.0  # no plan taken
        optimizer.step()

    cases = [
        text_alone,
        images_then_text,
        another_model_stepped_first,
        own_tower_call,
        tower_called_on_one_rank,
        with_a_closure,
        unfrozen_later,
        prepared_in_eval_mode,
    ]
    return {case.__name__: _unset_at_the_step(case) for case in cases}


def test_a_step_of_text_alone_leaves_the_towers_gradients_unset(multirank: Any) -> None:
    """A step where no rank has images: the plain model never calls its tower, whose gradients stay
    unset and AdamW skips it; the drop-in's ``+0.0`` gave them zeros, and AdamW moved the tower
    (momentum, weight decay), so the next step's losses differed. ``drop_text_only_grads`` before
    the optimizer step unsets them (``ViTBalanceTrainerCallback`` calls it), and only them."""
    step_of = functools.partial(_step_batch, TEXT_ONLY_STEPS)
    expected = _reference(
        tiny_model(FIT_FAMILY), step_of, len(TEXT_ONLY_STEPS), lr=ADAMW_LR, optimizer_class=torch.optim.AdamW
    )
    with multirank(FIT_RANKS) as w:
        per_rank, by_itself = w.run(_adamw_steps, True), w.run(_adamw_steps, False)
        # The forward of a step saw the last step's gradients still set.
        per_rank += w.run(_adamw_steps, True, True)
        others = w.run(_text_only_steps_with_other_gradients)
        at_the_step = w.run(_the_drop_in_at_the_step)
        unwatched = w.run(_adamw_steps, False, False, False)
    for index, (losses, unset) in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(losses), expected[index % FIT_RANKS], **TOL)
        assert unset == [False, True, False], unset
    # Without calls of its own, the drop-in's at the optimizer step; without either, a drift.
    for index, (losses, _) in enumerate(by_itself):
        torch.testing.assert_close(torch.tensor(losses), expected[index % FIT_RANKS], **TOL)
    assert not torch.allclose(torch.tensor(unwatched[0][0][-1]), expected[0][-1], **TOL), unwatched
    # Gradients from elsewhere stay (ColQwen2's tower trained on nothing else); an evaluation
    # forward's images, no optimizer step after them, do not count for the step.
    kept = {
        "penalty_alone_kept": True,
        "own_tower_call_kept": True,
        "after_evaluation": True,
        "after_release": True,
    }
    assert others == [kept] * FIT_RANKS, others
    unset_at_the_step = {
        "text_alone": True,
        "images_then_text": False,
        "another_model_stepped_first": True,
        "own_tower_call": False,
        "tower_called_on_one_rank": True,
        "with_a_closure": True,
        "unfrozen_later": True,
        "prepared_in_eval_mode": False,
    }
    assert at_the_step == [unset_at_the_step] * FIT_RANKS, at_the_step


def _a_step_skipped_after_one_ranks_failure(drop: bool) -> float:
    """DDP and AdamW, every plan skipped and unchecked (the default ``check_skipped_calls``): at
    the second step rank 1's tower runs out of memory, every rank skips the step (a flag all-reduced,
    as loops that skip a failed batch do; with ``drop``, then ``drop_text_only_grads``, as the README
    advises after a skipped step), and a step of text alone follows. The largest difference of the
    tower's weights between the ranks."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model, ViTBalanceConfig(**{**CONFIG, "trigger_threshold": 100.0}))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)

    def out_of_memory(module: nn.Module, args: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    for step in (0, 2, 3):  # images (a text-only rank), images, text alone on every rank
        failing = step == 2 and rank == 1
        hook = handle.tower.register_forward_pre_hook(out_of_memory) if failing else None
        failed = torch.zeros(1)
        try:
            loss = ddp(**fit_batch(step, rank)).loss
        except torch.OutOfMemoryError:
            failed += 1
        finally:
            if hook is not None:
                hook.remove()
        torch.distributed.all_reduce(failed)
        if failed.item():
            optimizer.zero_grad()
            if drop:
                handle.drop_text_only_grads()
            continue
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    weights = torch.cat([param.detach().flatten() for param in handle.tower.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world)]
    torch.distributed.all_gather(gathered, weights)
    return max(float((other - weights).abs().max()) for other in gathered)


def test_a_step_skipped_after_one_ranks_failure_leaves_the_towers_alike(multirank: Any) -> None:
    """A skipped call's ViT that raised on one rank alone (unchecked, so the others finished the
    call and counted it toward the step's drop of text-only gradients): the failing rank counted
    nothing, so at the next step of text alone it alone unset the tower's zero gradients, and
    AdamW moved the other rank's tower: 6.8e-3 apart after the steps, silently. The failing rank now
    counts the call as the others did. After ``drop_text_only_grads`` (the README's advice after a
    skipped step) the towers were alike already."""
    with multirank(FIT_RANKS) as w:
        apart = w.run(_a_step_skipped_after_one_ranks_failure, False)
        dropped = w.run(_a_step_skipped_after_one_ranks_failure, True)
    assert apart == [0.0] * FIT_RANKS and dropped == [0.0] * FIT_RANKS, (apart, dropped)


def test_the_mixin_and_the_trainer_callback_drop_text_only_grads_before_each_step() -> None:
    """The mixin's ``on_before_optimizer_step`` and ``ViTBalanceTrainerCallback``'s
    ``on_pre_optimizer_step`` (the Trainer's hook between its clipping and its optimizer step) ask
    each of their drop-in handles to unset a step of text alone's gradients."""
    from transformers import TrainerState
    from transformers.trainer_callback import TrainerControl

    module = HFFinetune("", balanced=True)
    (handle,) = module._vit_balance_towers
    with mock.patch.object(handle, "drop_text_only_grads") as drop:
        module.on_before_optimizer_step(mock.Mock())
        assert drop.call_count == 1
        callback = ViTBalanceTrainerCallback()
        callback.on_init_end(None, TrainerState(), TrainerControl(), model=module.model)  # type: ignore[arg-type]
        callback.on_pre_optimizer_step(None, TrainerState(), TrainerControl())  # type: ignore[arg-type]
        assert drop.call_count == 2


def _step_batch(steps: tuple[int, ...], index: int, rank: int) -> dict[str, Any]:
    return fit_batch(steps[index], rank)


@pytest.mark.parametrize(("family", "tower_dtype"), [(FIT_FAMILY, torch.bfloat16), ("glm4v", torch.float64)])
def test_plans_made_ahead_are_for_the_rows_the_tower_gets(
    tmp_path: Path, family: str, tower_dtype: torch.dtype
) -> None:
    """The mixin plans ahead for the rows the drop-in passes the tower: in the tower's dtype at the
    time (a bf16 tower's pixel rows travel as bf16, half the bytes of the batch's float32, and a
    float64 tower's are not refused as a dtype float32 cannot hold), and GLM-4.1V's videos one
    temporal step per row. A module without a drop-in plans the batch's own rows."""
    batch = make_inputs(family, [{"images": [(1, 4, 4)], "videos": [(3, 4, 2)]}], seed=0)
    if family in GLM_FAMILIES:  # its model takes no batch with images and videos together
        batch = make_inputs(family, [{"videos": [(3, 4, 2)]}], seed=0)
    module = HFFinetune(str(tmp_path), balanced=True, family=family)
    module.model.model.visual.to(tower_dtype)
    plain = HFFinetune(str(tmp_path), balanced=False, family=family)
    keys = module.vit_balance_prepare_keys
    pixels, grid = rows_to_plan(batch, keys, module._vit_balance_towers)
    own_pixels, own_grid = rows_to_plan(batch, keys, plain._vit_balance_towers)
    rows = sum(batch[k].shape[0] for k, _ in keys if batch.get(k) is not None)
    assert pixels.shape == own_pixels.shape == (rows, batch["pixel_values_videos"].shape[1])
    assert (pixels.dtype, own_pixels.dtype) == (tower_dtype, torch.float32)
    grids = [batch[g] for k, g in keys if batch.get(k) is not None]
    assert torch.equal(own_grid, torch.cat(grids))
    steps = [grid_steps(g) if g is batch.get("video_grid_thw") else g for g in grids]
    assert torch.equal(grid, torch.cat(steps) if family in GLM_FAMILIES else torch.cat(grids))
    # A text-only batch: no rows, of the width the drop-in's empty call passes the tower.
    text_only = make_inputs(family, [{}], seed=0)
    empty, empty_grid = rows_to_plan(text_only, keys, module._vit_balance_towers)
    assert empty.shape == (0, pixels.shape[1]) and empty.dtype == tower_dtype and empty_grid.shape == (0, 3)


def _lightning_ddp_fit(out_dir: str, family: str, plan_ahead: bool) -> dict[str, torch.Tensor] | None:
    """Worker: the fit of :func:`test_lightning_ddp_fit_without_find_unused_parameters`, on the
    pool's ranks as under ``torchrun``; rank 0 returns the trained weights."""
    import torch.distributed as dist

    module = HFFinetune(out_dir, balanced=True, plan_ahead=plan_ahead, family=family)
    if family == "glm4v":
        module.model.model.visual.double()
    with launched_by_torchrun():
        # Tiny buckets: several all-reduces interleave with the return trip's backward exchange.
        strategy = DDPStrategy(find_unused_parameters=False, bucket_cap_mb=0.02)
        trainer = quiet_trainer(out_dir, "fit", devices=FIT_RANKS, strategy=strategy, max_steps=FIT_STEPS)
        trainer.fit(module)
    return module.model.state_dict() if dist.get_rank() == 0 else None


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("family", "plan_ahead"), [(FIT_FAMILY, False), (FIT_FAMILY, True), ("glm4v", True), ("kimi_k25", True)]
)
def test_lightning_ddp_fit_without_find_unused_parameters(
    tmp_path: Path, family: str, plan_ahead: bool, multirank: Any
) -> None:
    """Lightning's DDP, 2 CPU ranks under ``torchrun``, find_unused_parameters=False, small DDP
    buckets; text-only ranks. (``ddp_spawn`` runs the same module in README.md's test and the
    fine-tuning example's.)

    With ``plan_ahead`` each step's one balanced call uses the plan made in
    ``on_before_batch_transfer`` from the batch's image and video grids (GLM-4.1V: its video grids
    one temporal step per row, as its model passes them to the tower). GLM-4.1V's tower runs in
    float64 there, set after ``balance_vision_tower``, while the batch holds float32 pixels: the
    plan is made for the rows the model passes its tower, cast to the tower's dtype at the time.
    Kimi-K2.5 projects the tower's outputs outside the tower: on a text-only rank the drop-in
    touches that projection, which DDP would otherwise wait for (the fit hung in its second step).
    """
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    reference_model = tiny_model(family)  # the fit's initial weights (seeded)
    if family == "glm4v":
        reference_model.model.visual.double()
    initial = {key: value.clone() for key, value in reference_model.state_dict().items()}
    with multirank(FIT_RANKS) as pool:
        trained, _ = pool.run(_lightning_ddp_fit, str(tmp_path), family, plan_ahead, timeout=200)
    expected = _reference(reference_model, functools.partial(fit_batch, family=family))
    for rank in range(FIT_RANKS):
        losses = json.loads((tmp_path / f"losses_rank_{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(losses), expected[rank], **TOL)
    # The trained weights carry four steps' gradient rounding, each step's fed into the next, so
    # the tolerance scales with how far training moved each tensor: GLM-4.1V's token embeddings
    # moved by up to 0.47 and differ by 6.9e-6 to 1.3e-5 from run to run (1.5-2.8e-5 of the move);
    # every other tensor by at most 1.4e-5 of its move. A misrouted row changes a move at O(1).
    for key, value in reference_model.state_dict().items():
        moved = float((value - initial[key]).abs().max()) if value.is_floating_point() else 0.0
        torch.testing.assert_close(
            trained[key], value, rtol=1e-5, atol=2e-4 * moved, msg=lambda m, k=key: f"{k}: {m}"
        )
    # The callback logged the handle's stats: one balanced call per step.
    rows = _logged_calls(tmp_path)
    assert float(rows[-1]["vit_balance/calls_total"]) == FIT_STEPS
    if plan_ahead:
        _assert_no_gather_in_the_forward(rows)


def _logged_calls(out_dir: Path) -> list[dict[str, str]]:
    """The fit's logged steps (``ViTBalanceCallback``'s rows), each of one balanced call."""
    with open(out_dir / "fit" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("vit_balance/calls")]
    assert [float(r["vit_balance/calls"]) for r in rows] == [1.0] * FIT_STEPS
    return rows


def _assert_no_gather_in_the_forward(rows: list[dict[str, str]]) -> None:
    """Each logged step's call planned ahead: the trips and the status gather only."""
    expected = [
        3.0 if float(r["vit_balance/applied"]) else float(r["vit_balance/skipped/no-images"]) for r in rows
    ]  # a skipped call: nothing, but the status word where no rank has images
    assert [float(r["vit_balance/collectives"]) for r in rows] == expected, rows
    assert any(float(r["vit_balance/applied"]) for r in rows), rows


class HFCollated(HFFinetune):
    """:class:`HFFinetune` whose batches come from the drop-in's collator
    (``handle.plan_ahead(collate)``): each forward plans from the grids it carries."""

    def __init__(self, out_dir: str, plan_ahead: bool = False) -> None:
        super().__init__(out_dir, balanced=True, plan_ahead=plan_ahead)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        batches = [fit_batch(step, self.global_rank, self.family) for step in range(FIT_STEPS)]
        collate = self._vit_balance_towers[0].plan_ahead(_first)
        return torch.utils.data.DataLoader(batches, batch_size=1, collate_fn=collate)


class HFCollatedInAMapping(HFCollated):
    """:class:`HFCollated` with ``plan_ahead``, its loader one of a mapping of loaders (Lightning's
    ``CombinedLoader``): the batch hook plans the outer batch, which holds no pixel keys (a plan
    without images), and the forward gets the inner batch with the collator's grids."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir, plan_ahead=True)

    def train_dataloader(self) -> dict[str, torch.utils.data.DataLoader]:  # type: ignore[override]
        return {"inner": super().train_dataloader()}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch["inner"]).loss
        self.losses.append(float(loss.detach()))
        return loss


class SamplesOnRankZero(L.Callback):
    """Runs the model on the training batch on rank 0 alone after each step (logging samples)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: HFFinetune, *args: Any) -> None:
        if trainer.is_global_zero:
            with torch.no_grad():
                pl_module.model(**args[1])


class HFDistilled(HFFinetune):
    """:class:`HFFinetune` with ``plan_ahead`` and a frozen bf16 teacher, also balanced, whose
    forward comes first in each step (its logits unused: the losses stay the plain model's)."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir, balanced=True, plan_ahead=True)
        self.teacher = tiny_model(FIT_FAMILY).to(torch.bfloat16).requires_grad_(False)
        self.balance_vision_tower(self.teacher)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            self.teacher(**batch)
        return super().training_step(batch, batch_idx)


class HFSampledInValidation(HFFinetune):
    """:class:`HFFinetune` whose validation (a loader without ``DistributedSampler``: not balanced)
    asks its handle for a plan on rank 0 alone, logging a sample: ``prepare`` returns None there."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir, balanced=True)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        if self.global_rank == 0 and batch_idx == 0:
            assert self._vit_balance_towers[0].prepare(batch) is None
        with torch.no_grad():
            self.model(**batch)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self.train_dataloader()


def _fit_of(out_dir: str, kind: str) -> int:
    """Worker: a fit of :class:`HFCollated` (with :class:`SamplesOnRankZero`), :class:`HFDistilled`
    or :class:`HFSampledInValidation` (validating after the last step). Returns the plans made
    ahead on this rank (``ViTBalancer.prepare``'s gathers)."""
    kinds = {
        "collated": HFCollated,
        "collated and planned ahead": functools.partial(HFCollated, plan_ahead=True),
        "collated in a mapping": HFCollatedInAMapping,
        "distilled": HFDistilled,
        "sampled": HFSampledInValidation,
    }
    module = kinds[kind](out_dir)
    with launched_by_torchrun():
        trainer = quiet_trainer(
            out_dir, "fit", devices=FIT_RANKS, max_steps=FIT_STEPS, strategy="ddp", num_sanity_val_steps=0
        )
        if kind == "collated":
            trainer.callbacks.append(SamplesOnRankZero())
        with mock.patch.object(
            ViTBalancer, "prepare", autospec=True, side_effect=ViTBalancer.prepare
        ) as prepare:
            trainer.fit(module)
    return prepare.call_count


def _assert_plain_losses(out_dir: Path) -> None:
    """Each rank's losses of a fit of :data:`FIT_BATCHES` are the plain model's."""
    expected = _reference(tiny_model(FIT_FAMILY))
    for rank in range(FIT_RANKS):
        losses = json.loads((out_dir / f"losses_rank_{rank}.json").read_text())
        torch.testing.assert_close(torch.tensor(losses), expected[rank], **TOL)


@pytest.mark.timeout(240)
def test_the_plan_ahead_collator_under_a_lightning_fit(tmp_path: Path, multirank: Any) -> None:
    """The drop-in's collator in a Lightning fit: Lightning's device move refused the batch (its
    grids were a frozen dataclass, which ``apply_to_collection`` rebuilds), and a forward on rank
    0 alone in a callback (sample logging, direct as any hook's call) planned from the grids its
    batch carries: a gather on rank 0 alone. The fit gives the plain model's losses."""
    with multirank(FIT_RANKS) as pool:
        pool.run(_fit_of, str(tmp_path), "collated", timeout=200)
    _assert_plain_losses(tmp_path)
    _logged_calls(tmp_path)  # the hook's: direct


@pytest.mark.timeout(240)
def test_the_plan_ahead_collator_next_to_the_mixins_plan_ahead(tmp_path: Path, multirank: Any) -> None:
    """Both ways of planning ahead at once: the collator's grids planned every forward again, a
    gather in each, though the mixin's batch hook had planned it. The hook's plan serves now."""
    with multirank(FIT_RANKS) as pool:
        plans = pool.run(_fit_of, str(tmp_path), "collated and planned ahead", timeout=200)
    assert plans == [FIT_STEPS] * FIT_RANKS, plans  # the batch hook's, one per step
    _assert_plain_losses(tmp_path)
    _assert_no_gather_in_the_forward(_logged_calls(tmp_path))


@pytest.mark.timeout(240)
def test_the_plan_ahead_collator_in_a_mapping_of_loaders(tmp_path: Path, multirank: Any) -> None:
    """The mixin's plan of the outer batch (no images: it holds the loaders' batches) waited when
    the forward came with the inner batch's collated grids, which the fix of the double plan above
    then took for planned: every rank raised that the forward's images were not in the plan. A
    waiting plan serves only the batch that carries those grids; this one plans from them."""
    with multirank(FIT_RANKS) as pool:
        plans = pool.run(_fit_of, str(tmp_path), "collated in a mapping", timeout=200)
    assert plans == [2 * FIT_STEPS] * FIT_RANKS, plans  # the outer batch's, then the inner one's
    _assert_plain_losses(tmp_path)


@pytest.mark.timeout(240)
def test_plans_made_ahead_with_towers_of_two_dtypes(tmp_path: Path, multirank: Any) -> None:
    """Towers of different dtypes plan the batch's own rows (float32 here); the bf16 teacher's
    call, first in the step, took that plan and every rank raised that its pixel rows were bf16.
    A plan made for rows of another dtype is left to the tower of that dtype; the teacher plans
    in its call. The student's losses are the plain model's."""
    with multirank(FIT_RANKS) as pool:
        pool.run(_fit_of, str(tmp_path), "distilled", timeout=200)
    _assert_plain_losses(tmp_path)


@pytest.mark.timeout(240)
def test_a_plan_asked_for_on_one_rank_where_nothing_balances(tmp_path: Path, multirank: Any) -> None:
    """``handle.prepare`` on rank 0 alone in a validation that does not balance returns None; the
    fit's end then made the gather that reports a last call's mismatch on rank 0 alone (it took
    the None for a plan made ahead). Only calls that took a plan are reported on."""
    with multirank(FIT_RANKS) as pool:
        pool.run(_fit_of, str(tmp_path), "sampled", timeout=200)
    _assert_plain_losses(tmp_path)


class HFValidated(HFFinetune):
    """:class:`HFFinetune` with ``plan_ahead``, validating on a ``DistributedSampler`` loader of the
    fit's batches (each rank collates its own): each validation step notes its loss, whether its
    balanced forward took a plan made before it, and that forward's collectives. It predicts the
    fit's first 3 batches, which Lightning's predict sampler splits 2 / 1: each predict step notes
    the same, and whether its forward was balanced."""

    vit_balance_predict = True

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir, balanced=True, plan_ahead=True)
        self.validated: list[tuple[float, bool, int, str]] = []
        self.predicted: list[tuple[float, bool, bool, int, str]] = []

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        before = self.last_vit_balance_stats
        loss = float(self.model(**batch).loss)
        stats = self.last_vit_balance_stats
        if stats is not None and stats is not before and stats.num_ranks == FIT_RANKS:
            self.predicted.append((loss, True, stats.prepare_seconds > 0, stats.collectives, stats.reason))
        else:
            self.predicted.append((loss, False, False, 0, "direct"))

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler

        # What Lightning injects in predict (use_distributed_sampler is off here): steps 0, 2 | 1.
        sampler = UnrepeatedDistributedSampler(list(range(3)), shuffle=False)
        return torch.utils.data.DataLoader(
            list(range(3)), batch_size=1, sampler=sampler, collate_fn=self._collate
        )

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        before = self.last_vit_balance_stats
        loss = float(self.model(**batch).loss)
        stats = self.last_vit_balance_stats
        assert stats is not None and stats is not before, "the evaluation forward was not balanced"
        self.validated.append((loss, stats.prepare_seconds > 0, stats.collectives, stats.reason))

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        steps = list(range(FIT_STEPS))
        sampler = torch.utils.data.DistributedSampler(steps, shuffle=False)  # steps 0, 2 | 1, 3
        return torch.utils.data.DataLoader(steps, batch_size=1, sampler=sampler, collate_fn=self._collate)

    def _collate(self, indices: list[int]) -> dict[str, Any]:
        return fit_batch(indices[0], self.global_rank)


def _lightning_validation(out_dir: str) -> tuple[list[tuple[float, bool, int, str]], list[Any]]:
    module = HFValidated(out_dir)
    with launched_by_torchrun():
        trainer = quiet_trainer(
            out_dir, "validate", devices=FIT_RANKS, strategy="ddp", callbacks=[], logger=False
        )
        trainer.validate(module, verbose=False)
        trainer.predict(module, return_predictions=False)
    return module.validated, module.predicted


@pytest.mark.timeout(240)
def test_lightning_validation_plans_ahead_with_the_drop_in(tmp_path: Path, multirank: Any) -> None:
    """``plan_ahead`` under ``trainer.validate`` on a ``DistributedSampler``: each evaluation forward
    of the mixin's drop-in (a text-only rank, images and videos) takes the plan made in
    ``on_before_batch_transfer`` (no metadata gather: 3 collectives, or none where the plan skips)
    and gives the plain model's losses. So does ``trainer.predict`` in the batches every rank runs;
    rank 0's second batch, which rank 1 lacks, is encoded directly."""
    with multirank(FIT_RANKS) as pool:
        ranks = pool.run(_lightning_validation, str(tmp_path), timeout=200)
    model = tiny_model(FIT_FAMILY).eval()
    for rank, (validated, predicted) in enumerate(ranks):
        with torch.no_grad():
            expected = [float(model(**fit_batch(step, rank)).loss) for step in range(FIT_STEPS)]
        steps = range(rank, FIT_STEPS, FIT_RANKS)
        torch.testing.assert_close([loss for loss, *_ in validated], [expected[s] for s in steps], **TOL)
        assert all(
            prepared and collectives == (3 if reason == "applied" else int(reason == "no-images"))
            for _, prepared, collectives, reason in validated
        ), validated
        steps = range(rank, 3, FIT_RANKS)  # Lightning's predict sampler: steps 0, 2 | 1
        torch.testing.assert_close([loss for loss, *_ in predicted], [expected[s] for s in steps], **TOL)
        assert [balanced for _, balanced, *_ in predicted] == [True, False][: len(steps)], predicted
        assert predicted[0][2:] == (True, 3, "applied"), predicted  # planned ahead, images moved


def _training_arguments(out_dir: str, max_steps: int, **settings: Any) -> Any:
    """Hugging Face's ``TrainingArguments`` on the pool's gloo CPU ranks: one batch per rank and
    step, nothing logged or reported; ``settings`` add to them."""
    from transformers import TrainingArguments

    defaults: dict[str, Any] = {"report_to": [], "logging_strategy": "no", "disable_tqdm": True}
    return TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=1,
        max_steps=max_steps,
        **{**defaults, **settings},
    )


class _LogRecorder(TrainerCallback):
    """Stands in for a reporting integration (W&B, TensorBoard): records each log's
    ``vit_balance/*`` figures as it receives them."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.append(_balance_figures(logs or {}))


def _balance_figures(log: dict[str, Any]) -> dict[str, float]:
    return {key: value for key, value in log.items() if key.startswith("vit_balance/")}


def _hf_trainer_fit(out_dir: str, plan_ahead: bool = False) -> dict[str, Any]:
    """Hugging Face's ``Trainer`` (DDP over the pool's gloo group, which accelerate takes as it
    finds it) on the drop-in: each rank's batches of :data:`FIT_BATCHES` in order, SGD at a
    constant rate, no clipping; the loss of each step, the handle's counts and each balanced
    call's collectives, whether it applied and whether a plan was made before it. ``plan_ahead``:
    the batches come from ``handle.plan_ahead``'s collator."""
    import torch.distributed as dist
    from transformers import Trainer

    size = dist.get_world_size()
    # The group exists, so accelerate never uses the port.
    set_launcher_variables(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model, ViTBalanceConfig(**CONFIG))
    collectives: list[tuple[int, bool, bool, str]] = []
    handle.record = lambda stats: collectives.append(
        (stats.collectives, stats.applied, stats.prepare_seconds > 0.0, stats.reason)
    )
    losses: list[float] = []

    class InOrder(Trainer):
        """Item ``step * size + r`` is rank ``r``'s batch of that step: accelerate's shards of a
        sequential sampler hand each rank its own."""

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append(float(loss.detach()))
            return loss

    arguments = _training_arguments(
        out_dir,
        FIT_STEPS,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=2,
    )
    batches = [fit_batch(step, r) for step in range(FIT_STEPS) for r in range(size)]
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    reporter = _LogRecorder()  # passed to the Trainer: it runs before callbacks added later
    trainer = InOrder(
        model=model,
        args=arguments,
        train_dataset=batches,
        data_collator=handle.plan_ahead(_first) if plan_ahead else _first,
        optimizers=(optimizer, None),
        callbacks=[reporter],
    )
    ViTBalanceTrainerCallback().attach(trainer)
    trainer.train()
    history = [_balance_figures(entry) for entry in trainer.state.log_history]
    return {
        "collectives": collectives,
        "losses": losses,
        "calls": handle.calls,
        "applied_calls": handle.applied_calls,
        "reported": reporter.logs,
        "history": history,
    }


def _last_evaluation_forward_reordered(out_dir: str, entry: str) -> str:
    """``trainer.evaluate()`` or ``trainer.predict()`` (``entry``) alone, of a drop-in that balances
    evaluation, on batches from ``handle.plan_ahead``'s collator, grids compared as on a device:
    rank 1's last forward passes its grid rows reordered (same shape, other values). What the
    entry raised, or ``"no error"``."""
    from transformers import Trainer

    set_launcher_variables(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    handle = balance_vision_tower(tiny_model(FIT_FAMILY), ViTBalanceConfig(**CONFIG), evaluation=True)
    forwards = iter(range(2))

    class LastReordered(Trainer):
        def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if next(forwards) == 1 and rank == 1:  # rank 1's last batch holds two images
                inputs = {**inputs, "image_grid_thw": inputs["image_grid_thw"].roll(1, 0)}
            return super().compute_loss(model, inputs, *args, **kwargs)

    batches = [fit_batch(step, r) for step in (0, 2) for r in range(size)]
    arguments = _training_arguments(out_dir, 1, per_device_eval_batch_size=1, prediction_loss_only=True)
    trainer = LastReordered(model=handle.model, args=arguments, data_collator=handle.plan_ahead(_first))
    ViTBalanceTrainerCallback().attach(trainer)
    with (
        mock.patch.object(prepared_module, "_read_on_host", lambda tensor: False),
        caught(ValueError) as outcome,
    ):
        trainer.evaluate(batches) if entry == "evaluate" else trainer.predict(batches)
    return outcome.message


def _evaluation_logged(out_dir: str) -> tuple[dict[str, float], list[tuple[float, ...]]]:
    """``trainer.predict()``, then ``trainer.evaluate()``, of a drop-in that balances evaluation
    (two forwards a rank each): the ``vit_balance`` figures of the dict ``evaluate`` returns, and
    the ViT times its forwards reported."""
    from transformers import Trainer

    set_launcher_variables(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    size = torch.distributed.get_world_size()
    handle = balance_vision_tower(tiny_model(FIT_FAMILY), ViTBalanceConfig(**CONFIG), evaluation=True)
    batches = [fit_batch(step, r) for step in (0, 2) for r in range(size)]
    arguments = _training_arguments(out_dir, 1, per_device_eval_batch_size=1, prediction_loss_only=True)
    trainer = Trainer(model=handle.model, args=arguments, data_collator=_first)
    ViTBalanceTrainerCallback().attach(trainer)
    trainer.predict(batches)
    popped, pop = [], handle.pop_stats

    def pop_and_keep(**which: Any) -> list[Any]:
        stats = pop(**which)
        popped.extend(stats)
        return stats

    handle.pop_stats = pop_and_keep  # type: ignore[method-assign]
    figures = {key: value for key, value in trainer.evaluate(batches).items() if "vit_balance" in key}
    return figures, [stats.vit_ms for stats in popped]


def _trains_as_the_plain_model(tmp_path: Path, plan_ahead: bool) -> list[dict[str, Any]]:
    """:func:`_hf_trainer_fit` on a pool of its own (accelerate's state and the launcher's variables
    are process-wide), each rank's losses checked against the plain model's; the results. With
    ``plan_ahead``, :func:`_last_evaluation_forward_reordered` follows in the pool: each entry's
    mismatch is reported on every rank."""
    pool = World(FIT_RANKS)
    try:
        results = pool.run(_hf_trainer_fit, str(tmp_path), plan_ahead, timeout=150)
        for entry in ("evaluate", "predict") if plan_ahead else ():
            told = pool.run(_last_evaluation_forward_reordered, str(tmp_path / entry), entry, timeout=120)
            expected = "rank 1: an earlier call given a prepared plan passed a grid_thw"
            assert all(expected in message for message in told), (entry, told)
        if not plan_ahead:  # the evaluation's forwards, in the dict evaluate() returns
            evaluated, reported = zip(*pool.run(_evaluation_logged, str(tmp_path / "evaluate"), timeout=120))
            assert all(key.startswith("eval_vit_balance/") for key in evaluated[0]), evaluated
            # The plans' figures are the same on each rank; timings and bytes are each rank's own.
            own = ("_ms", "bytes_sent", "bytes_received")
            plans = [{k: v for k, v in e.items() if not k.endswith(own)} for e in evaluated]
            assert plans[0] == plans[1] and plans[0]["eval_vit_balance/applied"] > 0, evaluated
            assert plans[0]["eval_vit_balance/calls"] == plans[0]["eval_vit_balance/calls_total"] == 2.0
            sent, received = (
                evaluated[r][f"eval_vit_balance/bytes_{w}"] for r, w in ((0, "sent"), (1, "received"))
            )
            assert sent == received > 0, evaluated
            # Its first forward reports no ViT time: not the prediction's last forward's, its clocks
            # forgotten at the prediction's end; its second, the first's.
            for times in reported:
                assert times[0] == (-1.0,) * FIT_RANKS and min(times[1]) > 0, reported
    finally:
        pool.close(kill=True)
    expected = _reference(tiny_model(FIT_FAMILY))
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result["losses"]), expected[rank], **TOL)
        assert result["calls"] == FIT_STEPS and result["applied_calls"] >= 1, result
    return results


@pytest.mark.timeout(180)
def test_hugging_face_trainer_trains_as_the_plain_model(tmp_path: Path) -> None:
    """``balance_vision_tower(model)`` then Hugging Face's ``Trainer`` under DDP, 2 ranks with a
    text-only rank and images next to videos: each rank's loss of every step is the plain model's
    (DDP by hand)."""
    results = _trains_as_the_plain_model(tmp_path, plan_ahead=False)
    # ViTBalanceTrainerCallback.attach: the reporter the Trainer holds from its start (as it holds
    # W&B's or TensorBoard's) gets every training log's vit_balance/* metrics: 2 steps a log.
    reported = [[log for log in r["reported"] if log] for r in results]
    first, last = reported[0]
    assert (first["vit_balance/calls"], first["vit_balance/calls_total"]) == (2.0, 2.0), first
    assert (last["vit_balance/calls"], last["vit_balance/calls_total"]) == (2.0, FIT_STEPS), last
    assert last["vit_balance/applied_total"] == results[0]["applied_calls"]
    assert last["vit_balance/skipped/no-images"] == 1.0  # the last step: text alone on every rank
    assert {
        "vit_balance/load_before/rank_1",
        "vit_balance/vit_ms_max",
        "vit_balance/vit_ms_slowest_rank",
    } <= set(last), last
    # The same plans on every rank: the same figures, but each rank's own bytes.
    for key in ("vit_balance/imbalance_before", "vit_balance/imbalance_after", "vit_balance/moved_patches"):
        assert reported[1][0][key] == first[key] and reported[1][1][key] == last[key], key
    # And the Trainer's log history (trainer_state.json) keeps them.
    assert [entry for entry in results[0]["history"] if entry] == reported[0]
    # Each balanced call gathered its metadata itself, and nothing was prepared.
    calls = [call for r in results for call in r["collectives"]]
    assert all(call[:2] in ((4, True), (1, False)) and not call[2] for call in calls), results
    assert all(log["vit_balance/prepare_ms"] == 0.0 for log in reported[0]), reported[0]


@pytest.mark.timeout(180)
def test_hugging_face_trainer_plans_from_the_collators_host_grids(tmp_path: Path) -> None:
    """``data_collator=handle.plan_ahead(collate)``: the same losses as the plain model, and every
    balanced call took the plan made at the start of the forward from the grids the collator kept
    on the host (accelerate and the Trainer moved the rest of the batch): no metadata gather in it,
    so on a GPU no grid is read back from the device. A standalone ``evaluate``/``predict`` whose
    last forward's grid differs on the device from its plan's raises on every rank at its end
    (no later gather reads it: that forward's outputs were wrong, with no error)."""
    for result in _trains_as_the_plain_model(tmp_path, plan_ahead=True):
        # Skipped calls make none, but the status word where no rank has images.
        expected = {"applied": (3, True), "no-images": (1, False)}
        assert all(
            call[:2] == expected.get(call[3], (0, False)) and call[2] for call in result["collectives"]
        ), result
        # The preparation's gather and plan are timed apart from the call's (vit_balance/prepare_ms).
        logs = [log for log in result["reported"] if log]
        assert all(log["vit_balance/prepare_ms"] > 0.0 for log in logs), logs
        assert all(log["vit_balance/plan_ms"] == 0.0 for log in logs), logs


# Saved at step 5, resumed to step 10: enough calls for each run to warm up and record rows.
RESUME_SAVED_AT, RESUME_STEPS = 5, 10


def _hf_trainer_run(
    out_dir: str, max_steps: int, resume_from: str | None, restore_callbacks: bool = False
) -> dict[str, Any]:
    """A calibrating drop-in under Hugging Face's ``Trainer`` with the checkpoint callback, the
    batches of :data:`FIT_BATCHES` in turn, logging every step: saves at :data:`RESUME_SAVED_AT`
    when not resuming; the handle's state at the end, and the logged ``calls_total`` counts."""
    from transformers import Trainer

    size = torch.distributed.get_world_size()
    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model, ViTBalanceConfig(**CONFIG, calibrate_cost=True))
    arguments = _training_arguments(
        out_dir,
        max_steps,
        save_strategy="no" if resume_from else "steps",
        save_steps=RESUME_SAVED_AT,
        restore_callback_states_from_checkpoint=restore_callbacks,
        logging_strategy="steps",
        logging_steps=1,
    )
    batches = [fit_batch(step % FIT_STEPS, r) for step in range(max_steps) for r in range(size)]
    # Plain SGD keeps no tensors in its state: transformers 4.57 loads an optimizer state saved on
    # several CPU ranks to the device "cpu:0", which torch cannot restore.
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=batches,
        data_collator=_first,
        optimizers=(optimizer, None),
        callbacks=[ViTBalanceTrainerCallback()],
    )
    trainer.train(resume_from_checkpoint=resume_from)
    torch.distributed.barrier()  # rank 0 has written its checkpoint before any rank reads it
    counts = [e["vit_balance/calls_total"] for e in trainer.state.log_history if "vit_balance/calls" in e]
    return {**handle.state_dict(), "calls_total": counts}


def _hf_trainer_resume(out_dir: str) -> dict[str, Any]:
    """Train to the checkpoint, then resume from it twice: with Hugging Face's callback restore
    off (its default) and on."""
    set_launcher_variables(MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    first = _hf_trainer_run(out_dir, RESUME_SAVED_AT, None)
    checkpoint = Path(out_dir) / f"checkpoint-{RESUME_SAVED_AT}"
    trainer_state = json.loads((checkpoint / "trainer_state.json").read_text())
    saved = trainer_state["stateful_callbacks"]["ViTBalanceTrainerCallback"]["attributes"]["balancer_state"]
    resumed = [_hf_trainer_run(out_dir, RESUME_STEPS, str(checkpoint), flag) for flag in (False, True)]
    return {"first": first, "saved": saved, "resumed": resumed}


@pytest.mark.timeout(180)
def test_hugging_face_trainer_checkpoints_carry_the_cost_fit(tmp_path: Path) -> None:
    """``ViTBalanceTrainerCallback`` keeps the calibrating handle's state in ``trainer_state.json``
    and a resumed run goes on from it on every rank: the same counters, the saved rows first.
    In a pool of its own (accelerate's state is process-wide)."""
    pool = World(FIT_RANKS)
    try:
        results = pool.run(_hf_trainer_resume, str(tmp_path), timeout=150)
    finally:
        pool.close(kill=True)
    saved = results[0]["saved"]["cost_calibrator"]
    # Every call of a run but its first observes the time of the call before (so 4 of 5), and
    # after two warm-up observations with a time the steps give rows.
    assert saved["steps_observed"] == RESUME_SAVED_AT - 1 and saved["history"], saved
    for result in results:
        # The metrics' counts go on from the checkpoint's too, with the callback restore off or on.
        assert result["first"].pop("calls_total") == list(range(1, RESUME_SAVED_AT + 1))
        for resumed in result["resumed"]:  # the checkpoint's log history, then the resumed steps
            assert resumed.pop("calls_total") == list(range(1, RESUME_STEPS + 1))
        assert result["first"] == result["saved"]  # every rank held what rank 0 saved
        for resumed in result["resumed"]:
            fit = resumed["cost_calibrator"]
            # The resumed process counts on (4 more) and warms up again; its rows follow the saved.
            assert fit["steps_observed"] == saved["steps_observed"] + 4, fit
            kept = len(saved["history"])
            assert fit["history"][:kept] == saved["history"] and len(fit["history"]) > kept, fit
    # The dashboard draws from the output directory: its latest trainer_state.json's log history.
    import plot_vit_balance

    metrics = plot_vit_balance.load_metrics(tmp_path)
    assert metrics["vit_balance/calls_total"] == [(s, float(s)) for s in range(1, RESUME_SAVED_AT + 1)]
    assert {"vit_balance/load_after/rank_1", "vit_balance/vit_ms/rank_1"} <= set(metrics)
    assert plot_vit_balance.main([str(tmp_path), "-o", str(tmp_path / "dash.png")]).stat().st_size > 1000


def _calibrator_state(window_patches: int = 0) -> dict[str, Any]:
    """A fitted calibrator's state (l**2 images, 2 ranks, 6 steps), as ``ViTBalancer`` keeps it."""
    calibrator = CostCalibrator(CostModel(window_patches=window_patches), warmup_steps=0, min_rank_steps=4)
    for step in range(6):
        counts = [[64 * (step + 1), 16], [256 + 32 * step]]
        calibrator.observe(counts, [1e-4 * sum(n * n for n in row) + 0.5 for row in counts])
    assert calibrator.fits > 0
    return {"cost_calibrator": calibrator.state_dict()}


def _calibrating_through_a_schedule(change_every_step: bool) -> dict[str, Any]:
    """Worker: a calibrating drop-in over 12 training steps, its configuration changed before
    every step or never; the fit's counters and each call's measured ViT times."""
    model = tiny_model(FIT_FAMILY)
    base = ViTBalanceConfig(**CONFIG, calibrate_cost=True)
    handle = balance_vision_tower(model, base)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    rank, vit_ms = torch.distributed.get_rank(), []
    for step in range(12):
        if change_every_step:  # a schedule: a configuration not seen before at every step
            handle.config = dataclasses.replace(base, trigger_threshold=1e-3 * step)
        model(**fit_batch(step % FIT_STEPS, rank)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        vit_ms.append(list(handle.last_stats.vit_ms) if handle.last_stats is not None else None)
    state = handle.state_dict()["cost_calibrator"]
    return {"observed": state["steps_observed"], "rows": sum(map(len, state["history"])), "vit_ms": vit_ms}


def _training_around_an_evaluation_of_its_own_configuration() -> str:
    """Worker: a drop-in balancing evaluation too, through :func:`measured_around_an_evaluation`."""
    rank = torch.distributed.get_rank()
    model = tiny_model(FIT_FAMILY)
    training = ViTBalanceConfig(**CONFIG, calibrate_cost=True)
    handle = balance_vision_tower(model, training, evaluation=True)

    def step(index: int, config: ViTBalanceConfig, in_training: bool) -> tuple[float, ...]:
        handle.config = config
        model.train(in_training)
        output = model(**fit_batch(index % FIT_STEPS, rank))
        if in_training:
            output.loss.backward()
        return handle.last_stats.vit_ms

    return measured_around_an_evaluation(training, FIT_RANKS, step)


def test_a_configuration_schedule_keeps_the_cost_fit_and_the_measured_times(multirank: Any) -> None:
    """A configuration new at every step had made a balancer that went on from the fit as from a
    checkpoint: its warm-up started again and its clock was new, so no call was ever fitted or
    reported (steps_observed 0). It now goes on as where the configuration never changes."""
    with multirank(FIT_RANKS) as pool:
        scheduled = pool.run(_calibrating_through_a_schedule, True)
        steady = pool.run(_calibrating_through_a_schedule, False)
        around = pool.run(_training_around_an_evaluation_of_its_own_configuration)
    # The handle lets its balancer go at each change: the training clock comes along through the
    # evaluation (the first training forward after it had reported nothing).
    assert around == ["T0 T1 T1 V0 V1 T1 T1 T1"] * FIT_RANKS, around
    for got, expected in zip(scheduled, steady):
        # Rows kept are not compared: the too-fast screen drops rows against a fit of wall-clock
        # times, a count that varies from run to run; it drops from at most every other step.
        assert got["observed"] == expected["observed"] >= 8, (got, expected)
        assert got["rows"] > got["observed"] and expected["rows"] > expected["observed"], (got, expected)
        measured = [ms is not None and len(ms) == FIT_RANKS and min(ms) >= 0 for ms in got["vit_ms"]]
        assert measured == [
            ms is not None and len(ms) == FIT_RANKS and min(ms) >= 0 for ms in expected["vit_ms"]
        ]
        assert sum(measured) >= 6, got


def test_handle_state_round_trips_and_refuses_a_fit_of_other_terms() -> None:
    """``BalancedVisionTower.state_dict`` / ``load_state_dict`` without a process group: a loaded
    fit is what the next balancer starts from, also after the configuration changes; a fit of
    other terms is refused (nothing changes) or, on a configuration change, left behind with a
    warning."""
    model = tiny_model(FIT_FAMILY)
    config = ViTBalanceConfig(**CONFIG, calibrate_cost=True)
    handle = balance_vision_tower(model, config)
    assert handle.state_dict() == {}
    state = _calibrator_state()
    handle.load_state_dict(json.loads(json.dumps(state)))
    assert handle.state_dict() == state
    with pytest.raises(ValueError, match=r"load_state_dict: state='fit' is invalid: expected a mapping"):
        handle.load_state_dict("fit")  # type: ignore[arg-type]
    refused = r"state\['window_patches'\]=64, but this calibrator fits window_patches=0"
    with pytest.raises(ValueError, match=refused):
        handle.load_state_dict(_calibrator_state(window_patches=64))
    assert handle.state_dict() == state
    # Another configuration (or group) rebuilds the balancer, which goes on from the fit.
    handle.config = ViTBalanceConfig(**CONFIG, calibrate_cost=True, min_gain=0.1)
    assert handle._balancer_for(handle.config, None).state_dict() == state
    handle.config = ViTBalanceConfig(**CONFIG, calibrate_cost=True, cost_window_patches=64)
    left_behind = r"cost fit of the previous configuration is not used .*window_patches"
    with pytest.warns(RuntimeWarning, match=left_behind):
        handle._balancer_for(handle.config, None)
    assert handle.state_dict()["cost_calibrator"]["steps_observed"] == 0
    # Without calibration there is nothing to keep.
    plain = balance_vision_tower(tiny_model(FIT_FAMILY), ViTBalanceConfig(**CONFIG))
    plain.load_state_dict(state)
    assert plain.state_dict() == {}


def test_trainer_callback_attaches_once_to_a_hugging_face_trainer() -> None:
    """Two callbacks (one in callbacks=, one attached, both as the README shows) logged each
    figure twice and, after a resume, the second overwrote the first's window: attach hands back
    the one the trainer holds (the user's, or the copy a resumed Trainer restored in its place). A
    Lightning Trainer raised an AttributeError; a string flag read as True."""
    from types import SimpleNamespace

    class Trainer:  # what attach reads of a transformers.Trainer (weakly referenced)
        def __init__(self, callbacks: list[Any]) -> None:
            self.callback_handler = SimpleNamespace(callbacks=callbacks)

        def add_callback(self, callback: Any) -> None:
            self.callback_handler.callbacks.append(callback)

    held = ViTBalanceTrainerCallback()
    trainer = Trainer([held])
    assert ViTBalanceTrainerCallback().attach(trainer) is held
    assert held.attach(trainer) is held
    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ViTBalanceTrainerCallback)]
    assert found == [held] and len(trainer.callback_handler.callbacks) == 2  # and the metrics-first helper
    alone = Trainer([])
    attached = ViTBalanceTrainerCallback()
    assert attached.attach(alone) is attached and attached in alone.callback_handler.callbacks
    with pytest.raises(TypeError, match=r"attach\(trainer=None\) is invalid: expected a Hugging Face"):
        ViTBalanceTrainerCallback().attach(None)
    with pytest.raises(ValueError, match=r"\(log_per_rank_loads='false'\) is invalid: expected a bool"):
        ViTBalanceTrainerCallback(log_per_rank_loads="false")


def _scripted_stats(config: ViTBalanceConfig | None = None) -> tuple[nn.Module, list[Any]]:
    """A tiny model given to ``balance_vision_tower`` (``config``) whose handle's ``pop_stats`` hands
    out, and forgets, what the test puts in the returned queue (whatever ``training`` asks)."""
    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model, config)
    queued: list[Any] = []
    handle.pop_stats = lambda **_: [queued.pop(0) for _ in range(len(queued))]  # type: ignore[method-assign]
    return model, queued


def test_trainer_callback_counts_a_fresh_run_from_zero() -> None:
    """One callback for several runs (a hyperparameter search's trials reuse theirs): a fresh run's
    ``TrainerState`` holds the callback's own counts of a moment ago, and the second run logged
    ``calls_total`` 3, 4 after the first's 1, 2, and a new model's handle went on from the last
    handle's cost fit. A resumed run (its state at a step) counts on."""
    from test_metrics import APPLIED
    from transformers import TrainerState
    from transformers.trainer_callback import TrainerControl

    model, queued = _scripted_stats(ViTBalanceConfig(**CONFIG, calibrate_cost=True))
    callback, control = ViTBalanceTrainerCallback(), TrainerControl()
    totals = []
    for resumed_at in (0, 0, 2):
        # As the Trainer builds it: a fresh state snapshots its stateful callbacks; a resumed one
        # is read from the checkpoint, at its step.
        state = TrainerState(stateful_callbacks=[callback])
        state.global_step = resumed_at
        callback.on_train_begin(None, state, control, model=model)  # type: ignore[arg-type]
        for _ in range(2):
            callback.on_step_begin(None, state, control)  # type: ignore[arg-type]
            queued.append(APPLIED)
            callback.on_step_end(None, state, control)  # type: ignore[arg-type]
            state.global_step += 1
            logs = {"loss": 1.0}
            callback.on_log(None, state, control, logs=logs)  # type: ignore[arg-type]
            totals.append(logs["vit_balance/calls_total"])
    assert totals == [1.0, 2.0, 1.0, 2.0, 3.0, 4.0], totals
    # The next trial's new model starts its cost fit afresh, not from the last trial's handle.
    trial = balance_vision_tower(tiny_model(FIT_FAMILY), ViTBalanceConfig(**CONFIG, calibrate_cost=True))
    fresh_fit = trial.state_dict()
    BalancedVisionTower.of(model).load_state_dict(_calibrator_state())
    callback.on_train_begin(None, TrainerState(stateful_callbacks=[callback]), control, model=trial.base)  # type: ignore[arg-type]
    assert trial.state_dict() == fresh_fit


def test_trainer_callback_logs_every_forward_of_a_step_in_training_logs_only() -> None:
    """Each optimizer step's forwards (every micro-batch of gradient accumulation) go into the
    next training log; forwards between steps (evaluation) and logs without ``loss`` (evaluation,
    the run's summary) are left out."""
    from test_metrics import APPLIED, SKIPPED
    from transformers import TrainerState
    from transformers.trainer_callback import TrainerControl

    model, queued = _scripted_stats()
    callback, state, control = ViTBalanceTrainerCallback(), TrainerState(), TrainerControl()
    callback.on_train_begin(None, state, control, model=model)  # type: ignore[arg-type]
    for step, forwards in enumerate([[APPLIED, SKIPPED], [SKIPPED]], start=1):
        queued[:] = [APPLIED]  # an evaluation forward before the step: not counted
        callback.on_step_begin(None, state, control)  # type: ignore[arg-type]
        queued.extend(forwards)
        callback.on_step_end(None, state, control)  # type: ignore[arg-type]
        state.global_step = step
    evaluation = {"eval_loss": 1.0}
    callback.on_log(None, state, control, logs=evaluation)  # type: ignore[arg-type]
    assert evaluation == {"eval_loss": 1.0}
    state.log_history.append({"loss": 2.0, "step": 2})
    logs = {"loss": 2.0}
    callback.on_log(None, state, control, logs=logs)  # type: ignore[arg-type]
    assert (logs["vit_balance/calls"], logs["vit_balance/applied"]) == (3.0, pytest.approx(1 / 3))
    assert logs["vit_balance/calls_total"] == 3.0 and state.log_history[-1] == {**logs, "step": 2}
    later = {"loss": 1.5}
    callback.on_log(None, state, control, logs=later)  # type: ignore[arg-type]
    assert later == {"loss": 1.5}  # no forward since the last log


def test_trainer_callback_logs_an_evaluations_forwards_under_its_prefix() -> None:
    """An evaluation's log (the Trainer's ``{prefix}_runtime`` and ``{prefix}_samples_per_second``
    in it: ``evaluate()``, in training or alone) gets its forwards under its prefix, counted alone,
    in the log and its history entry; they had been dropped. A ``compute_metrics`` figure ending
    in ``_runtime`` does not hide the prefix; a prediction's forwards go to no log, and the run's
    summary (``train_runtime``) gets nothing."""
    from test_metrics import APPLIED, SKIPPED
    from transformers import TrainerState
    from transformers.trainer_callback import TrainerControl

    model, queued = _scripted_stats()
    callback, state, control = ViTBalanceTrainerCallback(), TrainerState(), TrainerControl()
    callback.on_init_end(None, state, control, model=model)  # type: ignore[arg-type]
    queued[:] = [APPLIED, SKIPPED]  # evaluate() before any training
    logs = {"eval_loss": 1.0, "eval_model_runtime": 3.0, "eval_runtime": 0.5, "eval_samples_per_second": 8.0}
    state.log_history.append({**logs, "step": 0})
    callback.on_log(None, state, control, logs=logs)  # type: ignore[arg-type]
    assert (logs["eval_vit_balance/calls"], logs["eval_vit_balance/applied"]) == (2.0, 0.5), logs
    assert logs["eval_vit_balance/calls_total"] == 2.0 and state.log_history[-1] == {**logs, "step": 0}
    assert logs["eval_vit_balance/vit_ms_max"] == pytest.approx((30.0 + 20.0) / 2)
    queued[:] = [APPLIED]
    callback.on_predict(None, state, control, model=model)  # type: ignore[arg-type]
    queued.append(SKIPPED)  # one dataset of several: evaluate()'s own prefix
    named = {"eval_photos_loss": 1.0, "eval_photos_runtime": 0.1, "eval_photos_samples_per_second": 9.0}
    callback.on_log(None, state, control, logs=named)  # type: ignore[arg-type]
    assert named["eval_photos_vit_balance/calls_total"] == 1.0 and all(
        k.startswith("eval_photos_") for k in named
    )
    queued.append(APPLIED)
    summary = {"train_runtime": 1.0, "train_samples_per_second": 4.0, "train_loss": 2.0}
    callback.on_log(None, state, control, logs=summary)  # type: ignore[arg-type]
    assert summary == {"train_runtime": 1.0, "train_samples_per_second": 4.0, "train_loss": 2.0}


def test_trainer_callback_counts_every_forward_of_an_evaluation_also_after_training() -> None:
    """An evaluation's log counts all its forwards: more than the handle keeps between reads
    (``KEPT_STATS``: they are read at each prediction step), and in an ``evaluate()`` after
    ``train()`` too (whose end lets the handle's reader go: 1024 and nothing had been logged); an
    evaluation whose log has no evaluation prefix (``metric_key_prefix="train"``) leaves none of
    its forwards to the next one's."""
    from test_metrics import APPLIED
    from transformers import TrainerState
    from transformers.trainer_callback import TrainerControl

    from lightning_vit_balance.hf import KEPT_STATS

    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model)
    callback, state, control = ViTBalanceTrainerCallback(), TrainerState(), TrainerControl()
    callback.on_init_end(None, state, control, model=model)  # type: ignore[arg-type]

    def evaluate(forwards: int, prefix: str = "eval") -> Any:
        model.eval()  # as the Trainer's evaluation loop puts it
        for _ in range(forwards):
            handle._count(APPLIED, None)  # what a balanced forward keeps
            callback.on_prediction_step(None, state, control, model=model)  # type: ignore[arg-type]
        logs = {f"{prefix}_loss": 1.0, f"{prefix}_runtime": 0.5, f"{prefix}_samples_per_second": 8.0}
        callback.on_log(None, state, control, logs=logs, model=model)  # type: ignore[arg-type]
        callback.on_evaluate(None, state, control, model=model)  # type: ignore[arg-type]
        return logs.get(f"{prefix}_vit_balance/calls_total")

    assert evaluate(KEPT_STATS + 5) == KEPT_STATS + 5
    callback.on_train_begin(None, state, control, model=model)  # type: ignore[arg-type]
    callback.on_train_end(None, state, control, model=model)  # type: ignore[arg-type]
    assert evaluate(3) == 3
    assert evaluate(5, prefix="train") is None and evaluate(3) == 3


def test_an_evaluation_a_callback_runs_before_the_steps_figures_are_read_keeps_both_apart() -> None:
    """A callback ahead of this one (``attach`` adds it after those given) that evaluates or
    predicts in ``on_step_end``: its evaluation's first step had taken the training step's
    forwards as its own (or the prediction's end dropped them). Each forward now goes to its loop:
    the handle keeps whether it was a training forward (``pop_stats(training=...)``). An evaluation
    that raised leaves none of its forwards to the next one."""
    from test_metrics import APPLIED, SKIPPED
    from transformers import TrainerState
    from transformers.trainer_callback import TrainerControl

    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model)
    callback, state, control = ViTBalanceTrainerCallback(), TrainerState(), TrainerControl()
    callback.on_train_begin(None, state, control, model=model)  # type: ignore[arg-type]
    model.eval()  # an evaluation that raised (and was caught) after its first step: no log, no end
    handle._count(SKIPPED, None)
    callback.on_prediction_step(None, state, control, model=model)  # type: ignore[arg-type]
    for entry in ("evaluate", "predict"):
        callback.on_step_begin(None, state, control)  # type: ignore[arg-type]
        model.train()
        for _ in range(2):  # two micro-batches of the step
            handle._count(APPLIED, None)
        model.eval()  # the other callback's evaluation or prediction, one forward
        handle._count(SKIPPED, None)
        callback.on_prediction_step(None, state, control, model=model)  # type: ignore[arg-type]
        logs = {"user_loss": 1.0, "user_runtime": 0.1, "user_samples_per_second": 9.0}
        if entry == "evaluate":
            callback.on_log(None, state, control, logs=logs)  # type: ignore[arg-type]
            assert logs["user_vit_balance/calls_total"] == 1.0, logs
            callback.on_evaluate(None, state, control, model=model)  # type: ignore[arg-type]
        else:
            callback.on_predict(None, state, control, model=model)  # type: ignore[arg-type]
        model.train()
        callback.on_step_end(None, state, control)  # type: ignore[arg-type]
        training = {"loss": 1.0}
        callback.on_log(None, state, control, logs=training)  # type: ignore[arg-type]
        assert (training["vit_balance/calls"], training["vit_balance/applied"]) == (2.0, 1.0), (
            entry,
            training,
        )
    with pytest.raises(ValueError, match=r"pop_stats\(training='yes'\) is invalid: expected a bool or None"):
        handle.pop_stats(training="yes")  # type: ignore[arg-type]


def test_trainer_callback_goes_on_from_the_resumed_state_or_says_why_not() -> None:
    """``ViTBalanceTrainerCallback.on_train_begin`` with a resumed ``TrainerState``: a state the
    handle can go on from is loaded, one of other terms warns and changes nothing, and a model
    without a balanced tower is an error naming the fix, or, with two towers, the cause."""
    from transformers import TrainerState

    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model, ViTBalanceConfig(**CONFIG, calibrate_cost=True))
    callback = ViTBalanceTrainerCallback()

    counts = {"applied_total": 3, "calls_total": 7, "skipped_total": {"no-gain": 4}}

    def resumed(state: dict[str, Any], metric_counts: Any = counts) -> Any:
        attributes = {"balancer_state": state, "metric_counts": metric_counts}
        saved = {"args": {"log_per_rank_loads": True}, "attributes": json.loads(json.dumps(attributes))}
        # A checkpoint's state, read back at its step.
        return TrainerState(stateful_callbacks={"ViTBalanceTrainerCallback": saved}, global_step=5)

    callback.on_train_begin(None, resumed(_calibrator_state()), None, model=model)  # type: ignore[arg-type]
    assert handle.state_dict() == _calibrator_state()
    attributes = callback.state()["attributes"]
    assert attributes["balancer_state"] == _calibrator_state()
    kept = attributes["metric_counts"]
    assert kept["calls_total"] == 7 and kept["skipped_total"]["no-gain"] == 4
    with pytest.warns(RuntimeWarning, match=r"checkpoint's metric counts are not used .*calls_total"):
        callback.on_train_begin(None, resumed({}, {"applied_total": 1}), None, model=model)  # type: ignore[arg-type]
    assert callback.state()["attributes"]["metric_counts"]["calls_total"] == 0  # counting afresh
    with pytest.warns(RuntimeWarning, match=r"checkpoint's balancer state is not used .*window_patches"):
        callback.on_train_begin(None, resumed(_calibrator_state(64)), None, model=model)  # type: ignore[arg-type]
    assert handle.state_dict() == _calibrator_state()
    with pytest.raises(ValueError, match=r"has no balanced vision tower: call balance_vision_tower\(model\)"):
        callback.on_train_begin(None, TrainerState(), None, model=tiny_model(FIT_FAMILY))  # type: ignore[arg-type]
    # A policy and its reference in one model, both balanced: the cause, not "call balance_vision_tower".
    pair = nn.ModuleDict({"policy": model, "reference": copy.deepcopy(model)})
    cause = r"must hold one vision tower.*several vision towers.*outside the model"
    with pytest.raises(ValueError, match=cause):
        callback.on_train_begin(None, TrainerState(), None, model=pair)  # type: ignore[arg-type]


def test_trainer_callback_resumes_the_first_of_several_saved_states_on_rank_zero_alone() -> None:
    """Several callbacks of this class save a list under one name in ``stateful_callbacks``: the
    first entry is ours (a list had been read as no state, and the counts restarted); a state that
    cannot be used is told by the main process alone (every rank decides alike)."""
    from transformers import TrainerState

    model = tiny_model(FIT_FAMILY)
    balance_vision_tower(model)
    callback = ViTBalanceTrainerCallback()

    def saved(calls: int) -> dict[str, Any]:
        counts = {"applied_total": 0, "calls_total": calls, "skipped_total": {}}
        return {"args": {}, "attributes": {"balancer_state": {}, "metric_counts": counts}}

    entries = {"ViTBalanceTrainerCallback": [saved(7), saved(2)]}
    state = TrainerState(stateful_callbacks=entries, global_step=5)
    callback.on_train_begin(None, state, None, model=model)  # type: ignore[arg-type]
    assert callback.metrics.calls_total == 7
    broken = {"ViTBalanceTrainerCallback": {"attributes": {"metric_counts": {"calls_total": 1}}}}
    other_rank = TrainerState(stateful_callbacks=broken, global_step=5, is_world_process_zero=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.on_train_begin(None, other_rank, None, model=model)  # type: ignore[arg-type]
    assert not [w for w in caught if "metric counts are not used" in str(w.message)]
    assert callback.metrics.calls_total == 0


def test_trainer_callback_publishes_only_what_it_can_tell_apart() -> None:
    """An evaluation's log needs the handle (none: the log is left as it is, not an AttributeError),
    keeps ``log_per_rank_loads=False``, names one prefix (two evaluations' speed figures: nothing), and its
    history entry is the one at the current step; ``logs=None`` is no log."""
    from test_metrics import APPLIED
    from transformers import TrainerState
    from transformers.trainer_callback import TrainerControl

    control = TrainerControl()
    unbalanced = ViTBalanceTrainerCallback()
    unbalanced.on_init_end(None, TrainerState(), control, model=tiny_model(FIT_FAMILY))  # type: ignore[arg-type]
    speed = {"eval_runtime": 0.5, "eval_samples_per_second": 8.0}
    logs = {"eval_loss": 1.0, **speed}
    unbalanced.on_log(None, TrainerState(), control, logs=logs)  # type: ignore[arg-type]
    assert logs == {"eval_loss": 1.0, **speed}

    model, queued = _scripted_stats()
    callback, state = ViTBalanceTrainerCallback(log_per_rank_loads=False), TrainerState()
    callback.on_init_end(None, state, control, model=model)  # type: ignore[arg-type]
    callback.on_log(None, state, control, logs=None)  # type: ignore[arg-type]
    queued[:] = [APPLIED]
    two = {f"eval_{name}_{figure}": 0.1 for name in "ab" for figure in ("runtime", "samples_per_second")}
    told = dict(two)
    callback.on_log(None, state, control, logs=told)  # type: ignore[arg-type]
    assert told == two
    state.global_step = 3
    earlier = {"eval_loss": 1.0, **speed, "step": 2}
    state.log_history.append(dict(earlier))
    logs = {"eval_loss": 1.0, **speed}
    callback.on_log(None, state, control, logs=logs)  # type: ignore[arg-type]
    assert logs["eval_vit_balance/calls"] == 1.0 and not [k for k in logs if "/rank_" in k], logs
    assert state.log_history[-1] == earlier  # another step's entry: not this log's


def test_trainer_callback_ends_training_releasing_the_handle_and_checks_an_evaluations_model() -> None:
    """``on_train_end`` lets go of the gloo twin even where the pending check raises; an evaluation
    checks the handle of the Trainer's model, which a callback added after the Trainer's start
    (``add_callback``: no ``on_init_end``) did not hold."""
    from transformers import TrainerState
    from transformers.trainer_callback import TrainerControl

    model = tiny_model(FIT_FAMILY)
    handle = balance_vision_tower(model)
    done: list[str] = []

    def mismatch() -> None:
        done.append("check_pending")
        raise ValueError("a grid differed from its plan")

    handle.check_pending = mismatch  # type: ignore[method-assign]
    handle.release = lambda: done.append("release")  # type: ignore[method-assign]
    state, control = TrainerState(), TrainerControl()
    with pytest.raises(ValueError, match="differed"):
        ViTBalanceTrainerCallback().on_evaluate(None, state, control, model=model)  # type: ignore[arg-type]
    callback = ViTBalanceTrainerCallback()
    callback.on_init_end(None, state, control, model=model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="differed"):
        callback.on_train_end(None, state, control)  # type: ignore[arg-type]
    assert done[-2:] == ["check_pending", "release"], done


def test_mixin_handle_state_is_the_modules_checkpoint_state() -> None:
    """The mixin's handle reads and sets the state the module's checkpoints keep."""
    module = HFFinetune("unused", balanced=True)
    handle = BalancedVisionTower.of(module.model)
    assert handle.state_dict() == {}
    state = _calibrator_state()
    handle.load_state_dict(state)
    checkpoint: dict[str, Any] = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["vit_balance"] == state and handle.state_dict() == state
    with pytest.raises(ValueError, match=r"state=None is invalid"):
        handle.load_state_dict(None)  # type: ignore[arg-type]


def _fsdp2_fit(out_dir: str) -> None:
    """Worker: ``hf_fsdp2_fit_script``'s fit, on the pool's ranks as under ``torchrun``."""
    import hf_fsdp2_fit_script as script

    with launched_by_torchrun():
        script.main(out_dir)


@pytest.mark.timeout(240)
def test_lightning_model_parallel_strategy_with_fsdp2_units(tmp_path: Path, multirank: Any) -> None:
    """ModelParallelStrategy (a (2, 1) mesh), FSDP2 units in configure_model: DDP's losses, then the
    plain model's validation losses (balanced too: a text-only rank must gather the tower's
    parameters with the others).

    On the pool's 2 ranks, launched as ``torchrun`` would; FSDP2 averages the ranks' gradients as
    DDP does, so the reference is DDP by hand.
    """
    skip_without_fsdp2()
    import hf_fsdp2_fit_script as script

    with multirank(script.RANKS) as pool:
        pool.run(_fsdp2_fit, str(tmp_path), timeout=200)
    model = tiny_model(script.FAMILY)
    expected = _reference(model, script.batch_for, script.STEPS, script.RANKS, script.SGD_LR)
    model.eval()  # validation after the last step: the trained weights
    validation, generated = [], []
    with torch.no_grad():
        for rank in range(script.RANKS):
            batches = [script.batch_for(step, rank) for step in range(script.STEPS)]
            validation.append([float(model(**batch).loss) for batch in batches])
            settings = generation_settings(rank)
            prompts = [generation_prompt(model, batch) for batch in batches]
            generated.append([model.generate(**prompt, **settings).tolist() for prompt in prompts])
    for rank in range(script.RANKS):
        got = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert got["num_ranks"] == script.RANKS  # the mesh's data-parallel group
        # Training and validation forwards and generate()'s encodings, each balanced.
        assert got["calls"] == got["applied_calls"] == 3 * script.STEPS, got
        torch.testing.assert_close(torch.tensor(got["losses"]), expected[rank], **TOL)
        torch.testing.assert_close(torch.tensor(got["val_losses"]), torch.tensor(validation[rank]), **TOL)
        assert got["generated"] == generated[rank]


class _MixinOnly(ViTBalanceMixin, L.LightningModule):
    """A module with the mixin and an explicit group, used outside a Trainer."""


def test_mixin_handle_prepares_for_the_next_forward_from_any_hook() -> None:
    """``handle.prepare`` under a Trainer asks for the next forward's settings (made ahead, as in
    ``on_before_batch_transfer``), not for a call in the running hook, which would not balance."""
    module = _MixinOnly()
    handle = module.balance_vision_tower(tiny_model("qwen2_vl"))
    with mock.patch.object(module, "_vit_balance_settings", return_value=None) as settings:
        assert handle.prepare(make_inputs("qwen2_vl", [{"images": [(1, 4, 4)]}], seed=0)) is None
        handle.settings()
    assert [call.kwargs["ahead"] for call in settings.call_args_list] == [True, False]


def test_mixin_drop_in_records_its_forwards_on_one_process() -> None:
    """One process (no group): the drop-in's forwards run as the plain model's, and each training
    forward is recorded as ``single-rank`` (images and videos together; a text-only one too), as
    ``encode_images`` records its direct calls, so the callback logs on one device as on many."""
    module = _MixinOnly()
    model = tiny_model("qwen2_vl")
    module.balance_vision_tower(model)
    model.train()
    inputs = make_inputs("qwen2_vl", [{"images": [(1, 4, 4), (1, 2, 4)]}, {"videos": [(2, 4, 4)]}], seed=0)
    model(**inputs).loss.backward()
    model(**make_inputs("qwen2_vl", [{}], seed=1)).loss.backward()
    with torch.no_grad():
        module.eval()  # the module decides, as for encode_images: eval mode, not balanced
        model.eval()
        model(**inputs)
    stats = module.pop_vit_balance_stats()
    assert [(s.reason, s.applied, s.num_ranks, s.imbalance_after) for s in stats] == [
        ("single-rank", False, 1, 0.0)
    ] * 2
    pixels = inputs["pixel_values"].shape[0] + inputs["pixel_values_videos"].shape[0]
    assert (stats[0].num_images, stats[0].total_patches, stats[1].num_images) == (4, pixels, 0)
    # The handle without Lightning keeps them too (a Trainer's callback logs them on one device).
    model = tiny_model("qwen2_vl")
    handle = balance_vision_tower(model)
    assert handle.pop_stats() == []
    model(**inputs).loss.backward()
    kept = handle.pop_stats()
    assert [(s.reason, s.num_images, s.total_patches) for s in kept] == [("single-rank", 4, pixels)]
    assert handle.last_stats is kept[0]
    disabled = tiny_model("qwen2_vl")
    off = balance_vision_tower(disabled, config=ViTBalanceConfig(enabled=False))
    off.pop_stats()
    disabled(**inputs).loss.backward()
    assert off.pop_stats() == [] and off.last_stats is None


def _mixin_worker() -> dict[str, Any]:
    """The mixin's encode_visual and balance_vision_tower with ``vit_balance_group`` set."""
    import torch.distributed as dist
    import towers

    rank = dist.get_rank()
    module = _MixinOnly()
    module.vit_balance_config = ViTBalanceConfig(**CONFIG)
    module.vit_balance_group = dist.group.WORLD
    torch.manual_seed(0)
    vit = towers.qwen2_vl_tower()
    images = towers.make_batch([(1, 4, 4)] * 4 if rank == 0 else [(1, 2, 2)], seed=rank)
    videos = towers.make_batch([(2, 2, 4)], seed=9) if rank == 1 else None
    image_out, video_out = module.encode_visual(vit, images=images, videos=videos)
    torch.testing.assert_close(towers.merged_tokens(image_out), towers.merged_tokens(vit(*images)), **TOL)
    first = module.last_vit_balance_stats
    model = tiny_model("qwen2_vl")
    handle = module.balance_vision_tower(model)
    model(
        **make_inputs("qwen2_vl", [{"images": [(1, 8, 8)]}] if rank == 0 else [{}], seed=rank)
    ).loss.backward()
    return {
        "video_rows": towers.merged_tokens(video_out).shape[0],
        "applied": first.applied,
        "handle_calls": handle.calls,
        "stats_from_handle": module.last_vit_balance_stats is handle.last_stats,
    }


def test_mixin_encode_visual_and_balance_vision_tower_use_the_modules_group(multirank: Any) -> None:
    with multirank(RANKS) as w:
        results = w.run(_mixin_worker, timeout=120)
    assert [r["video_rows"] for r in results] == [0, 4, 0]
    assert all(r["applied"] and r["handle_calls"] == 1 and r["stats_from_handle"] for r in results), results


class _FabricFinetune(ViTBalanceMixin, L.LightningModule):
    """A Qwen2.5-VL model given to the mixin's ``balance_vision_tower``, trained in a Fabric loop."""

    def __init__(self, balanced: bool) -> None:
        super().__init__()
        self.vit_balance_config = ViTBalanceConfig(enabled=balanced, **CONFIG)
        self.model = tiny_model("qwen2_5_vl")
        self.handle = self.balance_vision_tower(self.model)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss


def _fabric_finetune(balanced: bool) -> dict[str, Any]:
    """Fabric's DDP on the pool's 2 ranks (as under ``torchrun``): three steps with a text-only rank
    (videos on it in the second), rank 0 evaluating and generating alone, then a step on both; the
    last two balanced steps planned with ``prepare_vit_balance``. The plain model needs
    ``find_unused_parameters`` for its text-only rank; the balanced one runs the tower on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    own = [{"images": [(1, 8, 8), (1, 4, 4)]}] if rank == 0 else [{}]
    with launched_by_torchrun():
        strategy = "ddp" if balanced else "ddp_find_unused_parameters_true"
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        module = _FabricFinetune(balanced)
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
        losses, alone, prepared = [], None, []
        for step in range(4):
            samples = [{"videos": [(2, 4, 4)]}] if step == 1 and rank == 1 else own
            batch = make_inputs("qwen2_5_vl", samples, seed=10 * step + rank)
            if balanced and step >= 2:  # planned on the host, as before moving the batch to a GPU
                prepared.append(module.prepare_vit_balance(batch) is not None)
            loss = model.training_step(batch, step)
            if balanced:
                prepared.append(module.last_vit_balance_stats.collectives)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if step == 2 and rank == 0:  # samples checked on rank 0 alone, as sample logging does
                alone = _evaluate_and_generate(model, module.model, make_inputs("qwen2_5_vl", own, seed=5))
    return {
        "losses": losses,
        "alone": alone,
        "calls": module.handle.calls,
        "applied": module.handle.applied_calls,
        "prepared": prepared,
    }


def _evaluate_and_generate(
    wrapped: Any, model: nn.Module, batch: dict[str, Any], synced: bool = False
) -> tuple[float, list[Any]]:
    """An evaluation forward's loss and ``generate()``'s tokens in eval mode: on one rank, or with
    ``synced`` on every rank together (``synced_gpus``, as sharded parameters need)."""
    wrapped.eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
        settings = {**generation_settings(0), "synced_gpus": True} if synced else generation_settings(0)
        tokens = model.generate(**generation_prompt(model, batch), **settings).tolist()
    wrapped.train()
    return loss, tokens


def test_mixin_drop_in_in_a_fabric_loop(multirank: Any) -> None:
    """Under Fabric (no Trainer) the mixin's drop-in balances training forwards, a text-only rank
    included, with the plain model's losses; rank 0's evaluation forward and ``generate()`` alone
    encode directly (they waited for the other rank before: a timeout, or a hang on NCCL)."""
    with multirank(2) as w:
        balanced = w.run(_fabric_finetune, True, timeout=120)
        plain = w.run(_fabric_finetune, False, timeout=120)
    for rank in range(2):
        torch.testing.assert_close(balanced[rank]["losses"], plain[rank]["losses"], **TOL)
        assert balanced[rank]["calls"] == 4 and balanced[rank]["applied"] == 4, balanced
        # The last two steps' plans made with prepare_vit_balance (a text-only batch too) were taken:
        # no metadata gather in those forwards, 3 collectives instead of 4.
        assert balanced[rank]["prepared"] == [4, 4, True, 3, True, 3], balanced
    assert balanced[0]["alone"][1] == plain[0]["alone"][1]
    torch.testing.assert_close(balanced[0]["alone"][0], plain[0]["alone"][0], **TOL)


def _shard_units(module: _FabricFinetune, mesh: Any) -> _FabricFinetune:
    """Fabric's ``parallelize_fn``: FSDP2 units per block and decoder layer, the tower one too."""
    from torch.distributed.fsdp import fully_shard

    inner = module.model.model
    for unit in [*inner.visual.blocks, inner.visual, *inner.language_model.layers, module.model]:
        fully_shard(unit, mesh=mesh["data_parallel"])
    return module


def _fabric_sharded() -> dict[str, Any]:
    """Fabric's ``ModelParallelStrategy`` (FSDP2) on the pool's 2 ranks, rank 1 text-only: two
    training steps, then an evaluation forward and ``generate()`` on both ranks in eval mode."""
    import torch.distributed as dist
    from lightning.fabric.strategies import ModelParallelStrategy

    rank = dist.get_rank()
    own = [{"images": [(1, 8, 8), (1, 4, 4)]}] if rank == 0 else [{}]
    with launched_by_torchrun():
        strategy = ModelParallelStrategy(_shard_units, data_parallel_size=2, tensor_parallel_size=1)
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        module = _FabricFinetune(balanced=True)
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=0.1))
        for step in range(2):
            fabric.backward(model.training_step(make_inputs("qwen2_5_vl", own, seed=10 * step + rank), step))
            optimizer.step()
            optimizer.zero_grad()
        evaluation = _evaluate_and_generate(
            model, module.model, make_inputs("qwen2_5_vl", own, seed=5), synced=True
        )
    return {"loss": evaluation[0], "calls": module.handle.calls, "applied": module.handle.applied_calls}


def test_mixin_drop_in_balances_evaluation_of_a_sharded_tower_in_a_fabric_loop(multirank: Any) -> None:
    """Under Fabric with the tower's parameters sharded (FSDP2), an evaluation forward and
    ``generate()``'s encoding are balanced in eval mode too: each is a collective there, which a
    text-only rank would skip in the plain model (a hang); rank 1 runs the tower for rank 0's images."""
    with multirank(2) as w:
        results = w.run(_fabric_sharded, timeout=120)
    # Two training forwards, the evaluation forward, generate()'s encoding step: each balanced.
    assert [(r["calls"], r["applied"]) for r in results] == [(4, 4), (4, 4)], results
    assert all(math.isfinite(r["loss"]) for r in results), results


def _mixin_family_worker(family: str) -> dict[str, Any]:
    """Two steps of ``family`` balanced through the mixin's handle (the module's one balancer), the
    second planned ahead by the handle, against the plain model: the same losses and summed
    gradients, no tower call encoded apart."""
    import torch.distributed as dist

    rank = dist.get_rank()
    module = _MixinOnly()
    module.vit_balance_config = config_for(family)
    module.vit_balance_group = dist.group.WORLD
    plain = tiny_model(family)
    balanced = copy.deepcopy(plain)
    handle = module.balance_vision_tower(balanced)
    for step in range(2):
        where = f"{family} through the mixin, step {step} rank {rank}"
        batch = make_inputs(family, cases_for(family)["text_only_rank"][rank], seed=100 * step + rank)
        plain_loss, _ = _step(plain, batch)
        if step == 1:
            assert handle.prepare(batch) is not None, where
        balanced_loss, _ = _step(balanced, batch)
        torch.testing.assert_close(balanced_loss, plain_loss, **TOL)
        _assert_same_grads(where, _summed_grads(balanced), _summed_grads(plain))
        plain.zero_grad()
        balanced.zero_grad()
    balancer = module._vit_balance_state_object().balancer
    return {
        "merge": balancer.output_layout.merge_size,
        "calls": handle.calls,
        "applied": handle.applied_calls,
        "unmatched": handle.unmatched_calls,
    }


@pytest.mark.parametrize(("family", "merge"), [("muse_spark", 2), ("kimi_k25", 2)])
def test_mixin_balances_towers_merged_by_their_config(multirank: Any, family: str, merge: int) -> None:
    """Muse Spark's outputs are merged by ``config.merge_size`` (its tower's ``spatial_merge_size``
    is 1) and Kimi-K2.5's by its ``merge_kernel_size`` (it has none): the mixin's module balancer is
    built with the handle's output layout, so their rows route as the plain model splits them."""
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    with multirank(RANKS) as w:
        results = w.run(_mixin_family_worker, family, timeout=240)
    expected = {"merge": merge, "calls": 2, "unmatched": 0}
    assert all({k: r[k] for k in expected} == expected for r in results), results
    assert results[0]["applied"] >= 1, results


def _sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's summed log-probability of its labelled tokens (what DPO compares)."""
    shifted, targets = logits[:, :-1].float(), labels[:, 1:]
    mask = targets != -100
    picked = shifted.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def _reference_pair_worker(copied: bool) -> dict[str, Any]:
    """DPO's steps on the pool's ranks: a frozen reference model's forward under ``no_grad`` in
    eval mode, then the policy's forward and backward, balanced (the reference by a handle with
    ``evaluation=True``: its own, or, ``copied``, the copy of the policy's that a deep copy of the
    balanced policy carries) against the plain pair: the reference's log-probabilities, the losses
    and the policy's summed gradients per step, and the reference's balanced calls."""
    import torch.distributed as dist

    rank, family = dist.get_rank(), "qwen2_5_vl"
    plain = tiny_model(family)
    plain_reference = copy.deepcopy(plain).requires_grad_(False).eval()
    policy = copy.deepcopy(plain)
    balance_vision_tower(policy, config_for(family))
    reference = copy.deepcopy(policy if copied else plain).requires_grad_(False).eval()
    if copied:
        handle = BalancedVisionTower.of(reference)
        handle.evaluation = True
    else:
        handle = balance_vision_tower(reference, config_for(family), evaluation=True)
    for step, name in enumerate(("text_only_rank", "every_rank_images", "one_big_image_others_text_only")):
        where = f"{'copied' if copied else 'own'} reference, {name}, rank {rank}"
        batch = make_inputs(family, cases_for(family)[name][rank], seed=10 * step + rank)
        losses = []
        for ref_model, model in ((plain_reference, plain), (reference, policy)):
            with torch.no_grad():
                ref_log_probs = _sequence_log_probs(ref_model(**batch).logits, batch["labels"])
            log_probs = _sequence_log_probs(model(**batch).logits, batch["labels"])
            losses.append(
                (-torch.nn.functional.logsigmoid(0.1 * (log_probs - ref_log_probs)).mean(), ref_log_probs)
            )
            losses[-1][0].backward()
        (plain_loss, plain_ref), (loss, ref) = losses
        torch.testing.assert_close(ref, plain_ref, **TOL, msg=lambda m, w=where: f"{w}: reference {m}")
        torch.testing.assert_close(loss, plain_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
        _assert_same_grads(where, _summed_grads(policy), _summed_grads(plain))
        plain.zero_grad()
        policy.zero_grad()
    return {"calls": handle.calls, "applied": handle.applied_calls}


@pytest.mark.parametrize("copied", [False, True], ids=["own_handle", "copied_from_the_policy"])
def test_a_reference_model_under_no_grad_balances_with_evaluation(multirank: Any, copied: bool) -> None:
    """A preference-training step (DPO) holds two models: the frozen reference, run under
    ``no_grad`` in eval mode, is balanced by a handle with ``evaluation=True``, also the one a deep
    copy of the balanced policy carries (TRL's ``create_reference_model``) once told so; the
    reference's log-probabilities, the losses and the policy's gradients are the plain pair's."""
    with multirank(RANKS) as w:
        results = w.run(_reference_pair_worker, copied, timeout=120)
    assert [(r["calls"], r["applied"] >= 1) for r in results] == [(3, True)] * RANKS, results


def test_mixin_keeps_a_balancer_per_output_layout_and_configuration() -> None:
    """The module's balancer for each layout (a drop-in tower's) and configuration it is asked for:
    a new one, going on from the latest one's cost fit, for one not seen yet; the kept one when
    calls alternate between them (a drop-in tower and encode_images in one step), holding what the
    one before left to report; the least recently used let go beyond KEPT_BALANCERS."""
    module = _MixinOnly()
    config = ViTBalanceConfig(calibrate_cost=True)
    plain = module._vit_balance_balancer(config, None)
    merged = module._vit_balance_balancer(config, None, OutputLayout(merge_size=2))
    assert plain.output_layout is None and merged is not plain
    assert merged.output_layout == OutputLayout(merge_size=2)
    assert merged.state_dict() == plain.state_dict()
    merged._skipped_mismatch = True  # a mismatch of a skipped prepared call, due at the next gather
    assert module._vit_balance_balancer(config, None) is plain and plain._skipped_mismatch
    assert module._vit_balance_balancer(config, None, OutputLayout(merge_size=2)) is merged
    assert merged._skipped_mismatch and not plain._skipped_mismatch
    state = module._vit_balance_state_object()
    others = [dataclasses.replace(config, trigger_threshold=t) for t in (0.25, 0.3, 0.4)]
    kept = [module._vit_balance_balancer(other, None) for other in others]
    assert [balancer for *_, balancer in state.balancers] == [merged, *kept]
    assert module._vit_balance_balancer(config, None) is not plain  # the least recently used: let go
    module.load_vit_balance_state_dict(plain.state_dict())
    assert state.balancer is None and state.balancers == []
    with mock.patch.object(mixin_module, "KEPT_BALANCERS", 1):  # the bound holds at its least too
        for other in others:
            module._vit_balance_balancer(other, None)
        assert len(state.balancers) == 1


def test_a_copy_of_a_balanced_model_alone_balances_with_its_module() -> None:
    """``copy.deepcopy`` of a model the module balances (a reference model made from the policy)
    gives the copy a handle of its own, on the copy's tower, that balances with the module; it
    held a copy of the whole module (its other models too), which no Trainer ran, so it never
    balanced. A copy of the whole module balances its models with that copy."""
    module = _MixinOnly()
    module.policy = tiny_model("qwen2_vl")
    module.other = nn.Linear(4, 4)
    handle = module.balance_vision_tower(module.policy)
    reference = copy.deepcopy(module.policy)
    copied = BalancedVisionTower.of(reference)
    assert copied is not handle and copied.tower is reference.model.visual
    assert copied.module is module and handle.module is module
    whole = copy.deepcopy(module)
    assert BalancedVisionTower.of(whole.policy).module is whole and whole.other is not module.other


def _mixin_planned_without_a_config_worker() -> dict[str, Any]:
    """Three steps of a drop-in Qwen2-VL in a module without a ``vit_balance_config``, each planned
    ahead by ``prepare_vit_balance``: the configurations of the balancers made, the calls' plan
    times (taken from the plan made ahead: > 0) and the ViT times they reported."""
    import torch.distributed as dist

    rank = dist.get_rank()
    module = _MixinOnly()
    module.vit_balance_group = dist.group.WORLD
    module.model = tiny_model("qwen2_vl")
    handle = module.balance_vision_tower(module.model)
    prepared, vit_ms = [], []
    for step in range(3):
        batch = make_inputs("qwen2_vl", cases_for("qwen2_vl")["text_only_rank"][rank], seed=10 * step + rank)
        module.prepare_vit_balance(batch)
        module.model(**batch).loss.backward()
        prepared.append(module.last_vit_balance_stats.prepare_seconds > 0)
        vit_ms.append(module.last_vit_balance_stats.vit_ms)
    configs = [config for config, _, _ in module._vit_balance_state_object().balancers]
    return {"own": configs == [handle.default_config()], "prepared": prepared, "vit_ms": vit_ms}


def test_plans_made_ahead_without_a_config_are_the_drop_ins_own(multirank: Any) -> None:
    """Without a ``vit_balance_config`` the drop-in prices images by its tower's shape, in the plans
    ``prepare_vit_balance`` makes too: they were made by the engine's default configuration's
    balancer, priced by ``l**2``, and its calls, in their own balancer, never reported a ViT time."""
    with multirank(2) as w:
        results = w.run(_mixin_planned_without_a_config_worker, timeout=120)
    for r in results:
        assert r["own"] and r["prepared"] == [True] * 3, r
        assert [all(ms >= 0 for ms in call) for call in r["vit_ms"]] == [False, True, True], r


def _mixin_two_kinds_worker(balanced: bool) -> dict[str, Any]:
    """Four steps of a module calling a drop-in Qwen2-VL and ``encode_images`` on a tower of its own,
    on the pool's ranks, each call with its own configuration (no ``vit_balance_config``: the
    drop-in's tower default, and the engine's default for ``encode_images``), or every call direct
    (a disabled configuration): the losses, summed gradients, the balancer each call took and the
    ViT times it reported (measured a call late, by each call's balancer)."""
    import torch.distributed as dist
    from towers import TensorTower, make_batch

    rank = dist.get_rank()
    module = _MixinOnly()
    module.vit_balance_config = None if balanced else ViTBalanceConfig(enabled=False)
    module.vit_balance_group = dist.group.WORLD
    torch.manual_seed(0)
    module.tower = TensorTower()
    module.model = tiny_model("qwen2_vl")
    module.balance_vision_tower(module.model)
    state = module._vit_balance_state_object()
    losses, taken, vit_ms = [], [], []

    def took(output: Any) -> Any:
        taken.append(id(state.balancer))
        vit_ms.append(module.last_vit_balance_stats.vit_ms if balanced else ())
        return output

    for step in range(4):
        batch = make_inputs(
            "qwen2_vl", cases_for("qwen2_vl")["every_rank_images"][rank], seed=10 * step + rank
        )
        images = make_batch([(1, 8, 8)] * (1 + 4 * ((rank + step) % 2)), seed=step)
        loss = (
            took(module.model(**batch).loss) + took(module.encode_images(module.tower, *images)).pow(2).mean()
        )
        loss.backward()
        losses.append(loss.detach())
    return {"losses": losses, "grads": _summed_grads(module), "taken": taken, "vit_ms": vit_ms}


def test_mixin_calls_of_two_kinds_in_a_step_each_go_on_with_their_balancer(multirank: Any) -> None:
    """A drop-in tower's call and ``encode_images`` in each step, with other configurations: each
    call takes its kind's balancer, kept across steps (built again at each call, their ViT times,
    measured a call late, were never reported, and an online cost fit never fitted), and the steps'
    losses and gradients are the direct calls'."""
    with multirank(2) as w:
        balanced = w.run(_mixin_two_kinds_worker, True, timeout=120)
        direct = w.run(_mixin_two_kinds_worker, False, timeout=120)
    for rank in range(2):
        taken = balanced[rank]["taken"]
        assert len(set(taken)) == 2 and taken == taken[:2] * 4, taken
        # Each balancer's first call has no earlier call to report (-1); every later one reports both ranks.
        measured = [all(ms >= 0 for ms in call) for call in balanced[rank]["vit_ms"]]
        assert measured == [False, False] + [True] * 6, balanced[rank]["vit_ms"]
        # Per-image maths is identical, only the batches' composition differs (fp32 rounding).
        torch.testing.assert_close(balanced[rank]["losses"], direct[rank]["losses"], rtol=1e-5, atol=1e-6)
        _assert_same_grads(f"rank {rank}", balanced[rank]["grads"], direct[rank]["grads"])


def test_mixin_keeps_no_model_it_no_longer_balances() -> None:
    """A module that balances a new model each run (a sweep, ``configure_model``) holds the handles
    of the models it balances now, not every model it ever balanced; copies and pickles of the
    module hold their own models' handles."""
    import gc
    import weakref

    module = _MixinOnly()
    first = tiny_model("qwen2_vl")
    removed = module.balance_vision_tower(tiny_model("qwen2_vl"))
    removed.remove()
    module.model = first
    module.balance_vision_tower(first)
    replaced = weakref.ref(first)
    module.model = tiny_model("qwen2_vl")
    handle = module.balance_vision_tower(module.model)
    del first
    gc.collect()
    assert replaced() is None, "the module kept a model it no longer balances"
    assert module._vit_balance_towers == (handle,)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        (copied,) = clone._vit_balance_towers
        assert copied is not handle and copied is BalancedVisionTower.of(clone.model)


def test_mixin_balance_vision_tower_is_idempotent() -> None:
    module = HFFinetune("unused", balanced=True)
    handle = BalancedVisionTower.of(module.model)
    assert module.balance_vision_tower(module.model) is handle
    # Outside a Trainer nothing is balanced: the model runs as is.
    batch = fit_batch(0, 0)
    plain = copy.deepcopy(module.model)
    BalancedVisionTower.of(plain).remove()
    assert torch.equal(module.model(**batch).loss, plain(**batch).loss)
    assert handle.calls == 0


# --------------------------------------------------------------------------- the example


def _trainer_example(out_dir: str) -> dict[str, float]:
    """Worker: ``examples/hf_trainer_finetune.py`` for 4 steps of 1 sample on the pool's ranks, as
    under ``torchrun``."""
    import hf_trainer_finetune

    with launched_by_torchrun():
        return hf_trainer_finetune.main(["--steps", "4", "--batch-size", "1", "--output", out_dir])


@pytest.mark.timeout(180)
def test_trainer_example_short_run(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 examples/hf_trainer_finetune.py --steps 4 --batch-size 1``:
    the logs' metrics say images moved and the imbalance fell, every call was planned ahead, every
    rank reads the same, and the dashboard is drawn. In a pool of its own (accelerate's state is
    process-wide)."""
    pool = World(2)
    try:
        summaries = pool.run(_trainer_example, str(tmp_path), timeout=150)
    finally:
        pool.close(kill=True)
    summary = summaries[0]
    assert summary["calls_total"] == 4 and summary["applied_total"] >= 1, summary
    assert summary["imbalance_after"] < summary["imbalance_before"], summary
    assert summary["vit_ms_max"] >= summary["vit_ms_mean"] > 0, summary
    # Every call was planned from the collator's host grids: no metadata gather in the calls.
    # (and the status word of a call where no rank had images)
    no_images = summary["calls_total"] - summary["applied_total"]
    assert 3 * summary["applied_total"] <= summary["collectives"] <= 3 * summary["applied_total"] + no_images
    assert summary["prepare_ms_per_call"] > 0.0 and summary["call_ms_per_call"] >= 0.0, summary
    assert summary["trip_ms_per_applied_call"] >= 0.0, summary  # no -1 of a call with none due
    # The same plans and measured ViT times on every rank; host times are each rank's own.
    timed = ("prepare_ms_per_call", "call_ms_per_call", "trip_ms_per_applied_call")
    assert [{k: v for k, v in s.items() if k not in timed} for s in summaries] == [
        {k: v for k, v in summary.items() if k not in timed}
    ] * 2
    assert (tmp_path / "trainer_state.json").exists()
    assert (tmp_path / "vit_balance_dashboard.png").stat().st_size > 1000


@pytest.mark.timeout(120)
def test_trainer_example_alone_trains_on_one_rank(tmp_path: Path) -> None:
    """Run without ``torchrun`` the example trains on one rank and says there was nothing to
    balance (it asked the ``Trainer`` for a gloo process group that did not exist)."""
    import subprocess

    example = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_finetune.py"
    command = [sys.executable, str(example), "--steps", "2", "--batch-size", "1", "--output", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "One rank: nothing was balanced" in done.stdout, done.stdout[-2000:]


@pytest.mark.timeout(240)
def test_finetune_example_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``examples/hf_qwen_finetune.py --steps 3``: two 2-rank fits, same losses, images moved."""
    import hf_qwen_finetune

    summary = hf_qwen_finetune.main(["--steps", "3", "--output", str(tmp_path)])
    assert summary["loss_max_abs_diff"] <= hf_qwen_finetune.LOSS_TOLERANCE
    assert summary["applied_steps"] >= 1 and summary["imbalance_after"] < summary["imbalance_before"]
    assert summary["collectives_per_forward"] >= 1
    assert "losses: max |difference|" in capsys.readouterr().out
    # The balanced run's callback logged the handle's stats.
    with open(tmp_path / "balanced" / "metrics.csv") as f:
        calls = [float(r["vit_balance/calls"]) for r in csv.DictReader(f) if r.get("vit_balance/calls")]
    assert calls == [1.0] * 3  # one balanced call per step
