"""Summaries of a simulation: a machine-readable report and the table printed from it."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_vit_balance.simulate.dataset import VisualDataset
from lightning_vit_balance.simulate.run import DPResult

__all__ = ["dataset_summary", "render_table", "result_summary"]

_WIDTH = 100


def _mean_p90(values: np.ndarray) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "p90": float(np.percentile(values, 90))}


def dataset_summary(dataset: VisualDataset) -> dict[str, Any]:
    """Counts and patch-count percentiles of a dataset."""
    patches = np.fromiter((n for sample in dataset.samples for n in sample), dtype=np.int64)
    return {
        "source": dataset.source,
        "samples": len(dataset.samples),
        "text_only_samples": sum(not sample for sample in dataset.samples),
        "images": dataset.num_images,
        "videos": dataset.num_videos,
        "patches_per_visual": {
            "median": float(np.median(patches)),
            "p90": float(np.percentile(patches, 90)),
            "max": int(patches.max()),
        },
    }


def result_summary(result: DPResult, row_bytes: int) -> dict[str, Any]:
    """The figures of one DP size; traffic is per step and per rank, ``row_bytes`` per patch row."""
    shares = result.reason_shares()
    per_rank_rows = float(result.moved_rows.mean()) / result.ranks
    busiest_rows = float(result.busiest_rows.mean())
    return {
        "ranks": result.ranks,
        "steps": result.steps,
        "imbalance_before": _mean_p90(result.imbalance_before),
        "imbalance_after": _mean_p90(result.imbalance_after),
        "makespan_before_mean": float(result.makespan_before.mean()),
        "makespan_after_mean": float(result.makespan_after.mean()),
        "speedup": result.speedup,
        "speedup_bound": result.speedup_bound,
        "applied_share": shares.get("applied", 0.0),
        "skipped_shares": {reason: share for reason, share in shares.items() if reason != "applied"},
        "moved_rows_per_rank": per_rank_rows,
        "moved_bytes_per_rank": per_rank_rows * row_bytes,
        "busiest_rank_rows": busiest_rows,
        "busiest_rank_bytes": busiest_rows * row_bytes,
        "plan_ms": {key: value * 1e3 for key, value in _mean_p90(result.plan_seconds).items()},
    }


_COLUMNS: tuple[tuple[str, int], ...] = (
    ("ranks", 5),
    ("imbalance before", 16),
    ("imbalance after", 16),
    ("speed-up", 8),
    ("bound", 6),
    ("applied", 7),
    ("rows/rank", 9),
    ("MB/rank", 7),
    ("max MB", 6),
    ("plan ms", 7),
)


def _row(cells: Sequence[str]) -> str:
    return "  ".join(cell.rjust(width) for cell, (_, width) in zip(cells, _COLUMNS)).rstrip()


def _result_cells(item: dict[str, Any]) -> list[str]:
    before, after = item["imbalance_before"], item["imbalance_after"]
    return [
        str(item["ranks"]),
        f"{before['mean']:.3f} / {before['p90']:.3f}",
        f"{after['mean']:.3f} / {after['p90']:.3f}",
        f"{item['speedup']:.3f}x",
        f"{item['speedup_bound']:.2f}x",
        f"{item['applied_share']:.0%}",
        f"{item['moved_rows_per_rank']:,.0f}",
        f"{item['moved_bytes_per_rank'] / 1e6:.2f}",
        f"{item['busiest_rank_bytes'] / 1e6:.2f}",
        f"{item['plan_ms']['mean']:.2f}",
    ]


def _skip_table(results: Sequence[dict[str, Any]]) -> list[str]:
    reasons = sorted({reason for item in results for reason in item["skipped_shares"]})
    if not reasons:
        return ["Skipped steps: none."]
    widths = [max(len(reason), 6) for reason in reasons]
    lines = [
        "Skipped steps, share by reason:",
        "ranks  " + "  ".join(r.rjust(w) for r, w in zip(reasons, widths)),
    ]
    for item in results:
        shares = [f"{item['skipped_shares'].get(r, 0.0):.1%}".rjust(w) for r, w in zip(reasons, widths)]
        lines.append(str(item["ranks"]).rjust(5) + "  " + "  ".join(shares))
    return lines


def _context_lines(report: dict[str, Any]) -> list[str]:
    data, settings = report["dataset"], report["settings"]
    patches, cap = data["patches_per_visual"], settings["max_len_ratio"]
    dataset = (
        f"Dataset {data['source']}: {data['samples']:,} samples ({data['text_only_samples']:,} text-only), "
        f"{data['images']:,} images, {data['videos']:,} videos; patches per visual: median "
        f"{patches['median']:,.0f}, p90 {patches['p90']:,.0f}, max {patches['max']:,}."
    )
    run = (
        f"{settings['samples_per_rank']} samples per rank, {settings['steps']:,} steps per DP size, "
        f"seed {settings['seed']}; solver {settings['solver']}, trigger threshold "
        f"{settings['trigger_threshold']}, min gain {settings['min_gain']}, patch cap "
        f"{'none' if cap is None else cap}; cost model {settings['cost_model']['name']}."
    )
    return [*textwrap.wrap(dataset, _WIDTH), *textwrap.wrap(run, _WIDTH)]


def _units(settings: dict[str, Any]) -> str:
    """What the plans move whole."""
    if settings.get("split_videos"):
        return "images are never split; videos move by temporal step, --split-videos"
    return "images and videos are never split"


def render_table(report: dict[str, Any]) -> str:
    """The text report: context, one row per DP size, skip reasons, and what the columns mean."""
    settings = report["settings"]
    lines = [*_context_lines(report), "", _row([name for name, _ in _COLUMNS])]
    lines += [_row(_result_cells(item)) for item in report["results"]]
    lines += ["", *_skip_table(report["results"]), ""]
    legend = (
        "imbalance: max/mean - 1 of the rank costs, mean / p90 over steps. speed-up: predicted ViT "
        "speed-up, the mean slowest-rank cost without balancing over the mean with it; bound: the most any "
        f"plan could give ({_units(settings)}). rows/rank, MB/rank: patch rows one rank sends per step, "
        f"on average ({settings['row_bytes']:,} bytes a row: {settings['channels']} values of "
        f"{settings['dtype']}); max MB: the most one rank sends or receives in a step, on average. "
        "plan ms: plan_rebalance time per step."
    )
    lines += textwrap.wrap(legend, _WIDTH)
    return "\n".join(lines) + "\n"
