"""Real 2-rank CPU Trainer fits with ViTBalanceMixin and ViTBalanceCallback (ddp_spawn and ddp)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_fit_script import RANKS, STEPS, TinyVLM, fit, make_sample

SCRIPT = Path(__file__).resolve().parent / "lightning_fit_script.py"
# Per step: one images call (applied) and one videos call (skipped: one video dominates).
CALLS_PER_STEP = 2
PER_STEP_KEYS = [
    "vit_balance/calls",
    "vit_balance/applied",
    "vit_balance/imbalance_before",
    "vit_balance/imbalance_after",
    "vit_balance/load_before/rank_0",
    "vit_balance/load_before/rank_1",
    "vit_balance/load_after/rank_0",
    "vit_balance/load_after/rank_1",
    "vit_balance/moved_images",
    "vit_balance/moved_patches",
    "vit_balance/moved_patch_fraction",
    "vit_balance/bytes_sent",
    "vit_balance/bytes_received",
    "vit_balance/plan_ms",
    "vit_balance/exchange_ms",
    "vit_balance/prepare_ms",
    "vit_balance/trip_ms",
    "vit_balance/collectives",
    "vit_balance/applied_total",
    "vit_balance/calls_total",
    "vit_balance/skipped/below-threshold",
    "vit_balance/skipped/no-gain",
]
# The balanced runs encode the same images with the same per-image maths as the unbalanced run;
# only the batch an image is encoded in differs, so fp32 matmul blocking may change the last bits
# (~1e-7 relative), compounded over a few SGD steps.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _l2_cost(grid_thw: torch.Tensor) -> float:
    return float(sum((t * h * w) ** 2 for t, h, w in grid_thw.tolist()))


def _rows(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _losses(run_dir: Path) -> torch.Tensor:
    by_step = {int(r["step"]): r["train_loss"] for r in _rows(run_dir) if "train_loss" in r}
    assert sorted(by_step) == list(range(STEPS))
    return torch.tensor([by_step[s] for s in range(STEPS)])


def _balance_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    return {int(r["step"]): r for r in _rows(run_dir) if "vit_balance/calls" in r}


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A balanced ``ddp_spawn`` fit; ddp_spawn loads the trained weights back into this process."""
    out = tmp_path_factory.mktemp("spawn")
    model = fit(str(out), "balanced", True, "ddp_spawn")
    return {"dir": out / "balanced", "weights": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``strategy="ddp"`` relaunches the script for rank 1, so it runs as its own program.

    It fits three times in the same processes: balancing disabled, then enabled with verbose
    reports, then enabled with ``plan_ahead``.
    """
    out = tmp_path_factory.mktemp("ddp")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=200
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {"out": out, "stdout": done.stdout, "stderr": done.stderr}


def _check_balance_metrics(run_dir: Path) -> None:
    rows = _balance_rows(run_dir)
    assert sorted(rows) == list(range(STEPS))
    for step, row in rows.items():
        assert [k for k in PER_STEP_KEYS if k not in row] == [], step
        assert row["vit_balance/calls"] == CALLS_PER_STEP
        # Images apply, videos skip: half the calls of every step.
        assert row["vit_balance/applied"] == 0.5
        assert row["vit_balance/applied_total"] == step + 1
        assert row["vit_balance/calls_total"] == CALLS_PER_STEP * (step + 1)
        assert row["vit_balance/skipped/no-gain"] == step + 1
        assert row["vit_balance/skipped/below-threshold"] == 0
        assert row["vit_balance/moved_patches"] > 0
        assert row["vit_balance/bytes_sent"] > 0 and row["vit_balance/bytes_received"] > 0
        # Balancing lowered the imbalance (the mean over the step's calls, skipped one included).
        assert row["vit_balance/imbalance_after"] < row["vit_balance/imbalance_before"]
        # Loads before: the default cost l**2 of each rank's own images, averaged over the 2 calls.
        for rank in range(RANKS):
            sample = make_sample(step, rank)
            cost = sum(_l2_cost(sample[key]) for key in ("image_grid_thw", "video_grid_thw"))
            assert row[f"vit_balance/load_before/rank_{rank}"] == cost / CALLS_PER_STEP
        loads_after = [row[f"vit_balance/load_after/rank_{r}"] for r in range(RANKS)]
        loads_before = [row[f"vit_balance/load_before/rank_{r}"] for r in range(RANKS)]
        assert math.isclose(sum(loads_after), sum(loads_before), rel_tol=1e-9)


@pytest.mark.timeout(240)
def test_ddp_spawn_logs_every_metric_each_step(spawn_run: dict[str, Any]) -> None:
    _check_balance_metrics(spawn_run["dir"])


@pytest.mark.timeout(240)
def test_ddp_logs_every_metric_and_verbose_reports(ddp_run: dict[str, Any]) -> None:
    _check_balance_metrics(ddp_run["out"] / "ddp")
    assert _balance_rows(ddp_run["out"] / "ddp_disabled") == {}, "nothing recorded when disabled"
    # The verbose report: one line per call through Lightning's rank_zero_info (its logger writes to
    # stderr), on global rank 0 only.
    output = ddp_run["stdout"] + ddp_run["stderr"]
    reports = [line for line in output.splitlines() if line.startswith("[vit-balance]")]
    assert len(reports) == CALLS_PER_STEP * STEPS
    assert sum(line.startswith("[vit-balance] APPLY (applied) imbalance") for line in reports) == STEPS
    assert sum(line.startswith("[vit-balance] SKIP (no-gain) imbalance") for line in reports) == STEPS
    assert all("load per rank [" in line for line in reports)
    assert reports[-1].endswith(f"applied {STEPS}/{CALLS_PER_STEP * STEPS}")


@pytest.mark.timeout(240)
def test_balanced_training_matches_the_unbalanced_run(
    spawn_run: dict[str, Any], ddp_run: dict[str, Any]
) -> None:
    reference = _losses(ddp_run["out"] / "ddp_disabled")
    torch.testing.assert_close(_losses(spawn_run["dir"]), reference, **TOLERANCE)
    torch.testing.assert_close(_losses(ddp_run["out"] / "ddp"), reference, **TOLERANCE)

    reference_weights = torch.load(ddp_run["out"] / "ddp_disabled" / "weights.pt")
    initial = TinyVLM().state_dict()
    assert any(not torch.equal(initial[k], reference_weights[k]) for k in initial), "training moved"
    torch.testing.assert_close(spawn_run["weights"], reference_weights, **TOLERANCE)
    torch.testing.assert_close(
        torch.load(ddp_run["out"] / "ddp" / "weights.pt"), reference_weights, **TOLERANCE
    )


@pytest.mark.timeout(240)
def test_plans_made_before_the_forward_train_the_same(ddp_run: dict[str, Any]) -> None:
    """plan_ahead: the images call uses the plan made before the forward, the same training."""
    planned = ddp_run["out"] / "planned"
    rows = _balance_rows(planned)
    assert sorted(rows) == list(range(STEPS))
    for row in rows.values():
        assert row["vit_balance/calls"] == CALLS_PER_STEP and row["vit_balance/applied"] == 0.5
        # The prepared images call (applied) makes only the pixel trip, the status gather and the
        # return trip (its gather ran in on_before_batch_transfer); the videos call gathers and skips.
        assert row["vit_balance/collectives"] == 3 + 1
        # Its gather and plan are logged as made before the forward; the videos call plans itself.
        assert row["vit_balance/prepare_ms"] > 0.0 and row["vit_balance/plan_ms"] > 0.0
        # The images call's trips, reported by the videos call after it in the same step.
        assert row["vit_balance/trip_ms"] > 0.0
    for row in _balance_rows(ddp_run["out"] / "ddp").values():
        assert row["vit_balance/prepare_ms"] == 0.0
    reference = _losses(ddp_run["out"] / "ddp_disabled")
    torch.testing.assert_close(_losses(planned), reference, **TOLERANCE)
    reference_weights = torch.load(ddp_run["out"] / "ddp_disabled" / "weights.pt")
    torch.testing.assert_close(torch.load(planned / "weights.pt"), reference_weights, **TOLERANCE)
