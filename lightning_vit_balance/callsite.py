"""Where the package's warnings point: the user's line, not the package's or a library's.

A warning raised deep in a balanced call (or in a Trainer's hook that reached the package) is read
where ``warnings`` shows it: a fixed ``stacklevel`` lands inside this package, or inside torch,
transformers or Lightning, whenever the path from the user's code has another depth (a decorator,
activation checkpointing, a hook). :func:`warn_at_user` counts the frames instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from types import FrameType

__all__ = ["warn_at_user", "warn_on_rank_zero"]

#: Libraries whose frames lie between the user's code and the package's: read from ``sys.modules``
#: only, so nothing is imported for a warning.
_LIBRARIES = (
    "torch",
    "transformers",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "accelerate",
    "deepspeed",
    "peft",
    "trl",
)


def _library_prefixes() -> tuple[str, ...]:
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    prefixes = [package, os.path.abspath(contextlib.__file__)]
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        location = getattr(module, "__file__", None)
        if location:
            prefixes.append(os.path.dirname(os.path.abspath(location)) + os.sep)
    return tuple(prefixes)


def _user_stacklevel(frame: FrameType) -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called in ``frame`` (level 1), name the first
    frame outside this package and the libraries around it.

    Returns:
        The level of that frame, or of the outermost frame when every frame is inside (a thread of
        the package's own).
    """
    inside = _library_prefixes()
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


#: Where launchers put a process's rank before its process group exists, read in Lightning's
#: order (``rank_zero_only``): torchrun's, then Lightning's own launcher's, SLURM's and LSF's.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def _global_rank() -> int:
    """This process's rank in the default process group; before one exists, the launcher's (see
    :data:`_RANK_VARIABLES`; 0 without one). Read from ``sys.modules``: nothing is imported for a
    warning."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def warn_at_user(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` at the user's line (see :func:`_user_stacklevel`): level
    1 is the caller's frame, one below this function's."""
    warnings.warn(message, category, stacklevel=_user_stacklevel(sys._getframe(1)) + 1)


def warn_on_rank_zero(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """:func:`warn_at_user` on global rank 0 alone (see :func:`_global_rank`), for a warning every
    rank decides alike (a configuration, a model's structure): 512 ranks print one line, not 512."""
    if _global_rank() == 0:
        warn_at_user(message, category)
