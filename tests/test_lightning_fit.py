"""Real 2-rank CPU Trainer fits with ViTBalanceMixin and ViTBalanceCallback (ddp_spawn and ddp)."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fit_script import RANKS, STEPS, fit, make_sample

SCRIPT = Path(__file__).resolve().parent / "lightning_fit_script.py"
# Per step: one images call (applied) and one videos call (skipped: rank 1's one video dominates).
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
    "vit_balance/collectives",
    "vit_balance/applied_total",
    "vit_balance/calls_total",
    "vit_balance/skipped/below-threshold",
    "vit_balance/skipped/no-gain",
]


def _l2_cost(grid_thw: torch.Tensor) -> float:
    return float(sum((t * h * w) ** 2 for t, h, w in grid_thw.tolist()))


def _rows(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _losses(rows: list[dict[str, float]]) -> dict[int, float]:
    return {int(r["step"]): r["train_loss"] for r in rows if "train_loss" in r}


def _balance_rows(rows: list[dict[str, float]]) -> dict[int, dict[str, float]]:
    return {int(r["step"]): r for r in rows if "vit_balance/calls" in r}


@pytest.fixture(scope="module")
def spawn_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One balanced (verbose) and one disabled ``ddp_spawn`` fit, shared by the tests below."""
    out = tmp_path_factory.mktemp("fits")
    runs: dict[str, object] = {"out": out}
    for version, enabled in (("balanced", True), ("disabled", False)):
        model = fit(str(out), version, enabled, "ddp_spawn", verbose=enabled)
        # ddp_spawn loads the trained weights back into the parent's module.
        runs[version] = {k: v.clone() for k, v in model.state_dict().items()}
    return runs


@pytest.mark.timeout(240)
def test_ddp_spawn_logs_every_metric_each_step(spawn_runs: dict[str, object]) -> None:
    rows = _balance_rows(_rows(spawn_runs["out"] / "balanced"))  # type: ignore[operator]
    assert sorted(rows) == list(range(STEPS))
    for step, row in rows.items():
        assert [k for k in PER_STEP_KEYS if k not in row] == [], step
        assert row["vit_balance/calls"] == CALLS_PER_STEP
        # Images apply, videos skip: half the calls of every step.
        assert row["vit_balance/applied"] == 0.5
        assert row["vit_balance/applied_total"] == step + 1
        assert row["vit_balance/calls_total"] == CALLS_PER_STEP * (step + 1)
        assert row["vit_balance/skipped/no-gain"] == step + 1
        assert row["vit_balance/moved_patches"] > 0 and row["vit_balance/bytes_sent"] > 0
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
    disabled = _rows(spawn_runs["out"] / "disabled")  # type: ignore[operator]
    assert _balance_rows(disabled) == {}, "nothing is recorded when balancing is disabled"


@pytest.mark.timeout(240)
def test_ddp_spawn_training_matches_the_unbalanced_run(spawn_runs: dict[str, object]) -> None:
    balanced = _losses(_rows(spawn_runs["out"] / "balanced"))  # type: ignore[operator]
    disabled = _losses(_rows(spawn_runs["out"] / "disabled"))  # type: ignore[operator]
    assert sorted(balanced) == sorted(disabled) == list(range(STEPS))
    # Same images, same per-image maths; only the batch an image is encoded in differs, so fp32
    # matmul blocking may change the last bits (~1e-7 relative), compounded over 4 SGD steps.
    torch.testing.assert_close(
        torch.tensor([balanced[s] for s in range(STEPS)]),
        torch.tensor([disabled[s] for s in range(STEPS)]),
        rtol=1e-5,
        atol=1e-6,
    )
    balanced_weights, disabled_weights = spawn_runs["balanced"], spawn_runs["disabled"]
    assert isinstance(balanced_weights, dict) and isinstance(disabled_weights, dict)
    initial = fit.__globals__["TinyVLM"]().state_dict()
    moved = any(not torch.equal(initial[k], balanced_weights[k]) for k in initial)
    assert moved, "training changed the weights"
    torch.testing.assert_close(balanced_weights, disabled_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_ddp_strategy_script(tmp_path: Path, spawn_runs: dict[str, object]) -> None:
    """``strategy="ddp"`` relaunches the script for rank 1, so it runs as its own process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "ddp", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    rows = _rows(tmp_path / "ddp")
    balance = _balance_rows(rows)
    assert sorted(balance) == list(range(STEPS))
    assert balance[STEPS - 1]["vit_balance/applied_total"] == STEPS
    assert all(r["vit_balance/imbalance_after"] < r["vit_balance/imbalance_before"] for r in balance.values())
    # The verbose report: DP rank 0 prints one line per call (the other rank prints nothing).
    reports = [line for line in done.stdout.splitlines() if line.startswith("[vit-balance]")]
    assert len(reports) == CALLS_PER_STEP * STEPS
    assert sum(line.startswith("[vit-balance] APPLY (applied)") for line in reports) == STEPS
    assert sum(line.startswith("[vit-balance] SKIP (no-gain)") for line in reports) == STEPS
    assert reports[-1].endswith(f"applied {STEPS}/{CALLS_PER_STEP * STEPS}")
    # Same training as the ddp_spawn runs.
    spawn_losses = _losses(_rows(spawn_runs["out"] / "disabled"))  # type: ignore[operator]
    ddp_losses = _losses(rows)
    torch.testing.assert_close(
        torch.tensor([ddp_losses[s] for s in range(STEPS)]),
        torch.tensor([spawn_losses[s] for s in range(STEPS)]),
        rtol=1e-5,
        atol=1e-6,
    )
    weights = torch.load(tmp_path / "ddp" / "weights.pt")
    torch.testing.assert_close(weights, spawn_runs["disabled"], rtol=1e-5, atol=1e-6)
