"""Eight real gloo ranks: more than the other multi-rank tests use, with random batches.

Jobs run at 8-512 data-parallel ranks, the rest of the suite at 2-4. Here every rank draws its
own batch from one seeded generator (some ranks without images, videos of 2-3 temporal steps, a
rank with 8 images), so the planner's paths for several ranks above and below the bound, the
wire's splits over eight peers and empty ranks all meet in one call.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from equivalence import APPLIED_COLLECTIVES, run_cases
from test_prepared import PREPARED_APPLIED

RANKS = 8
MERGE = 2  # the spatial merge of the towers below: grid sides are multiples of it


def random_cases(seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` cases of per-rank grids ``(T, H, W)``; every third case has a rank with 8 images."""
    draw = random.Random(seed)
    cases = []
    for index in range(count):
        sizes = [draw.choice([0, 1, 1, 2, 3, 5]) for _ in range(RANKS)]
        if index % 3 == 0:
            sizes[draw.randrange(RANKS)] = 8
        grids = [
            [
                (draw.choice([1, 1, 1, 2, 3]), MERGE * draw.randint(1, 6), MERGE * draw.randint(1, 6))
                for _ in range(k)
            ]
            for k in sizes
        ]
        cases.append({"grids": grids, "pixel_grad": index % 2 == 0})
    return cases


def _suite(tower: str, config: dict[str, Any], prepared: bool) -> list[dict[str, Any]] | None:
    return run_cases(
        RANKS, tower, random_cases(seed=len(tower), count=6), "float32", config, prepared=prepared
    )


@pytest.mark.parametrize(
    ("tower", "config", "prepared"),
    [
        ("window", {"trigger_threshold": 0.0}, False),
        ("qwen2_5_vl", {}, True),
        ("dict", {"trigger_threshold": 0.0, "max_len_ratio": 1.2}, False),
    ],
)
def test_eight_ranks_equal_the_direct_call(
    multirank: Any, tower: str, config: dict[str, Any], prepared: bool
) -> None:
    """Outputs and summed gradients as each rank's direct call, on 8 ranks, with the default
    config and the skip rules off, a patch cap, and plans made ahead; the collectives as counted."""
    with multirank(RANKS) as w:
        per_rank = w.run(_suite, tower, config, prepared)
    applied_collectives = PREPARED_APPLIED if prepared else APPLIED_COLLECTIVES
    for results in per_rank:
        assert any(r["applied"] for r in results), results
        for r in results:
            skipped_collectives = 0 if prepared else 1  # the metadata gather, unless made ahead
            assert (
                r["counted"]
                == r["collectives"]
                == (applied_collectives if r["applied"] else skipped_collectives)
            ), r
    # Every rank applied the same plans (a plan differing between ranks would fail the exchange).
    assert len({tuple(r["applied"] for r in results) for results in per_rank}) == 1
