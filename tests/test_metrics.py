"""BalanceMetrics: a window of balanced calls and the counts since the start, as vit_balance/* metrics."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from lightning_vit_balance import BalanceMetrics, BalanceStats, ViTBalanceConfig
from lightning_vit_balance.planning import REASONS


def _stats(applied: bool, before: tuple[float, ...], after: tuple[float, ...], **fields: Any) -> BalanceStats:
    values: dict[str, Any] = dict(
        applied=applied,
        reason="applied" if applied else "below-threshold",
        rank=0,
        num_ranks=len(before),
        loads_before=before,
        loads_after=after,
        imbalance_before=max(before) / (sum(before) / len(before)) - 1.0,
        imbalance_after=max(after) / (sum(after) / len(after)) - 1.0,
        num_images=4,
        moved_images=2 if applied else 0,
        moved_patches=30 if applied else 0,
        total_patches=100,
        bytes_sent=1000 if applied else 0,
        bytes_received=500 if applied else 0,
        plan_seconds=0.001,
        exchange_seconds=0.004,
        collectives=3 if applied else 1,
    )
    values.update(fields)
    return BalanceStats(**values)


# A call on a plan made before it: its planning counts in prepare_seconds.
APPLIED = _stats(
    True, (900.0, 100.0), (500.0, 500.0), vit_ms=(30.0, 10.0), plan_seconds=0.0, prepare_seconds=0.003
)
# The call after it reports its trips.
SKIPPED = _stats(False, (300.0, 200.0), (300.0, 200.0), vit_ms=(20.0, 16.0), trip_ms=2.5)


def test_a_window_averages_its_calls_and_sums_their_traffic() -> None:
    metrics = BalanceMetrics()
    assert metrics.metrics() == {} and metrics.window_calls == 0
    metrics.add(APPLIED)
    metrics.add(SKIPPED)
    got = metrics.metrics()
    assert got["vit_balance/calls"] == 2.0 and metrics.window_calls == 2
    assert got["vit_balance/applied"] == 0.5
    assert got["vit_balance/imbalance_before"] == pytest.approx((0.8 + 0.2) / 2)
    assert got["vit_balance/imbalance_after"] == pytest.approx((0.0 + 0.2) / 2)
    assert got["vit_balance/load_before/rank_0"] == 600.0 and got["vit_balance/load_after/rank_1"] == 350.0
    assert (got["vit_balance/moved_patches"], got["vit_balance/moved_patch_fraction"]) == (30.0, 0.15)
    assert (got["vit_balance/bytes_sent"], got["vit_balance/collectives"]) == (1000.0, 4.0)
    # A plan made before its call counts apart: planning in the calls, and before them.
    assert got["vit_balance/plan_ms"] == pytest.approx(1.0)
    assert got["vit_balance/prepare_ms"] == pytest.approx(3.0)
    assert got["vit_balance/exchange_ms"] == pytest.approx(8.0)
    # Trips: summed where a call reports some (the applied call's own come a call later: -1).
    assert got["vit_balance/trip_ms"] == 2.5
    # Measured: the slowest rank's ViT time per call, averaged (30 and 20), and the ranks' mean.
    assert got["vit_balance/vit_ms_max"] == 25.0 and got["vit_balance/vit_ms_mean"] == 19.0
    assert (got["vit_balance/vit_ms/rank_0"], got["vit_balance/vit_ms/rank_1"]) == (25.0, 13.0)
    assert (got["vit_balance/applied_total"], got["vit_balance/calls_total"]) == (1.0, 2.0)
    assert got["vit_balance/skipped/below-threshold"] == 1.0
    assert {f"vit_balance/skipped/{r}" for r in REASONS if r != "applied"} <= set(got)


def test_the_online_cost_fit_is_logged_only_where_a_call_fits_online() -> None:
    """``cost_fits`` is the latest call's count, ``cost_fit_error`` the mean over the calls whose
    error is known (none before the first fit); neither key without ``calibrate_cost``."""
    metrics = BalanceMetrics()
    metrics.add(APPLIED)
    assert not {"vit_balance/cost_fits", "vit_balance/cost_fit_error"} & set(metrics.metrics())
    metrics.add(dataclasses.replace(SKIPPED, cost_fits=0))  # fitting online, not fitted yet
    assert metrics.metrics()["vit_balance/cost_fits"] == 0.0
    assert "vit_balance/cost_fit_error" not in metrics.metrics()
    for fits, error in ((1, 0.25), (2, math.nan), (2, 0.05)):
        metrics.add(dataclasses.replace(SKIPPED, cost_fits=fits, cost_error=error))
    # A call that does not fit online (another balancer's, a teacher's), and one of a balancer
    # that has fitted less: the record tells the furthest fit.
    metrics.add(APPLIED)
    metrics.add(dataclasses.replace(SKIPPED, cost_fits=0))
    got = metrics.metrics()
    assert got["vit_balance/cost_fits"] == 2.0
    assert got["vit_balance/cost_fit_error"] == pytest.approx(0.15)
    saved = json.loads(json.dumps(metrics.state_dict()))
    resumed = BalanceMetrics()
    resumed.load_state_dict(saved)
    assert resumed.metrics() == got
    # A window saved before these figures were kept: none, and the rest as saved.
    for name in ("cost_fits", "cost_error_calls", "cost_error"):
        del saved["window"][name]
    resumed.load_state_dict(saved)
    assert {k: v for k, v in got.items() if "/cost_fit" not in k} == resumed.metrics()


def test_a_disabled_call_on_many_ranks_has_no_imbalance_to_average() -> None:
    """Balancing disabled on many ranks: nothing is gathered, so the imbalance is unknown (NaN).
    Such calls count, and move nothing, but stay out of the imbalance means; a window of them
    alone has no imbalance keys (a monitor of them says so) rather than a made-up 0 or a NaN."""
    disabled = BalanceStats.of_direct_call(
        ViTBalanceConfig(enabled=False), None, reason="disabled", num_ranks=4
    )
    assert math.isnan(disabled.imbalance_before) and math.isnan(disabled.imbalance_after)
    one_rank = BalanceStats.of_direct_call(ViTBalanceConfig(), None)
    assert (one_rank.imbalance_before, one_rank.imbalance_after) == (0.0, 0.0)
    got = _left_out_of_the_means(disabled, APPLIED)
    assert got["vit_balance/applied"] == 0.5
    assert got["vit_balance/imbalance_before"] == pytest.approx(0.8)  # the applied call's alone
    assert got["vit_balance/imbalance_after"] == pytest.approx(0.0)


def _left_out_of_the_means(left_out: BalanceStats, counted: BalanceStats) -> dict[str, float]:
    """The metrics of a window of ``left_out``, checked to count it with no imbalance key; then of
    that window with ``counted`` added."""
    metrics = BalanceMetrics()
    metrics.add(left_out)
    got = metrics.metrics()
    assert got["vit_balance/calls"] == 1.0 and got[f"vit_balance/skipped/{left_out.reason}"] == 1.0
    assert "vit_balance/imbalance_before" not in got and "vit_balance/imbalance_after" not in got
    metrics.add(counted)
    return metrics.metrics()


def test_a_call_without_images_stays_out_of_the_imbalance_means() -> None:
    """No rank had images (text-only steps): no load to balance. Its imbalance of 0 would pass for
    perfect balance (and win a monitor of ``imbalance_after`` in mode ``min``); it counts as a
    call and a skip, and stays out of the means."""
    no_load = {"loads_before": (0.0, 0.0), "loads_after": (0.0, 0.0), "num_images": 0, "total_patches": 0}
    text_only = _stats(False, (1.0, 1.0), (1.0, 1.0), reason="no-images", **no_load)
    assert (text_only.imbalance_before, text_only.imbalance_after) == (0.0, 0.0)
    got = _left_out_of_the_means(text_only, SKIPPED)
    assert got["vit_balance/imbalance_before"] == pytest.approx(0.2)  # the call with images alone
    assert got["vit_balance/imbalance_after"] == pytest.approx(0.2)


def test_a_new_window_keeps_the_counts() -> None:
    metrics = BalanceMetrics(per_rank_loads=False)
    metrics.add(APPLIED)
    metrics.reset_window()
    assert metrics.metrics() == {} and metrics.window_metrics() == {}
    assert metrics.total_metrics()["vit_balance/calls_total"] == 1.0
    # A call whose earlier call carried no time on some rank (-1) adds no ViT figures.
    metrics.add(_stats(False, (1.0, 1.0), (1.0, 1.0), vit_ms=(-1.0, 4.0)))
    got = metrics.metrics()
    assert got["vit_balance/calls"] == 1.0 and got["vit_balance/calls_total"] == 2.0
    assert not [k for k in got if "/rank_" in k or k.startswith("vit_balance/vit_ms")], got


def test_counts_and_the_window_resume_from_a_checkpoint_through_json() -> None:
    """A checkpoint between two logged records keeps the window's calls too: the resumed run's next
    record is the uninterrupted run's (it held only the calls after the checkpoint, while the
    counts since the start held those before it as well)."""
    metrics = BalanceMetrics()
    for stats in (APPLIED, SKIPPED):
        metrics.add(stats)
    metrics.reset_window()  # a record was logged
    metrics.add(APPLIED)  # then a call, then the checkpoint
    saved = json.loads(json.dumps(metrics.state_dict()))
    resumed = BalanceMetrics()
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == metrics.state_dict()
    for run in (metrics, resumed):
        run.add(SKIPPED)
    assert resumed.metrics() == metrics.metrics() and resumed.metrics()["vit_balance/calls"] == 2.0
    totals = resumed.total_metrics()
    assert (totals["vit_balance/applied_total"], totals["vit_balance/calls_total"]) == (2.0, 4.0)
    assert totals["vit_balance/skipped/below-threshold"] == 2.0
    # A window of a version that sums another figure, and lacks one of these: read as far as it goes.
    other = json.loads(json.dumps(saved))
    other["window"]["totals"] = {**other["window"]["totals"], "future_ms": 5.0}
    del other["window"]["totals"]["prepare_ms"]
    resumed.load_state_dict(other)
    assert resumed.window_calls == 1 and "future_ms" not in resumed.metrics()
    # A checkpoint saved before windows were kept: the counts, and an empty window.
    older = BalanceMetrics()
    older.load_state_dict({k: v for k, v in saved.items() if k != "window"})
    assert (older.calls_total, older.window_calls, older.metrics()) == (3, 0, {})


@pytest.mark.parametrize("per_rank_loads", [None, False])
def test_a_restored_window_keeps_no_per_rank_series_the_resumed_run_does_not_log(
    per_rank_loads: bool | None,
) -> None:
    """A window saved on 2 ranks with per-rank series, resumed on 128 ranks (beyond
    PER_RANK_SERIES_UP_TO, ``None``) or with them turned off: its first record logged the saved
    series, under this run's rank numbers."""
    saved = BalanceMetrics()
    saved.add(APPLIED)
    resumed = BalanceMetrics(per_rank_loads)
    resumed.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    ranks = 128 if per_rank_loads is None else 2
    loads = tuple(float(r + 1) for r in range(ranks))
    resumed.add(_stats(True, loads, loads, vit_ms=(10.0,) * ranks))
    got = resumed.metrics()
    # The saved call's ViT figures count where the DP size is the same (APPLIED's slowest: 30 ms).
    assert got["vit_balance/calls"] == 2.0 and got["vit_balance/vit_ms_max"] == (
        10.0 if ranks > 2 else 20.0
    ), got
    assert not [key for key in got if "/rank_" in key], got


def test_a_restored_window_of_another_dp_size_starts_new_per_rank_series() -> None:
    """Saved on 2 ranks, resumed on 4 with per-rank series: each rank's series is the new call's,
    not an average of the two sizes' loads under the same rank numbers (rank 0's 6.0 of 4 and 8)."""
    saved = BalanceMetrics()
    saved.add(_stats(True, (4.0, 2.0), (3.0, 3.0)))
    resumed = BalanceMetrics(True)
    resumed.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    resumed.add(_stats(True, (8.0, 1.0, 1.0, 2.0), (3.0, 3.0, 3.0, 3.0)))
    got = resumed.metrics()
    before = {key: value for key, value in got.items() if "load_before/rank_" in key}
    assert before == {f"vit_balance/load_before/rank_{r}": v for r, v in enumerate((8.0, 1.0, 1.0, 2.0))}, got


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"applied_total": 1, "calls_total": 2},
        {"applied_total": -1, "calls_total": 2, "skipped_total": {}},
        {"applied_total": 1, "calls_total": 2, "skipped_total": {}, "window": {"calls": 1}},
        # A window of no field at all is not one state_dict gives (None alone means "none saved").
        {"applied_total": 1, "calls_total": 2, "skipped_total": {}, "window": {}},
        # JSON's true is no count (int(True) == 1 would have passed for one).
        {"applied_total": True, "calls_total": 2, "skipped_total": {}},
    ],
)
def test_counts_of_another_shape_are_refused(state: dict[str, Any]) -> None:
    metrics = BalanceMetrics()
    metrics.add(APPLIED)
    with pytest.raises(ValueError, match=r"BalanceMetrics.load_state_dict\(state_dict=.*\) is invalid"):
        metrics.load_state_dict(state)
    assert metrics.total_metrics()["vit_balance/calls_total"] == 1.0  # unchanged


def _ranks_stats(num_ranks: int, slow: int) -> BalanceStats:
    """A call on ``num_ranks`` ranks where rank ``slow`` took 50 ms and every other 10 ms."""
    loads = tuple(float(r + 1) for r in range(num_ranks))
    vit_ms = tuple(50.0 if r == slow else 10.0 for r in range(num_ranks))
    return _stats(False, loads, loads, vit_ms=vit_ms)


def test_the_slowest_rank_is_named_at_any_dp_size() -> None:
    metrics = BalanceMetrics()
    metrics.add(APPLIED)  # rank 0: 30 ms, rank 1: 10 ms
    metrics.add(SKIPPED)  # rank 0: 20 ms, rank 1: 16 ms
    assert metrics.metrics()["vit_balance/vit_ms_slowest_rank"] == 0.0
    # Over a window, the rank whose calls took longest in all (here rank 1: 10 + 50 against 30 + 10).
    metrics.reset_window()
    metrics.add(_stats(False, (1.0, 1.0), (1.0, 1.0), vit_ms=(30.0, 10.0)))
    metrics.add(_stats(False, (1.0, 1.0), (1.0, 1.0), vit_ms=(10.0, 50.0)))
    assert metrics.metrics()["vit_balance/vit_ms_slowest_rank"] == 1.0
    metrics.reset_window()
    metrics.add(_stats(False, (1.0, 1.0), (1.0, 1.0), vit_ms=(7.0, 7.0)))  # a tie: the lowest rank
    assert metrics.metrics()["vit_balance/vit_ms_slowest_rank"] == 0.0
    large = BalanceMetrics()
    large.add(_ranks_stats(512, slow=317))
    assert large.metrics()["vit_balance/vit_ms_slowest_rank"] == 317.0


@pytest.mark.parametrize(
    ("per_rank_loads", "num_ranks", "series"),
    [(None, 64, True), (None, 65, False), (True, 65, True), (False, 2, False)],
)
def test_per_rank_series_by_default_up_to_64_ranks(
    per_rank_loads: bool | None, num_ranks: int, series: bool
) -> None:
    """Three series per rank up to 64 ranks by default (192 keys), none beyond; the summaries at
    every size; an explicit choice wins."""
    metrics = BalanceMetrics(per_rank_loads)
    metrics.add(_ranks_stats(num_ranks, slow=num_ranks - 1))
    got = metrics.metrics()
    per_rank = [key for key in got if "/rank_" in key]
    assert len(per_rank) == (3 * num_ranks if series else 0)
    assert got["vit_balance/vit_ms_max"] == 50.0 and got["vit_balance/vit_ms_slowest_rank"] == num_ranks - 1
    assert got["vit_balance/imbalance_before"] > 0


def test_a_missing_stats_is_named() -> None:
    """A balancer's ``last_stats`` before its first call is None, which ``add`` read as stats."""
    with pytest.raises(
        TypeError, match=r"BalanceMetrics.add\(stats=None\) is invalid: expected a BalanceStats"
    ):
        BalanceMetrics().add(None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"BalanceMetrics.add\(stats=3\) is invalid: expected a BalanceStats\.$"
    ):
        BalanceMetrics().add(3)  # type: ignore[arg-type]


def test_a_window_that_add_could_not_have_summed_is_refused() -> None:
    """A corrupted window was taken, then the first log divided by zero or took a max of nothing."""
    metrics = BalanceMetrics()
    metrics.add(APPLIED)
    good = metrics.state_dict()
    for change in (
        {"load_calls": 0},  # sums of loads over no call
        {"vit_calls": 3, "vit_per_rank": []},
        {"calls": 0},
        {"vit_calls": 0},  # per-rank ViT sums of no call: the next call would add to them
        {"loads": {"before": [1.0, 2.0], "after": [1.0]}},
        {"cost_error_calls": 2},  # errors of more calls than the window's
        {"cost_fits": -2},
        {"cost_error": math.nan},
        {"cost_error": -0.1},
    ):
        broken = {**good, "window": {**good["window"], **change}}
        with pytest.raises(ValueError, match=r"BalanceMetrics.load_state_dict\(state_dict=.* is invalid"):
            BalanceMetrics().load_state_dict(broken)
    restored = BalanceMetrics()
    restored.load_state_dict(good)
    assert restored.metrics() == metrics.metrics()


def test_a_rank_measured_at_zero_milliseconds_is_a_measurement() -> None:
    """A rank whose ViT took under a microsecond (nothing to encode) reports 0 ms: a time, not the
    -1 of a rank without one; the call's ViT figures count it rather than being dropped whole."""
    metrics = BalanceMetrics()
    metrics.add(_stats(False, (1.0, 1.0), (1.0, 1.0), vit_ms=(12.0, 0.0)))
    got = metrics.metrics()
    assert (got["vit_balance/vit_ms_max"], got["vit_balance/vit_ms_mean"]) == (12.0, 6.0), got
    assert (got["vit_balance/vit_ms/rank_0"], got["vit_balance/vit_ms/rank_1"]) == (12.0, 0.0)


def test_an_infinite_cost_fit_error_is_left_out_and_the_window_still_resumes() -> None:
    """A fit's error against a measured 0 ms is infinite: counted, it made ``cost_fit_error`` inf
    and the window's checkpoint one ``load_state_dict`` refuses (a non-finite error sum)."""
    metrics = BalanceMetrics()
    for error in (math.inf, 0.1):
        metrics.add(dataclasses.replace(SKIPPED, cost_fits=1, cost_error=error))
    assert metrics.metrics()["vit_balance/cost_fit_error"] == pytest.approx(0.1)
    resumed = BalanceMetrics()
    resumed.load_state_dict(json.loads(json.dumps(metrics.state_dict())))
    assert resumed.metrics() == metrics.metrics()


def test_a_window_of_calls_without_patches_moved_none_of_them() -> None:
    """Text-only calls alone (no patch anywhere): the moved fraction is 0, not a division by zero
    or a made-up 1."""
    no_load = {"loads_before": (0.0, 0.0), "loads_after": (0.0, 0.0), "num_images": 0, "total_patches": 0}
    metrics = BalanceMetrics()
    metrics.add(_stats(False, (1.0, 1.0), (1.0, 1.0), reason="no-images", **no_load))
    assert metrics.metrics()["vit_balance/moved_patch_fraction"] == 0.0


@pytest.mark.parametrize("unknown", ["imbalance_before", "imbalance_after"])
def test_a_call_with_either_imbalance_unknown_stays_out_of_both_means(unknown: str) -> None:
    """One NaN side is as unknown as two: averaged in, it made the window's mean NaN."""
    metrics = BalanceMetrics()
    metrics.add(dataclasses.replace(SKIPPED, **{unknown: math.nan}))
    metrics.add(APPLIED)
    got = metrics.metrics()
    assert got["vit_balance/imbalance_before"] == pytest.approx(0.8), got
    assert got["vit_balance/imbalance_after"] == pytest.approx(0.0), got


def test_counts_loaded_into_a_used_instance_replace_its_own() -> None:
    """``load_state_dict`` replaces every count: a reason the state does not hold (saved by a
    version without it) starts at 0, not at the count the instance had before loading."""
    metrics = BalanceMetrics()
    metrics.add(dataclasses.replace(SKIPPED, reason="no-gain"))
    metrics.load_state_dict({"applied_total": 1, "calls_total": 1, "skipped_total": {}})
    assert metrics.total_metrics()["vit_balance/skipped/no-gain"] == 0.0
    assert metrics.calls_total == 1
