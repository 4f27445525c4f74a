"""One helper shared by the value classes: a cached attribute without a lock.

Python 3.11's :class:`functools.cached_property` takes a lock on every first access (removed in
3.12). A plan for a few ranks reads a dozen such attributes once each, so the locks alone were a
tenth of its time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["cached_value"]

_Value = TypeVar("_Value")


class cached_value(Generic[_Value]):
    """Like :class:`functools.cached_property`: computed on first access, then an instance attribute.

    It is a non-data descriptor, so the value stored in the instance's ``__dict__`` shadows it on
    later reads, at the cost of a plain attribute. Writes go to ``__dict__`` directly, so it also
    works on frozen dataclasses. Not thread-safe in the sense that two threads may both compute
    the value; both compute the same value, as every use here is a pure function of the instance.
    """

    def __init__(self, compute: Callable[[Any], _Value]) -> None:
        self._compute = compute
        self._name = compute.__name__
        self.__doc__ = compute.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self._name] = self._compute(instance)
        return value
