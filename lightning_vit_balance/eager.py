"""Where ``torch.compile`` stops: the balancing's own code runs eagerly inside a compiled model.

A model compiled as a whole (``torch.compile(model)``, the Hugging Face ``Trainer``'s
``torch_compile=True``, a compiled ``LightningModule``) has TorchDynamo trace every Python frame
its forward calls, the drop-in's and the engine's included. That code gathers over the host
group, plans in Python and numpy, and keeps state between the calls of one forward (the pending
balanced result the tower calls are answered from). Traced, it breaks the graph at every
collective, guards on that state, and rebuilds the drop-in's calls from their bytecode: the
patched tower's original ``forward`` came back as the patched one, which then called itself until
Python's recursion limit. Marked with these decorators, it runs as it is, one graph break at each
boundary, while the model's own forwards it calls are compiled with the model.

TorchDynamo is imported at the first call of a decorated function, not when this module is:
importing it costs about a second, and a program that never compiles may not have paid it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["eager", "eager_frame"]

_Function = TypeVar("_Function", bound=Callable[..., Any])


def _disabled(fn: _Function, recursive: bool) -> _Function:
    lazy = getattr(torch, "_disable_dynamo", None)
    if lazy is None:  # a torch without the lazy form: import TorchDynamo now
        return cast(_Function, torch.compiler.disable(fn, recursive=recursive))
    return cast(_Function, lazy(fn, recursive=recursive))


def eager(fn: _Function) -> _Function:
    """``fn``, and everything it calls, run outside ``torch.compile``.

    Modules compiled on their own stay compiled when ``fn`` calls them (a tower whose blocks were
    given ``block.compile()``).
    """
    return _disabled(fn, recursive=True)


def eager_frame(fn: _Function) -> _Function:
    """``fn``'s own frame runs outside ``torch.compile``; what it calls is compiled as usual.

    For a patched ``forward``: the decision which forward to run is the drop-in's, the forward it
    runs is the model's own, compiled when the model is.
    """
    return _disabled(fn, recursive=False)
