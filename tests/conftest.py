"""Shared pytest fixtures.

``multirank``: the factory of persistent multi-rank worker pools from ``multirank.py``::

    def test_x(multirank):
        with multirank(3) as w:
            results = w.run(some_module_level_function, arg)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from multirank import World, close_all, world

#: Lightning's launchers keep the rendezvous address and port they chose in this process's
#: environment, so the first fit's port would serve every later fit of the session (and every
#: script those start) and fail them all once any socket, say a worker pool's, holds it. Each
#: test leaves them as the session found them.
_RENDEZVOUS = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}


@pytest.fixture(autouse=True)
def _fresh_rendezvous_port() -> Iterator[None]:
    yield
    for name, value in _RENDEZVOUS.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def multirank() -> Iterator[Callable[[int], AbstractContextManager[World]]]:
    """``multirank(n)`` is a context manager giving the persistent pool of ``n`` gloo ranks."""
    yield world
    close_all()


@pytest.fixture
def one_rank_world(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo default group in this process (file-store rendezvous, no ports)."""
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=20))
    try:
        yield
    finally:
        dist.destroy_process_group()
