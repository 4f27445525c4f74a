"""Predict the gain of ViT balancing from a dataset's image and video sizes, before training.

``python -m lightning_vit_balance.simulate DATASET --ranks 8 32 128 512`` (or the
``vit-balance-simulate`` command) reads the sizes, draws random micro-batches on every rank, plans
every step with :func:`~lightning_vit_balance.plan_rebalance` and reports the imbalance before and
after, the predicted ViT speed-up, the skipped steps and the bytes moved, per DP size.

The pieces are usable from Python too: :class:`ResizeRule` turns sizes into Qwen-VL grids,
:func:`read_dataset` reads a dataset file, :func:`simulate` runs the steps.
"""

from __future__ import annotations

from lightning_vit_balance.simulate.cli import main
from lightning_vit_balance.simulate.dataset import InputError, VisualDataset, read_dataset, read_timings
from lightning_vit_balance.simulate.run import DPResult, draw_batches, simulate
from lightning_vit_balance.simulate.sizes import ResizeRule, smart_resize

__all__ = [
    "DPResult",
    "InputError",
    "ResizeRule",
    "VisualDataset",
    "draw_batches",
    "main",
    "read_dataset",
    "read_timings",
    "simulate",
    "smart_resize",
]
