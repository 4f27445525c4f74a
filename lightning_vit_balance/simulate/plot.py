"""The simulator's picture: predicted speed-up per DP size and the imbalance before and after."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_vit_balance.simulate.run import DPResult

__all__ = ["check_format", "render_plot"]

_COLOURS = {"before": "tab:red", "after": "tab:blue"}


def check_format(path: Path) -> None:
    """Raise ValueError unless matplotlib is installed and can write ``path``'s suffix."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise ValueError(f"--plot {path} needs matplotlib: pip install matplotlib.") from None
    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise ValueError(
            f"--plot {path}: expected a file name ending in one of .{', .'.join(sorted(formats))}."
        )


def _draw_speedup(axes: Any, results: Sequence[DPResult]) -> None:
    sizes = [r.ranks for r in results]
    axes.plot(sizes, [r.speedup for r in results], marker="o", color="tab:green", label="with balancing")
    # Markers too: a line through a single DP size draws nothing.
    bounds = [r.speedup_bound for r in results]
    axes.plot(sizes, bounds, linestyle=":", marker="_", markersize=14, color="grey", label="bound (ideal)")
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    for size, result in zip(sizes, results):
        axes.annotate(
            f"{result.speedup:.2f}x", (size, result.speedup), textcoords="offset points", xytext=(0, 6)
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(s) for s in sizes])
    axes.set_xlabel("data-parallel ranks")
    axes.set_ylabel("predicted ViT speed-up (slowest rank)")
    axes.set_title("Speed-up from balancing")
    axes.legend()


def _draw_imbalance(axes: Any, results: Sequence[DPResult]) -> None:
    from matplotlib.patches import Patch

    positions = range(len(results))
    for offset, key in ((-0.2, "before"), (0.2, "after")):
        boxes = axes.boxplot(
            [getattr(r, f"imbalance_{key}") for r in results],
            positions=[p + offset for p in positions],
            widths=0.35,
            showfliers=False,
            patch_artist=True,
        )
        for box in boxes["boxes"]:
            box.set_facecolor(_COLOURS[key])
            box.set_alpha(0.5)
    axes.set_xticks(list(positions), [str(r.ranks) for r in results])
    axes.set_xlabel("data-parallel ranks")
    axes.set_ylabel("imbalance max/mean - 1 per step")
    axes.set_title("Imbalance without and with balancing")
    axes.legend(handles=[Patch(color=c, alpha=0.5, label=k) for k, c in _COLOURS.items()])


def render_plot(results: Sequence[DPResult], image_format: str = "png") -> bytes:
    """Draw the simulation and return the encoded image (matplotlib's Agg canvas, no display).

    Left: the predicted ViT speed-up and its bound against the DP size. Right: box plots of the
    per-step imbalance ``max/mean - 1`` without and with balancing at each DP size.
    """
    # Imported here: matplotlib is an optional dependency and slow to import.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    speed, spread = figure.subplots(1, 2)
    _draw_speedup(speed, results)
    _draw_imbalance(spread, results)
    buffer = io.BytesIO()
    figure.savefig(buffer, format=image_format, dpi=110)
    return buffer.getvalue()
