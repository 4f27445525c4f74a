"""Shared pytest fixtures.

``multirank``: the factory of persistent multi-rank worker pools from ``multirank.py``::

    def test_x(multirank):
        with multirank(3) as w:
            results = w.run(some_module_level_function, arg)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
from multirank import World, close_all, world


@pytest.fixture(scope="session")
def multirank() -> Iterator[Callable[[int], AbstractContextManager[World]]]:
    """``multirank(n)`` is a context manager giving the persistent pool of ``n`` gloo ranks."""
    yield world
    close_all()
