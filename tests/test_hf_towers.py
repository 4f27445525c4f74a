"""Hugging Face Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers, unchanged, through the balancer.

Tiny random configs (no downloads). With transformers 5 the towers return ``ModelOutput``
objects: ``last_hidden_state`` per patch, ``pooler_output`` per merged token and, for Qwen3-VL,
``deepstack_features``, a list per merged token; Qwen2.5-VL's ``last_hidden_state`` is in window
order within each image. With 4.x they return the merged tokens (Qwen3-VL: and the deepstack
list, as a tuple). All run on one pool of 4 workers (2 and 3 ranks on subgroups).
"""

from __future__ import annotations

from typing import Any

import pytest
import towers
from equivalence import APPLIED_COLLECTIVES, run_cases
from test_balancer import THRESHOLD_0, standard_cases

from lightning_vit_balance.exchange import GATHER_CAPACITY

pytest.importorskip("transformers")

POOL = 4


def _hf_suite(n: int, towers: tuple[str, ...]) -> dict[str, Any]:
    cases = standard_cases(n)
    results: dict[str, Any] = {}
    for name in towers:
        results[name] = run_cases(n, name, cases, "float32", THRESHOLD_0)
        results[f"{name}/bf16"] = run_cases(n, name, cases[:2], "bfloat16", THRESHOLD_0)
    return results


@pytest.mark.parametrize(
    ("n", "towers"),
    [
        (2, ("qwen2_vl", "qwen3_vl", "qwen2_5_vl")),
        (3, ("qwen2_vl", "qwen3_vl")),
        (4, ("qwen2_vl", "qwen3_vl")),
    ],
)
def test_hf_vision_towers_equivalence(multirank: Any, n: int, towers: tuple[str, ...]) -> None:
    """Balanced == direct (outputs and summed gradients), APPLIED_COLLECTIVES when applied, 1 when not."""
    with multirank(POOL) as w:
        per_rank = w.run(_hf_suite, n, towers, timeout=240)[:n]
    for rank_results in per_rank:
        assert set(rank_results) == {*towers, *(f"{t}/bf16" for t in towers)}
        for name, results in rank_results.items():
            assert results[0]["applied"], name
            for r in results:
                expected = APPLIED_COLLECTIVES if r["applied"] else 1
                assert r["collectives"] == r["counted"] == expected, (name, r)


#: Each temporal step of a video is an item of its own (Hugging Face's towers attend per step).
SPLIT_VIDEOS = {**THRESHOLD_0, "split_videos": True}


def _split_videos_suite(n: int, towers: tuple[str, ...]) -> dict[str, Any]:
    # The standard cases (videos of 2 and 3 steps among them), then one 6-step video that, whole,
    # would outweigh the mean load, then a video of more steps than the metadata gather carries
    # rows: it travels as one grid row and is split after the gather, so no second gather.
    long = [[(GATHER_CAPACITY + 6, 2, 2)], *[[] for _ in range(n - 2)], [(1, 2, 2)]]
    cases = [*standard_cases(n), {"grids": [[(6, 4, 4)], *[[] for _ in range(n - 2)], [(1, 2, 2)]]}]
    cases.append({"grids": long})
    return {
        f"{name}/{mode}": run_cases(n, name, cases, "float32", SPLIT_VIDEOS, prepared=mode == "prepared")
        for name in towers
        for mode in ("in the forward", "prepared")
    }


def test_hf_vision_towers_with_split_videos(multirank: Any) -> None:
    """``split_videos``: balanced == direct, a video's steps spread over the ranks, planned in the
    forward or before it."""
    names = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    with multirank(POOL) as w:
        per_rank = w.run(_split_videos_suite, 3, names, timeout=240)[:3]
    for rank_results in per_rank:
        assert len(rank_results) == 2 * len(names)
        for name, results in rank_results.items():
            long_video, many_steps = results[-2:]
            # 6 steps of 16 patches and one image of 4: 4 steps go to the other two ranks.
            assert long_video["applied"] and long_video["moved_images"] == 4, (name, long_video)
            # With a plan prepared before the forward, the gather is not in it.
            gathers = 1 if name.endswith("in the forward") else 0
            assert many_steps["applied"], (name, many_steps)
            assert many_steps["collectives"] == APPLIED_COLLECTIVES - 1 + gathers, (name, many_steps)


def _hf_drop(n: int) -> bool | None:
    import torch
    import torch.distributed as dist
    import towers as tiny
    from equivalence import TOWERS
    from multirank import subgroup

    from lightning_vit_balance import OutputLayout, ViTBalanceConfig, ViTBalancer

    group = subgroup(n)
    rank = dist.get_rank()
    if rank >= n:
        return None
    torch.manual_seed(0)
    tower = TOWERS["qwen2_vl"]()
    grids = [[(1, 8, 8), (2, 4, 4)], *[[(1, 2, 2)] for _ in range(n - 1)]]
    pixels, grid = tiny.make_batch(grids[rank], seed=rank)
    layout = OutputLayout(kinds={"last_hidden_state": "drop"})
    balancer = ViTBalancer(ViTBalanceConfig(**THRESHOLD_0), group, output_layout=layout)
    out = balancer(tower, pixels, grid)
    reference = tower(pixels, grid)
    assert type(out) is type(reference) and out.last_hidden_state is None
    torch.testing.assert_close(out.pooler_output, reference.pooler_output, rtol=1e-4, atol=1e-5)
    return True


def test_hf_drop_last_hidden_state(multirank: Any) -> None:
    """A VLM that only uses pooler_output can leave last_hidden_state (per patch) at home."""
    if not towers.hf_towers_return_model_outputs():
        pytest.skip("transformers 4.x towers return the merged tokens alone: no per-patch rows to drop")
    with multirank(POOL) as w:
        assert w.run(_hf_drop, 2)[:2] == [True, True]
