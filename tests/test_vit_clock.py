"""ViTClock and TripClock: a rank's ViT and trip times, a host timer on CPU, CUDA events read later.

No GPU here: the CUDA path runs against stand-in events that behave as CUDA's do (``query`` tells
whether an event has completed without waiting; ``elapsed_time`` needs both completed) and fail the
test on anything that would make the host wait for the device.
"""

from __future__ import annotations

import time
from typing import ClassVar

import pytest
import torch

from lightning_vit_balance.encoding import TripClock, ViTClock


class _Event:
    """A CUDA event stand-in: ``done`` says whether the device has reached it."""

    created: ClassVar[list[_Event]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "a timing event needs enable_timing=True"
        self.recorded_at: float | None = None
        self.done = True
        _Event.created.append(self)

    def record(self) -> None:
        self.recorded_at = time.perf_counter()

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _Event) -> float:
        assert self.done and end.done, "elapsed_time on an event still running would wait for the device"
        assert self.recorded_at is not None and end.recorded_at is not None
        return 1000.0 * (end.recorded_at - self.recorded_at)

    def synchronize(self) -> None:
        raise AssertionError("the clock must never wait for the device")


@pytest.fixture
def cuda_events(monkeypatch: pytest.MonkeyPatch) -> list[_Event]:
    _Event.created = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: pytest.fail("the clock synchronised"))
    return _Event.created


def test_cpu_forward_is_timed_on_the_host() -> None:
    clock = ViTClock()
    assert clock.read() == -1  # nothing timed yet
    clock.start(torch.device("cpu"))
    time.sleep(0.002)
    clock.stop()
    first = clock.read()
    assert 2_000 <= first < 2_000_000
    assert clock.read() == first  # read again: the same figure until the next forward


def test_cuda_forward_is_read_at_the_next_call_without_waiting(cuda_events: list[_Event]) -> None:
    clock = ViTClock()
    clock.start(torch.device("cuda"))
    time.sleep(0.003)
    clock.stop()
    assert len(cuda_events) == 2  # one event before the forward, one after
    begin, end = cuda_events
    assert begin.recorded_at is not None and end.recorded_at is not None
    assert 3_000 <= clock.read() < 3_000_000  # the next call's gather reads it
    assert clock.read() == clock.last_us  # the pair is consumed once


def test_cuda_forward_still_running_is_dropped_not_waited_for(cuda_events: list[_Event]) -> None:
    clock = ViTClock()
    clock.start(torch.device("cuda"))
    clock.stop()
    cuda_events[1].done = False  # the device has not reached the end of the forward yet
    assert clock.read() == -1  # unknown, rather than a wait or a figure from another call
    cuda_events[1].done = True
    assert clock.read() == -1  # that pair is gone: it is not paired with a later call


def test_cuda_forward_that_raised_reports_unknown(cuda_events: list[_Event]) -> None:
    # The ViT raised between start and stop (the balanced call then fails on every rank): the
    # next call must not read a half-recorded pair.
    clock = ViTClock()
    clock.start(torch.device("cuda"))
    assert clock.read() == -1
    clock.start(torch.device("cuda"))
    clock.stop()
    assert clock.read() >= 0


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_forgotten_figure_reads_unknown(cuda_events: list[_Event], device: str) -> None:
    """A failed call, or a plan for other images since, leaves no figure to pair with them."""
    clock = ViTClock()
    clock.start(torch.device(device))
    clock.stop()
    clock.forget()
    assert clock.read() == -1


def test_cpu_trips_are_summed_and_reported_once_by_the_next_call() -> None:
    trips = TripClock()
    for _ in range(2):  # the pixel trip and the return trip
        trips.start(torch.device("cpu"))
        time.sleep(0.002)
        trips.stop()
    assert trips.end_call() == -1.0  # nothing due before the first call
    trips.start(torch.device("cpu"))  # the backward pass's trip, after the call ended
    time.sleep(0.002)
    trips.stop()
    # The next call (which moves nothing) reports the first call's trips, not the backward's yet.
    assert 4.0 <= trips.end_call() < 4_000.0
    assert 2.0 <= trips.end_call() < 2_000.0  # then the backward's, once
    assert trips.end_call() == -1.0  # nothing since


def test_cuda_trips_are_read_a_call_later_without_waiting(cuda_events: list[_Event]) -> None:
    trips = TripClock()
    for _ in range(2):
        trips.start(torch.device("cuda"))
        time.sleep(0.002)
        trips.stop()
    assert len(cuda_events) == 4  # a pair per trip, read later
    assert trips.end_call() == -1.0
    cuda_events[3].done = False  # the return trip still runs on the device
    assert trips.end_call() == -1.0  # unknown, not waited for
    trips.start(torch.device("cuda"))
    time.sleep(0.003)
    trips.stop()
    assert trips.end_call() == -1.0
    assert 3.0 <= trips.end_call() < 3_000.0  # that call's one bracket alone


def test_a_trip_that_raised_is_dropped(cuda_events: list[_Event]) -> None:
    # The trip raised between start and stop (its call then fails on every rank): the bracket
    # left open is dropped, the next ones count.
    trips = TripClock()
    trips.start(torch.device("cuda"))
    trips.start(torch.device("cuda"))
    trips.stop()
    assert trips.end_call() == -1.0
    assert trips.end_call() >= 0.0
    assert len(cuda_events) == 3
