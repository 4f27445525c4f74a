"""The examples: the demo's tiny VLM and dataset, the dashboard script, the Hugging Face towers.

Multi-rank checks run on the reusable gloo pool of :mod:`multirank`: balanced outputs (deepstack
features included), the regenerated window index and every gradient must equal an unbalanced call.
"""

from __future__ import annotations

import csv
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import plot_vit_balance  # noqa: E402
import towers  # noqa: E402
from multirank import world  # noqa: E402
from tiny_vlm import SyntheticVLMDataset, TinyTextDecoder, TinyVisionTower, collate_vlm  # noqa: E402

# Balanced and unbalanced calls run the same per-image math; only the rows sharing a matrix
# product (and so GEMM blocking) and the order of DDP-style gradient sums change. float32
# rounding of ~1e-7 per operation, accumulated over the ~1e3-term dot products of these towers,
# stays below 1e-5 relative; 1e-4 leaves a margin while any misrouted row (an O(1) difference)
# still fails.
RTOL, ATOL = 1e-4, 1e-5

SMALL_TOWER = {"patch_dim": 48, "embed_dim": 16, "depth": 3, "num_heads": 2, "out_dim": 16}


def _tensor_leaves(output: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a tensor / tuple / list / dict / ModelOutput, with a path."""
    if isinstance(output, torch.Tensor):
        return [(prefix, output)]
    if isinstance(output, dict):  # ModelOutput is an OrderedDict
        items = list(output.items())
    elif isinstance(output, (tuple, list)):
        items = list(enumerate(output))
    else:
        return []
    leaves = []
    for key, value in items:
        leaves.extend(_tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return leaves


# --------------------------------------------------------------------------- single process


def test_tiny_tower_encodes_each_image_independently() -> None:
    """Outputs of an image do not depend on its batch neighbours (windowed layers included)."""
    torch.manual_seed(0)
    tower = TinyVisionTower(**SMALL_TOWER, window_layers=(1,), window_size=2, deepstack_layers=(0, 2))
    grid = torch.tensor([[1, 6, 8], [2, 4, 4], [1, 2, 2]])
    lengths = grid.prod(-1).tolist()
    pixels = torch.randn(sum(lengths), SMALL_TOWER["patch_dim"])
    embeds, window_index, deepstack = tower(pixels, grid)
    assert embeds.shape == (sum(lengths) // 4, SMALL_TOWER["out_dim"])
    assert len(deepstack) == 2 and all(d.shape == embeds.shape for d in deepstack)
    assert sorted(window_index.tolist()) == list(range(sum(lengths) // 4))
    start_patch = start_token = 0
    for i, length in enumerate(lengths):
        alone, _, alone_deep = tower(pixels[start_patch : start_patch + length], grid[i : i + 1])
        rows = slice(start_token, start_token + length // 4)
        torch.testing.assert_close(embeds[rows], alone, rtol=RTOL, atol=ATOL)
        for together, single in zip(deepstack, alone_deep):
            torch.testing.assert_close(together[rows], single, rtol=RTOL, atol=ATOL)
        start_patch += length
        start_token += length // 4


def test_tiny_tower_rejects_pixel_rows_that_do_not_match_the_grid() -> None:
    tower = TinyVisionTower(**SMALL_TOWER)
    with pytest.raises(ValueError, match=r"pixel_values has shape \(10, 48\)"):
        tower(torch.zeros(10, 48), torch.tensor([[1, 2, 2]]))


def test_decoder_uses_image_tokens_and_trains() -> None:
    torch.manual_seed(0)
    decoder = TinyTextDecoder(vocab_size=32, dim=16, depth=2, num_heads=2)
    ids = torch.randint(0, 32, (2, 6))
    image_tokens = torch.randn(5, 16)
    loss = decoder(image_tokens, [3, 2], ids, [torch.randn(5, 16)])
    other = decoder(image_tokens + 1.0, [3, 2], ids, [torch.randn(5, 16)])
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert not torch.allclose(loss, other)  # the image prefix reaches the text predictions
    loss.backward()
    assert decoder.token_embed.weight.grad is not None


def test_dataset_is_deterministic_uneven_and_collates() -> None:
    dataset = SyntheticVLMDataset(64, patch_dim=48, seed=3)
    first, again = dataset[5], SyntheticVLMDataset(64, patch_dim=48, seed=3)[5]
    for key in first:
        assert torch.equal(first[key], again[key])
    patches = [int(dataset[i]["image_grid_thw"].prod(-1).sum()) for i in range(64)]
    # Very uneven: the heaviest samples carry an order of magnitude more patches than the lightest.
    assert max(patches) >= 10 * min(patches)
    kinds = {dataset.grids(i)[0] for i in range(64)}
    assert kinds == {"thumbnails", "photo", "document", "video"}
    grid = dataset[0]["image_grid_thw"]
    assert (grid[:, 1:] % 2 == 0).all()  # even sides: the 2x2 merge applies
    batch = collate_vlm([dataset[0], dataset[1]])
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    assert batch["images_per_sample"].tolist() == [
        len(dataset[0]["image_grid_thw"]),
        len(dataset[1]["image_grid_thw"]),
    ]
    assert batch["input_ids"].shape == (2, dataset.text_len)


# --------------------------------------------------------------------------- dashboard


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys = sorted({k for row in rows for k in row})
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def _metric_rows(steps: int) -> list[dict[str, Any]]:
    rows = []
    for step in range(steps):
        rows.append(
            {
                "step": step,
                "epoch": 0,
                "vit_balance/imbalance_before": 0.5 + 0.1 * step,
                "vit_balance/imbalance_after": 0.05,
                "vit_balance/applied": float(step % 2),
                "vit_balance/load_before/rank_0": 10.0 + step,
                "vit_balance/load_before/rank_1": 2.0,
                "vit_balance/load_after/rank_0": 6.0,
                "vit_balance/load_after/rank_1": 6.0 + step,
                "vit_balance/vit_ms/rank_0": 40.0 - step,
                "vit_balance/vit_ms/rank_1": 20.0 + step,
                "vit_balance/vit_ms_max": max(40.0 - step, 20.0 + step),
            }
        )
        rows.append({"step": step, "epoch": 0, "train_loss": 1.0})  # another logger call, other columns
    return rows


def test_dashboard_reads_csv_and_writes_png(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs" / "version_0"
    log_dir.mkdir(parents=True)
    _write_csv(log_dir / "metrics.csv", _metric_rows(4))
    metrics = plot_vit_balance.load_metrics(tmp_path / "logs")
    assert "train_loss" not in metrics
    assert metrics["vit_balance/imbalance_before"] == [(s, pytest.approx(0.5 + 0.1 * s)) for s in range(4)]
    assert metrics["vit_balance/load_after/rank_1"][-1] == (3, 9.0)
    assert metrics["vit_balance/vit_ms/rank_1"][-1] == (3, 23.0)
    out = plot_vit_balance.main([str(log_dir / "metrics.csv"), "-o", str(tmp_path / "dash.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A name without a suffix: the path returned (and printed) is the one written.
    out = plot_vit_balance.main([str(log_dir / "metrics.csv"), "-o", str(tmp_path / "plain")])
    assert out == tmp_path / "plain.png" and out.read_bytes()[:4] == b"\x89PNG"
    for refused in (str(tmp_path), "", str(tmp_path / "dash.txt")):  # a directory, nothing, another format
        with pytest.raises(SystemExit) as done:
            plot_vit_balance.main([str(log_dir / "metrics.csv"), "-o", refused])
        assert done.value.code == 2


def test_dashboard_draws_the_latest_of_several_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log directory holding two runs (a second fit, or a resumed one, in a new version
    directory) logs its steps twice: the dashboard draws the run written last, not both as one
    series with each step twice, and says which it drew."""
    import os

    for version, steps in (("version_1", 4), ("version_0", 3)):  # version_0 written last
        (tmp_path / "logs" / version).mkdir(parents=True)
        _write_csv(tmp_path / "logs" / version / "metrics.csv", _metric_rows(steps))
    os.utime(tmp_path / "logs" / "version_1" / "metrics.csv", (1_000_000, 1_000_000))
    metrics = plot_vit_balance.load_metrics(tmp_path / "logs")
    assert [s for s, _ in metrics["vit_balance/imbalance_before"]] == [0, 1, 2]
    plot_vit_balance.main([str(tmp_path / "logs"), "-o", str(tmp_path / "dash.png")])
    assert (
        f"pass another's directory to draw it: {tmp_path / 'logs' / 'version_1'}\n" in capsys.readouterr().out
    )
    # A later run without the series (a test run logging its loss alone) is passed over.
    (tmp_path / "logs" / "version_2").mkdir()
    _write_csv(tmp_path / "logs" / "version_2" / "metrics.csv", [{"step": 0, "test_loss": 1.0}])
    metrics = plot_vit_balance.load_metrics(tmp_path / "logs")
    assert [s for s, _ in metrics["vit_balance/imbalance_before"]] == [0, 1, 2]
    # Nor one of trainer.test() or trainer.validate() alone, whose ViTBalanceCallback logs the
    # loop's calls under vit_balance/test/ or vit_balance/val/: no training step to draw.
    for version, loop in (("version_3", "test"), ("version_4", "val")):
        (tmp_path / "logs" / version).mkdir()
        evaluated = {
            f"vit_balance/{loop}/{key.removeprefix('vit_balance/')}": value
            for key, value in _metric_rows(1)[0].items()
            if key.startswith("vit_balance/")
        }
        _write_csv(tmp_path / "logs" / version / "metrics.csv", [{"step": 0, "epoch": 0, **evaluated}])
    metrics = plot_vit_balance.load_metrics(tmp_path / "logs")
    assert [s for s, _ in metrics["vit_balance/imbalance_before"]] == [0, 1, 2]
    assert not [key for key in metrics if key.startswith(("vit_balance/val/", "vit_balance/test/"))]


def test_dashboard_reads_a_fabric_csv_log(tmp_path: Path) -> None:
    """Fabric's ``CSVLogger`` (what ``fabric.log_dict(BalanceMetrics.metrics(), step=step)`` writes
    to) lays out its log as the Trainer's does: the dashboard reads it."""
    from lightning.fabric.loggers import CSVLogger

    logger = CSVLogger(tmp_path, name="fabric")
    for row in _metric_rows(3):
        logger.log_metrics({k: v for k, v in row.items() if k not in ("step", "epoch")}, step=row["step"])
    logger.finalize("success")
    metrics = plot_vit_balance.load_metrics(tmp_path / "fabric")
    assert metrics["vit_balance/load_after/rank_1"][-1] == (2, 8.0)
    out = plot_vit_balance.main([str(tmp_path / "fabric" / "version_0"), "-o", str(tmp_path / "dash.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    """One protobuf field; ``payload`` is the raw value (length-prefixed here for wire type 2)."""
    key = _varint(number << 3 | wire)
    return key + (_varint(len(payload)) + payload if wire == 2 else payload)


def _event(step: int, tag: str, value: float, as_tensor: bool) -> bytes:
    """A TensorBoard ``Event`` record with one scalar, as ``simple_value`` or a float ``TensorProto``."""
    if as_tensor:
        tensor = _field(1, 0, _varint(1)) + _field(5, 2, struct.pack("<f", value))  # DT_FLOAT, float_val
        summary_value = _field(1, 2, tag.encode()) + _field(8, 2, tensor)
    else:
        summary_value = _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", value))
    event = _field(1, 1, struct.pack("<d", 1.0)) + _field(2, 0, _varint(step))
    event += _field(5, 2, _field(1, 2, summary_value))
    # TFRecord framing: length, its CRC, data, data CRC (the reader does not check CRCs).
    return struct.pack("<Q", len(event)) + b"\0" * 4 + event + b"\0" * 4


def test_dashboard_reads_tensorboard_events(tmp_path: Path) -> None:
    records = b"".join(
        _event(step, key, float(value), as_tensor=step % 2 == 1)
        for row in _metric_rows(3)
        for key, value in row.items()
        if key.startswith("vit_balance/")
        for step in [row["step"]]
    )
    (tmp_path / "events.out.tfevents.123.host").write_bytes(records)
    metrics = plot_vit_balance.load_metrics(tmp_path)
    assert [s for s, _ in metrics["vit_balance/imbalance_before"]] == [0, 1, 2]
    assert metrics["vit_balance/load_before/rank_0"][2][1] == pytest.approx(12.0)
    assert metrics["vit_balance/imbalance_after"][1][1] == pytest.approx(0.05)  # the tensor form
    out = plot_vit_balance.plot_dashboard(metrics, tmp_path / "tb.png")
    assert out.stat().st_size > 1000


def test_dashboard_circles_every_step_where_images_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of two calls where one moved images logs ``applied`` 0.5: it is circled too."""
    metrics = {
        "vit_balance/imbalance_before": [(0, 0.5), (1, 0.6), (2, 0.7)],
        "vit_balance/imbalance_after": [(0, 0.1), (1, 0.6), (2, 0.2)],
        "vit_balance/applied": [(0, 1.0), (1, 0.0), (2, 0.5)],
    }
    figure = _drawn_figure(monkeypatch, metrics, tmp_path / "dash.png")
    (circles,) = [c for ax in figure.axes for c in ax.collections if c.get_label() == "applied"]
    assert circles.get_offsets().tolist() == [[0.0, 0.5], [2.0, 0.7]]
    assert figure.axes[0].get_title() == "Imbalance of ViT load across ranks, per step"
    # With the counts since the start, the title says why the lines meet: the calls by outcome at
    # the last logged step, the most frequent skip first.
    counts = {
        "vit_balance/calls_total": [(0, 2.0), (2, 9.0)],
        "vit_balance/applied_total": [(0, 1.0), (2, 3.0)],
        "vit_balance/skipped/below-threshold": [(0, 1.0), (2, 2.0)],
        "vit_balance/skipped/no-gain": [(0, 0.0), (2, 4.0)],
        "vit_balance/skipped/no-images": [(0, 0.0), (2, 0.0)],
    }
    figure = _drawn_figure(monkeypatch, {**metrics, **counts}, tmp_path / "counts.png")
    assert (
        figure.axes[0]
        .get_title()
        .endswith("\n9 calls: 3 moved images; skipped: no-gain 4, below-threshold 2")
    )


def test_dashboard_draws_each_ranks_load_relative_to_its_steps_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cost units changed under the online fit (FLOPs of the configuration's model, then fitted
    milliseconds), which left the loads after the first fit flat at the bottom of the panels."""
    metrics = {
        "vit_balance/imbalance_before": [(0, 0.5), (1, 0.5)],
        "vit_balance/load_before/rank_0": [(0, 3.0e9), (1, 5.0)],
        "vit_balance/load_before/rank_1": [(0, 1.0e9), (1, 15.0)],
        "vit_balance/load_after/rank_0": [(0, 2.0e9), (1, 10.0)],
        "vit_balance/load_after/rank_1": [(0, 2.0e9), (1, 10.0)],
    }
    figure = _drawn_figure(monkeypatch, metrics, tmp_path / "relative.png")
    before, after = figure.axes[1:3]
    assert [list(line.get_ydata()) for line in before.get_lines()] == [[1.5, 0.5], [0.5, 1.5]]
    assert [list(line.get_ydata()) for line in after.get_lines()] == [[1.0, 1.0], [1.0, 1.0]]
    assert before.get_ylabel() == "load / mean load"
    # A step where no rank had images (a text-only step: every load 0) has no share to draw.
    text_only = {key: [*series, (2, 0.0)] if "/load_" in key else series for key, series in metrics.items()}
    figure = _drawn_figure(monkeypatch, text_only, tmp_path / "text_only.png")
    assert [list(line.get_xdata()) for line in figure.axes[1].get_lines()] == [[0, 1], [0, 1]]


def test_dashboard_reads_a_hugging_face_output_directory(tmp_path: Path) -> None:
    """A Hugging Face ``Trainer``'s output directory with ``report_to="tensorboard"``: its events
    hold ``train/vit_balance/...`` (the reporting callbacks prefix training entries) when
    ``ViTBalanceTrainerCallback().attach(trainer)`` logs through the Trainer; when the callback only
    kept them in the log history, the events hold the Trainer's own entries and the latest
    checkpoint's ``trainer_state.json`` has them."""
    rows = [row for row in _metric_rows(3) if "vit_balance/imbalance_before" in row]
    attached = tmp_path / "attached" / "runs" / "Dec05_host"
    attached.mkdir(parents=True)
    records = [
        _event(row["step"], f"train/{key}", float(value), as_tensor=False)
        for row in rows
        for key, value in row.items()
        if key.startswith("vit_balance/")
    ]
    (attached / "events.out.tfevents.1.host").write_bytes(b"".join(records))
    metrics = plot_vit_balance.load_metrics(tmp_path / "attached")
    assert [s for s, _ in metrics["vit_balance/imbalance_before"]] == [0, 1, 2]
    assert "train/vit_balance/imbalance_before" not in metrics

    kept = tmp_path / "kept"
    (kept / "runs" / "Dec05_host").mkdir(parents=True)
    losses = b"".join(_event(step, "train/loss", 1.0, as_tensor=False) for step in range(3))
    (kept / "runs" / "Dec05_host" / "events.out.tfevents.1.host").write_bytes(losses)
    for step in (2, 3):  # each checkpoint's history holds every earlier one's
        history = [{**row, "step": row["step"] + 1} for row in rows[:step]]
        (kept / f"checkpoint-{step}").mkdir()
        state = {"global_step": step, "log_history": history}
        (kept / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(state))
    metrics = plot_vit_balance.load_metrics(kept)
    assert [s for s, _ in metrics["vit_balance/imbalance_before"]] == [1, 2, 3]


def _drawn_figure(monkeypatch: pytest.MonkeyPatch, metrics: dict[str, Any], path: Path) -> Any:
    """Draw the dashboard of ``metrics`` and return the figure it saved."""
    from matplotlib.figure import Figure

    saved = []
    original = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda self, *a, **k: (saved.append(self), original(self, *a, **k))
    )
    plot_vit_balance.plot_dashboard(metrics, path)
    (figure,) = saved
    return figure


def test_dashboard_at_large_dp_sizes_draws_the_summaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beyond 64 ranks the log holds no per-rank series: the load panels say so, the measured
    panel draws the slowest rank and the mean, and its title names the rank slowest most often."""
    steps = range(4)
    metrics = {
        "vit_balance/imbalance_before": [(s, 0.6) for s in steps],
        "vit_balance/imbalance_after": [(s, 0.1) for s in steps],
        "vit_balance/vit_ms_max": [(s, 50.0 + s) for s in steps],
        "vit_balance/vit_ms_mean": [(s, 40.0) for s in steps],
        "vit_balance/vit_ms_slowest_rank": [(0, 37.0), (1, 5.0), (2, 37.0), (3, 37.0)],
    }
    figure = _drawn_figure(monkeypatch, metrics, tmp_path / "large.png")
    _, before, after, measured = figure.axes
    for panel in (before, after):
        assert [t.get_text() for t in panel.texts] == [
            "no per-rank series in this log (log_per_rank_loads; off beyond 64 ranks by default)"
        ]
    assert measured.get_title().endswith("slowest most often: rank 37 (3 of 4 records)")
    assert [t.get_text() for t in measured.get_legend().get_texts()] == ["slowest rank", "mean over ranks"]
    # With calibrate_cost, how far the online cost fit is off: the median of the last 10 records.
    # 5 records 50% off, then 7 records 10% off: the last 10 hold 3 and 7 (mean 22%).
    errors = {"vit_balance/cost_fit_error": [(s, 0.5 if s < 5 else 0.1) for s in range(12)]}
    figure = _drawn_figure(monkeypatch, {**metrics, **errors}, tmp_path / "fit.png")
    assert (
        figure.axes[3]
        .get_title()
        .endswith("rank 37 (3 of 4 records)\nonline cost fit off by 10% (median of the last 10 records)")
    )
    # With per-rank series of many ranks, their lines are drawn but not named one by one.
    many = {f"vit_balance/vit_ms/rank_{r}": [(s, 40.0 + r / 10) for s in steps] for r in range(20)}
    figure = _drawn_figure(monkeypatch, {**metrics, **many}, tmp_path / "many.png")
    measured = figure.axes[3]
    assert len(measured.get_lines()) == 21  # the ranks and the slowest rank's
    assert [t.get_text() for t in measured.get_legend().get_texts()] == ["slowest rank"]
    # The trips (a record's sum over its calls) per call, beside the ViT time they shorten; not
    # drawn where no trip was timed (above: no trip_ms at all).
    trips = {
        "vit_balance/calls": [(s, 2.0) for s in steps],
        "vit_balance/trip_ms": [(0, 0.0), (1, 9.0), (2, 7.0), (3, 8.0)],
    }
    figure = _drawn_figure(monkeypatch, {**metrics, **trips}, tmp_path / "trips.png")
    measured = figure.axes[3]
    assert [t.get_text() for t in measured.get_legend().get_texts()][-1] == "trips per call"
    assert list(measured.get_lines()[-1].get_ydata()) == [0.0, 4.5, 3.5, 4.0]


def test_dashboard_readers_skip_what_is_no_point_and_find_the_latest_checkpoint(tmp_path: Path) -> None:
    """A CSV cell ``nan`` and a history entry without a step are no points (not a NaN drawn, nor a
    KeyError); the latest ``trainer_state.json`` is the one at the highest step (``checkpoint-10``
    sorts before ``checkpoint-9`` by name), and a state whose ``global_step`` is not a number
    counts as step 0, not a TypeError."""
    _write_csv(
        tmp_path / "metrics.csv",
        [{"step": 0, "vit_balance/calls": "nan"}, {"step": 1, "vit_balance/calls": 2}],
    )
    assert plot_vit_balance.read_csv(tmp_path / "metrics.csv") == {"vit_balance/calls": [(1, 2.0)]}
    out = tmp_path / "out"
    for step, global_step in ((9, 9), (10, 10), (11, None)):
        history = [{"vit_balance/calls": 1.0}, {"vit_balance/calls": float(step), "step": step}]
        (out / f"checkpoint-{step}").mkdir(parents=True)
        state = {"global_step": global_step, "log_history": history}
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(state))
    assert plot_vit_balance.load_metrics(out) == {"vit_balance/calls": [(10, 10.0)]}


def test_dashboard_edges_of_its_panels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One device (imbalance 0 throughout) keeps a 0-0.1 axis, not an empty 0-0 one; 16 ranks are
    still named one by one; trips of 0 ms (nothing moved) are not drawn; the rank slowest most
    often, in a tie, is the lowest, not the first seen."""
    steps = range(2)
    metrics = {
        "vit_balance/imbalance_before": [(s, 0.0) for s in steps],
        "vit_balance/imbalance_after": [(s, 0.0) for s in steps],
        "vit_balance/vit_ms_max": [(s, 50.0) for s in steps],
        "vit_balance/vit_ms_slowest_rank": [(0, 9.0), (1, 3.0)],
        "vit_balance/calls": [(s, 1.0) for s in steps],
        "vit_balance/trip_ms": [(s, 0.0) for s in steps],
        **{f"vit_balance/vit_ms/rank_{r}": [(s, 40.0) for s in steps] for r in range(16)},
    }
    figure = _drawn_figure(monkeypatch, metrics, tmp_path / "edges.png")
    assert figure.axes[0].get_ylim() == pytest.approx((0.0, 0.1))
    names = [t.get_text() for t in figure.axes[3].get_legend().get_texts()]
    assert names == [f"rank {r}" for r in range(16)] + ["slowest rank"], names
    assert figure.axes[3].get_title().endswith("slowest most often: rank 3 (1 of 2 records)")


def test_dashboard_writes_an_upper_case_png_name(tmp_path: Path) -> None:
    """``-o dash.PNG`` is a PNG file (as matplotlib takes it), not a usage error."""
    _write_csv(tmp_path / "metrics.csv", _metric_rows(2))
    out = plot_vit_balance.main([str(tmp_path / "metrics.csv"), "-o", str(tmp_path / "dash.PNG")])
    assert out == tmp_path / "dash.PNG" and out.read_bytes()[:4] == b"\x89PNG"


def test_dashboard_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no metrics\.csv"):
        plot_vit_balance.load_metrics(tmp_path)
    _write_csv(tmp_path / "metrics.csv", [{"step": 0, "train_loss": 1.0}])
    # A run with enabled=False logs no such metrics: the message says so, not only the callback.
    with pytest.raises(ValueError, match=r"ViTBalanceCallback and balancing enabled \(enabled=False records"):
        plot_vit_balance.load_metrics(tmp_path)
    with pytest.raises(SystemExit) as done:  # the command line: one line, exit status 2
        plot_vit_balance.main([str(tmp_path)])
    assert done.value.code == 2
    for broken in ("[1, 2]", '{"log_history": 5}', "{"):  # not a Trainer's state: the file is named
        state = tmp_path / "hf" / "trainer_state.json"
        state.parent.mkdir(exist_ok=True)
        state.write_text(broken)
        with pytest.raises(ValueError, match=r"trainer_state\.json: not a"):
            plot_vit_balance.load_metrics(state)
        with pytest.raises(ValueError, match=r"trainer_state\.json: not a"):  # found in its folder
            plot_vit_balance.load_metrics(state.parent)


# --------------------------------------------------------------------------- multi-rank equivalence


def _build_tower(kind: str) -> torch.nn.Module:
    if kind == "tiny":
        torch.manual_seed(0)
        return TinyVisionTower(**SMALL_TOWER, window_layers=(1,), window_size=2, deepstack_layers=(0, 2))
    import hf_qwen_vit_balance

    return (
        hf_qwen_vit_balance.tiny_qwen2_vl_tower()
        if kind == "qwen2_vl"
        else hf_qwen_vit_balance.tiny_qwen3_vl_tower()
    )


def _patch_dim(kind: str) -> int:
    if kind == "tiny":
        return SMALL_TOWER["patch_dim"]
    import hf_qwen_vit_balance

    return hf_qwen_vit_balance.tower_patch_dim()


# Rank 0 holds a document and a video, rank 1 a thumbnail: far from balanced.
GRIDS = {0: [[1, 12, 8], [2, 6, 4], [1, 2, 2]], 1: [[1, 4, 2]]}


def _equivalence_worker(kind: str) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_vit_balance import ViTBalanceConfig, balanced_encode

    rank = dist.get_rank()
    tower = _build_tower(kind)
    grid = torch.tensor(GRIDS[rank])
    gen = torch.Generator().manual_seed(100 + rank)
    pixels = torch.randn(int(grid.prod(-1).sum()), _patch_dim(kind), generator=gen)

    def run(balanced: bool) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor], torch.Tensor]:
        tower.zero_grad(set_to_none=True)
        pixel_input = pixels.clone().requires_grad_(True)
        if balanced:
            output = balanced_encode(tower, pixel_input, grid, config=ViTBalanceConfig(trigger_threshold=0.0))
        else:
            output = tower(pixel_input, grid)
        leaves = _tensor_leaves(output)
        loss = pixel_input.new_zeros(())
        for index, (_, leaf) in enumerate(leaves):
            if leaf.is_floating_point():
                weights = torch.randn(leaf.shape, generator=torch.Generator().manual_seed(7 * index + rank))
                loss = loss + (leaf * weights).sum()
        loss.backward()
        grads = []
        for param in tower.parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad)  # what DDP does: the sum over ranks is what training sees
            grads.append(grad.clone())
        return [(p, t.detach().clone()) for p, t in leaves], grads, pixel_input.grad.clone()

    plain_leaves, plain_grads, plain_pixel_grad = run(balanced=False)
    balanced_leaves, balanced_grads, balanced_pixel_grad = run(balanced=True)
    assert [p for p, _ in plain_leaves] == [p for p, _ in balanced_leaves]
    for (path, expected), (_, actual) in zip(plain_leaves, balanced_leaves):
        assert actual.shape == expected.shape, path
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m, p=path: f"{p}: {m}")
    for expected, actual in zip(plain_grads, balanced_grads):
        torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(balanced_pixel_grad, plain_pixel_grad, rtol=RTOL, atol=ATOL)
    return {"paths": [p for p, _ in plain_leaves]}


@pytest.mark.parametrize("kind", ["tiny", "qwen2_vl", "qwen3_vl"])
def test_balanced_towers_match_unbalanced_across_ranks(kind: str) -> None:
    """Outputs, deepstack features, window index and all gradients equal the unbalanced call."""
    if kind != "tiny":
        pytest.importorskip("transformers")
    with world(2) as pool:
        results = pool.run(_equivalence_worker, kind, timeout=180)
    paths = results[0]["paths"]
    expected = {
        "tiny": ["0", "1", "2.0", "2.1"],
        "qwen2_vl": ["last_hidden_state", "pooler_output"],
        "qwen3_vl": ["last_hidden_state", "pooler_output", "deepstack_features.0", "deepstack_features.1"],
    }[kind]
    if kind != "tiny" and not towers.hf_towers_return_model_outputs():
        # transformers 4.x: the merged tokens alone (Qwen2-VL), or them and the deepstack list.
        expected = {"qwen2_vl": [""], "qwen3_vl": ["0", "1.0", "1.1"]}[kind]
    assert paths == expected


def _stats_worker() -> dict[str, Any]:
    """The balancer really moves images for the equivalence inputs (else the test proves nothing)."""
    import torch.distributed as dist

    from lightning_vit_balance import ViTBalanceConfig, ViTBalancer

    rank = dist.get_rank()
    tower = _build_tower("tiny")
    grid = torch.tensor(GRIDS[rank])
    pixels = torch.randn(int(grid.prod(-1).sum()), SMALL_TOWER["patch_dim"])
    balancer = ViTBalancer(ViTBalanceConfig(trigger_threshold=0.0))
    balancer(tower, pixels, grid)
    stats = balancer.last_stats
    return {
        "applied": stats.applied,
        "moved": stats.moved_patches,
        "after": stats.imbalance_after,
        "before": stats.imbalance_before,
    }


def test_equivalence_inputs_are_rebalanced() -> None:
    with world(2) as pool:
        results = pool.run(_stats_worker, timeout=120)
    assert all(r["applied"] for r in results)
    assert results[0]["moved"] > 0
    assert results[0]["after"] < results[0]["before"]


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--steps", "0"),
        ("--batch-size", "-1"),
        ("--scale", "nan"),
        ("--scale", "0"),
        ("--steps", "x"),
        ("--seed", "-1"),  # Lightning's seed_everything raised once the models were built
        ("--seed", str(2**32)),
    ],
)
def test_demo_flags_out_of_range_are_usage_errors(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import demo

    with pytest.raises(SystemExit) as done:
        demo.parse_args([flag, value])
    assert done.value.code == 2 and f"argument {flag}: " in capsys.readouterr().err


def test_an_output_folder_that_is_a_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--output`` naming a file, or a folder under one, fails at once, not after training."""
    import demo

    taken = tmp_path / "taken"
    taken.write_text("")
    for value in (taken, taken / "logs"):
        with pytest.raises(SystemExit) as done:
            demo.parse_args(["--output", str(value)])
        assert done.value.code == 2 and f"'{taken}' is a file" in capsys.readouterr().err
    for value in (tmp_path, tmp_path / "new" / "logs"):  # folders, existing or to be made
        assert demo.parse_args(["--output", str(value)]).output == str(value)


def test_demo_short_run_matches_losses_and_writes_dashboard(tmp_path: Path) -> None:
    """``examples/demo.py --steps 2``: two real 2-rank fits, same losses, summary and PNG."""
    import demo

    summary = demo.main(
        ["--steps", "2", "--scale", "0.4", "--seed", "1", "--output", str(tmp_path), "--accelerator", "cpu"]
    )
    assert summary["loss_max_abs_diff"] <= demo.LOSS_TOLERANCE
    # Seed 1's first batches (in the order of Lightning's distributed sampler) are far from
    # balanced, so images move on both steps.
    assert summary["applied_steps"] == 2
    assert summary["imbalance_after"] < summary["imbalance_before"]
    assert summary["moved_bytes_total"] > 0
    assert (tmp_path / "vit_balance_dashboard.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "summary.json").read_text())["applied_steps"] == summary["applied_steps"]
    metrics = plot_vit_balance.load_metrics(tmp_path / "with_balancing")
    assert {"vit_balance/imbalance_before", "vit_balance/load_after/rank_1"} <= set(metrics)
    # Measured ViT time trails by one call, so the second step has every rank's figure.
    measured = {"vit_balance/vit_ms_max", "vit_balance/vit_ms/rank_0", "vit_balance/vit_ms/rank_1"}
    assert measured <= set(metrics)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_hf_example_module_trains_without_a_trainer(family: str) -> None:
    """Outside a Trainer the mixin calls the tower directly; the module's step trains end to end.

    The balanced path of the same towers is checked across ranks above, and the Lightning path by
    the demo run; ``python examples/hf_qwen_vit_balance.py`` does both with these towers.
    """
    pytest.importorskip("transformers")
    import hf_qwen_vit_balance

    model = hf_qwen_vit_balance.HFQwenVLM(family)
    dataset = SyntheticVLMDataset(2, patch_dim=hf_qwen_vit_balance.tower_patch_dim(), scale=0.3, seed=1)
    batch = collate_vlm([dataset[0], dataset[1]])
    model.log = lambda *args, **kwargs: None  # no Trainer to log to
    loss = model.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.visual.parameters() if p.requires_grad)
