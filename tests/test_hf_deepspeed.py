"""The Hugging Face drop-in under DeepSpeed ZeRO-3 and ZeRO-2, on 3 real gloo ranks (DeepSpeed's CPU
accelerator).

ZeRO-3 gathers each module's parameters in that module's forward hooks and records the order of
module calls in the first step, which must then be identical on every rank; ZeRO-2 reduces every
gradient from hooks, as DDP does. The plain model breaks both whenever ranks differ in modalities
(a text-only rank never calls the tower; a rank with images and videos calls it twice): a rank
aborts (checked by hand, both stages). With the drop-in, every rank runs the tower's blocks once per
step and the model's own per-modality tower calls run no hooks, so each step's full gradients
equal the plain model's: ZeRO-3 for each family and Qwen3-VL-MoE, ZeRO-2 for Qwen2.5-VL, 5 steps
of text-only ranks, images next to videos, one large image, images on every rank and text-only ranks
again (every case after ZeRO-3 recorded its first step's module calls, every case after another);
then the same four cases as evaluation forwards (``evaluation=True``), with the plain model's
losses; then ``generate()`` on every rank (``synced_gpus``) with a text-only rank and a rank with
videos, with the plain model's tokens (under ZeRO-3 its image encoding is balanced too).

Runs where ``deepspeed`` is installed (``make`` installs it, see ``requirements/deepspeed.txt``),
in a pool of its own: DeepSpeed keeps process-wide state (its communication backend, the
``LOCAL_RANK`` it requires), so the shared pools of the other tests never see it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

from hf_models import FAMILIES, available, generation_prompt, make_inputs, tiny_model
from multirank import World, set_launcher_variables
from test_hf_dropin import TOL, _summed_grads, assert_generates_as_plain, cases_for, config_for, mixed_cases

from lightning_vit_balance import balance_vision_tower

RANKS = 3
STEPS = [
    "text_only_rank",
    "images_and_videos_next_to_images",
    "one_big_image_others_text_only",
    "every_rank_images",
]


#: Whether each training step of :func:`_zero_steps` moves images: the large image outweighs the
#: mean load, so its step skips.
APPLIED = [True, True, False, True, True]


def _steps_of(family: str) -> list[str]:
    """:data:`STEPS` in ``family``'s cases: its own mix of modalities in place of images next to
    videos (GLM's videos next to images; an images-only family's images on every rank)."""
    return [mixed_cases(family)[1] if name == STEPS[1] else name for name in STEPS]


def _training_steps_of(family: str) -> list[str]:
    """The cases of :func:`_steps_of`, then the first again: it then runs after a step of another
    case too, and after ZeRO-3 recorded the module calls of its first step (later steps must call
    the same modules in the same order)."""
    steps = _steps_of(family)
    return [*steps, steps[0]]


def _deepspeed_on_cpu() -> Any:
    """DeepSpeed on the CPU accelerator over the pool's gloo group (already initialised)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    set_launcher_variables()
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # Its shared-memory all-reduce kernel is compiled with a C++ compiler at first use in each new
    # environment (about a minute on 2 cores); ZeRO-3's parameter gathers do not need it, and gloo's
    # collectives serve in its place. Reached by module name: the attribute deepspeed.comm.torch is
    # PyTorch itself (deepspeed.comm re-exports its comm module's names, `torch` among them).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def _zero_engine(handle: Any, stage: int) -> Any:
    """The balanced model in a DeepSpeed ZeRO-``stage`` engine (SGD), the handle balancing over
    the data-parallel group the strategy adapter finds in it."""
    from lightning.fabric.strategies import DeepSpeedStrategy

    from lightning_vit_balance import dp_group_from_strategy

    deepspeed = _deepspeed_on_cpu()
    # ZeRO-3 keeps parameters under 100k elements whole on every rank by default: all of a tiny
    # model's. Threshold 0 partitions them all, so every module call gathers its parameters, as in
    # a full-size model (and a rank that skipped a call would make the gathers differ).
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    # What DeepSpeed asks of a mixture of experts under ZeRO-3: ranks route their tokens to
    # different experts, so each block is gathered whole (without this, transformers 4.57's
    # Qwen3-VL-MoE, which runs only the experts its tokens hit, hangs in the gradient reduction).
    moe_blocks = {type(m) for m in handle.model.modules() if type(m).__name__.endswith("SparseMoeBlock")}
    if moe_blocks:
        deepspeed.utils.set_z3_leaf_modules(handle.model, sorted(moe_blocks, key=lambda c: c.__name__))
    optimizer = torch.optim.SGD([p for p in handle.model.parameters() if p.requires_grad], lr=0.05)
    engine, *_ = deepspeed.initialize(model=handle.model, optimizer=optimizer, config=config)
    # The kernel's build stayed off (_deepspeed_on_cpu); a renamed builder would bring it back.
    assert importlib.import_module("deepspeed.comm.comm").cdb.shm_comm_op is None
    # The strategy adapter, given the real engine (Lightning's DeepSpeed strategies need CUDA).
    strategy = object.__new__(DeepSpeedStrategy)
    strategy._deepspeed_engine = engine
    handle.group = dp_group_from_strategy(strategy)
    return engine


def _zero_steps(
    family: str,
    stage: int,
    frozen: tuple[str, ...] = (),
    reentrant: bool | None = None,
    failed_generate: bool = False,
) -> dict[str, Any]:
    """Plain model and balanced ZeRO model side by side; per step, loss and full gradients. The
    parameters whose names start with one of ``frozen`` are frozen in both; with ``reentrant`` set,
    both use Hugging Face's gradient checkpointing, reentrant or not; with ``failed_generate``, the
    steps follow a ``generate()`` that raised (:func:`_generate_that_raises`)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    rank, size = dist.get_rank(), dist.get_world_size()
    plain = tiny_model(family)
    for name, param in plain.named_parameters():
        param.requires_grad_(not name.startswith(frozen))  # no prefix: nothing starts with one
    if reentrant is not None:
        plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    handle = balance_vision_tower(copy.deepcopy(plain), config_for(family), evaluation=True)
    engine = _zero_engine(handle, stage)
    plain_params = dict(plain.named_parameters())
    if failed_generate:
        _generate_that_raises(engine.module, plain, family, rank)
    applied = []
    for step, name in enumerate(_training_steps_of(family)):
        where = f"{family}/{name} step {step} rank {rank}"
        batch = make_inputs(family, cases_for(family)[name][rank], seed=100 * step + rank)
        plain_loss = plain(**batch).loss
        plain_loss.backward()
        expected = _summed_grads(plain)
        loss = engine(**batch).loss
        torch.testing.assert_close(loss, plain_loss, **TOL, msg=lambda m, w=where: f"{w}: loss {m}")
        engine.backward(loss)
        for key, param in engine.module.named_parameters():
            if not param.requires_grad:
                continue
            grad = safe_get_full_grad(param)  # averaged over ranks
            assert grad is not None, f"{where}: {key} got no gradient"
            torch.testing.assert_close(
                grad * size, expected[key], **TOL, msg=lambda m, w=where, k=key: f"{w}: grad {k}: {m}"
            )
        engine.step()
        # The next step starts from the same weights: the plain model takes ZeRO-3's.
        plain.zero_grad(set_to_none=True)
        with torch.no_grad():
            for key, param in engine.module.named_parameters():
                if param.requires_grad:  # ZeRO keeps no fp32 copy of a frozen one, which SGD leaves
                    plain_params[key].copy_(safe_get_full_fp32_param(param))
        applied.append(handle.last_stats.applied)
    _evaluate_as_plain(engine, plain, family, rank)
    return {"applied": applied, "calls": handle.calls, "group_size": dist.get_world_size(handle.group)}


def _generate_that_raises(model: torch.nn.Module, plain: torch.nn.Module, family: str, rank: int) -> None:
    """``generate()`` of :func:`mixed_cases`' first case (a text-only rank) with a ``max_length``
    shorter than its prompts: transformers raises on every rank after encoding the images, before
    the first forward (where a rank's dummy items are due for calls after the embeddings)."""
    name = mixed_cases(family)[0]
    prompt = generation_prompt(plain, make_inputs(family, cases_for(family)[name][rank], seed=11 + rank))
    training = model.training
    model.eval()
    with torch.no_grad(), pytest.raises(ValueError, match="max_length"):
        model.generate(**prompt, max_length=1, do_sample=False, synced_gpus=True)
    model.train(training)


def _evaluate_as_plain(engine: Any, plain: torch.nn.Module, family: str, rank: int) -> None:
    """Evaluation forwards and ``generate()`` of the engine's model give the plain model's results."""
    # Evaluation forwards gather the tower's parameters too: balanced, every rank calls it.
    engine.eval()
    plain.eval()
    for name in _steps_of(family):
        batch = make_inputs(family, cases_for(family)[name][rank], seed=7 + rank)
        with torch.no_grad():
            loss, plain_loss = engine(**batch).loss, plain(**batch).loss
        torch.testing.assert_close(loss, plain_loss, **TOL, msg=lambda m, n=name: f"eval {n}: loss {m}")
    # generate(): under ZeRO-3 its encoding of the images is balanced, under ZeRO-2 it stays direct.
    assert_generates_as_plain(engine.module, plain, family)


def _pool() -> Iterator[World]:
    pool = World(RANKS)
    try:
        yield pool
    finally:
        pool.close(kill=True)


deepspeed_world = pytest.fixture(_pool, scope="module", name="deepspeed_world")
#: A pool that never runs ZeRO-3: ZeRO-3 replaces ``torch.nn.functional.linear`` in the processes
#: that ran it, and that linear's backward hands a projection's weight and bias over in the other
#: order (:func:`test_zero2_with_a_projection_outside_the_tower`).
zero2_world = pytest.fixture(_pool, scope="module", name="zero2_world")


#: A projection outside the tower (transformers 5): HyperCLOVAX Vision V2's ``projector``.
PROJECTING = "hyperclovax_vision_v2"
#: More projections outside the tower (transformers 5), each with its own dummy items: Kimi-K2.5's
#: (patch images, a whole video pooled over its frames), ERNIE-4.5-VL's resampler (a video's steps
#: merged in pairs, so its dummy video has two), Ovis2.5's (5.25: it reads the last block's hidden
#: states, and embeds indicator tokens for each image's and video's start and end).
DUMMY_FORMS = ("kimi_k25", "ernie4_5_vl_moe", "ovis2_5")
#: Submodules called once per image (transformers 5): LFM3-VL's blocks convolve each image apart,
#: PaddleOCR-VL's projector projects each image apart. ZeRO-3 gathers at each call, so ranks with
#: different image counts abort (the plain model too, checked by hand), unless the drop-in made the
#: blocks and the projector ZeRO-3 leaves, gathered once per call.
PER_IMAGE_CALLS = ("lfm3_vl", "paddleocr_vl")

# Qwen3-VL-MoE (transformers 5): experts next to the tower, under ZeRO-3. HyperCLOVAX Vision V2
# (transformers 5): a projection outside the tower, which ZeRO-3 gathers at each call, so ranks
# without a modality call it on a dummy image (ZeRO-2: test_zero2_with_a_projection_outside_the_tower).
ZERO_RUNS = [
    *((family, 3) for family in FAMILIES),
    ("qwen2_5_vl", 2),
    ("qwen3_vl_moe", 3),
    (PROJECTING, 3),
    *((family, 3) for family in (*DUMMY_FORMS, *PER_IMAGE_CALLS)),
]


@pytest.mark.parametrize(("family", "stage"), ZERO_RUNS)
def test_zero_gradients_match_the_plain_model(deepspeed_world: World, family: str, stage: int) -> None:
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    results = deepspeed_world.run(_zero_steps, family, stage, timeout=180)
    assert all(r["group_size"] == RANKS for r in results), results
    applied = [r["applied"] for r in results]
    assert all(a == applied[0] for a in applied), applied  # every rank made the same plans
    assert applied[0] == APPLIED, applied
    # A balanced call per step and per evaluation forward; per generate() under ZeRO-3 one more.
    generated = len(mixed_cases(family)) if stage == 3 else 0
    assert all(r["calls"] == len(APPLIED) + len(STEPS) + generated for r in results), results


def test_zero3_steps_after_a_generate_that_raised(deepspeed_world: World) -> None:
    """A ``generate()`` that raised after encoding its images (Ovis2.5 under ZeRO-3: the text-only
    rank's dummy items armed for the first forward's indicator calls) leaves nothing armed for the
    training steps after it: the plain model's losses and gradients, no extra gather."""
    family = "ovis2_5"
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    results = deepspeed_world.run(_zero_steps, family, 3, (), None, True, timeout=120)
    assert [r["applied"] for r in results] == [APPLIED] * RANKS, results


@pytest.mark.parametrize(
    ("family", "frozen"),
    [
        ("qwen2_5_vl", ("model.visual.patch_embed.",)),  # trained blocks after a frozen embedding
        ("paddleocr_vl", ("model.visual.",)),  # a trained projector after a frozen tower
    ],
)
def test_zero3_leaves_after_frozen_modules_reduce_their_gradients(
    deepspeed_world: World, family: str, frozen: tuple[str, ...]
) -> None:
    """A ZeRO-3 leaf the drop-in made whose inputs need no gradient (the modules before it frozen)
    still reduces its parameters' gradients after they are computed, not zeros before: the plain
    model's gradients, step after step."""
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    results = deepspeed_world.run(_zero_steps, family, 3, frozen, timeout=180)
    assert [r["applied"] for r in results] == [APPLIED] * RANKS, results


@pytest.mark.parametrize(("family", "reentrant"), [("qwen2_5_vl", True), ("lfm3_vl", False)])
def test_zero3_leaves_and_checkpointing(deepspeed_world: World, family: str, reentrant: bool) -> None:
    """Hugging Face's gradient checkpointing runs each block's forward again in the backward: the
    drop-in's ZeRO-3 leaves (the blocks) still reduce the plain model's gradients."""
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    results = deepspeed_world.run(_zero_steps, family, 3, (), reentrant, timeout=180)
    assert [r["applied"] for r in results] == [APPLIED] * RANKS, results


@pytest.mark.parametrize("family", [PROJECTING, *DUMMY_FORMS, "paddleocr_vl"])
def test_zero2_with_a_projection_outside_the_tower(zero2_world: World, family: str) -> None:
    """ZeRO-2 where the projection is outside the tower, which a text-only rank never calls: the
    drop-in runs the projection's modules on zero rows where the other ranks' backward reaches them,
    so ZeRO-2, which places each gradient in its reduction bucket in the order they arrive, reduces
    the plain model's gradients. HyperCLOVAX Vision V2's projector; Kimi-K2.5's and PaddleOCR-VL's,
    which start with a LayerNorm (its backward hands the weight over before the bias, a Linear's the
    bias first: zero-element slices of the parameters put them in the other order, and the
    LayerNorm's gradients came out wrong); ERNIE-4.5-VL's resampler. In a pool where ZeRO-3 never
    ran (:data:`zero2_world`)."""
    if not available(family):
        pytest.skip(f"this transformers has no {family}")
    results = zero2_world.run(_zero_steps, family, 2, timeout=180)
    assert [r["applied"] for r in results] == [APPLIED] * RANKS, results
