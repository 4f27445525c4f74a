"""Shared pytest fixtures.

``multirank``: the factory of persistent multi-rank worker pools from ``multirank.py``::

    def test_x(multirank):
        with multirank(3) as w:
            results = w.run(some_module_level_function, arg)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from multirank import World, close_all, world


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
