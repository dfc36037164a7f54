"""A TRL module-level function answered by lce_patch for the trainers it serves, and by TRL for every other call
(TRL's ``DistillationTrainer`` and ``AsyncDistillationTrainer``).

Some TRL trainers compute their loss by calling a function of their module (``_chunked_divergence_loss``,
``_chunked_jsd_loss``), looked up as a global when their method runs. :class:`FunctionRedirect` replaces that
global, once, by a dispatcher: while a served trainer's method runs in a thread (its method is wrapped to set
thread-local options), the dispatcher calls lce_patch's stand-in with those options; every other call (other
trainers, other threads) goes to TRL's own function. The dispatcher is removed with the last served trainer, so
a process with no served trainer has TRL's module as it was.
"""

from __future__ import annotations

import functools
import importlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..serving import SERVED

__all__ = ["FunctionRedirect"]


class FunctionRedirect:
    """``module_name.function_name`` answered by ``fused(*args, options=..., **kwargs)`` for served trainers.

    The served methods and the dispatcher carry the marker :data:`~lce_patch.integrations.serving.SERVED`, whose
    value is what they stand in for (the dispatcher's: TRL's function).
    """

    def __init__(self, module_name: str, function_name: str, fused: Callable[..., Any]) -> None:
        self.module_name = module_name
        self.function_name = function_name
        self.fused = fused
        self._state = threading.local()  # .options: the options of the served call running in this thread
        self._lock = threading.Lock()
        self._served: weakref.WeakSet = weakref.WeakSet()  # the trainers served now

    def original(self) -> Any:
        """TRL's own function (None where the module has none); an ``ImportError`` if the module is missing."""
        current = getattr(importlib.import_module(self.module_name), self.function_name, None)
        return getattr(current, SERVED, current)

    def is_served(self, method: Any) -> bool:
        """Whether ``method`` (a trainer's method) is one that :meth:`serve` put in place."""
        return getattr(method, SERVED, None) is not None

    def serve(self, trainer: Any, method_name: str, options: dict[str, Any]) -> None:
        """Wrap ``trainer``'s ``method_name`` (on the instance) so that its calls of the function are answered by
        the stand-in with ``options``, and install the dispatcher if it is not installed."""
        method = getattr(trainer, method_name)

        @functools.wraps(method)
        def served(*args: Any, **kwargs: Any) -> Any:
            previous = getattr(self._state, "options", None)
            self._state.options = options
            try:
                return method(*args, **kwargs)
            finally:
                self._state.options = previous

        setattr(served, SERVED, method)
        with self._lock:
            module = importlib.import_module(self.module_name)
            current = getattr(module, self.function_name)
            if not hasattr(current, SERVED):
                setattr(module, self.function_name, self._dispatcher(current))
            self._served.add(trainer)
        setattr(trainer, method_name, served)

    def unserve(self, trainer: Any, method_name: str) -> bool:
        """Undo :meth:`serve` on ``trainer``; returns whether it was served. The dispatcher goes with the last."""
        if not self.is_served(vars(trainer).get(method_name)):
            return False
        delattr(trainer, method_name)
        with self._lock:
            self._served.discard(trainer)
            module = importlib.import_module(self.module_name)
            current = getattr(module, self.function_name)
            if not self._served and hasattr(current, SERVED):
                setattr(module, self.function_name, getattr(current, SERVED))
        return True

    def _dispatcher(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            options = getattr(self._state, "options", None)
            if options is None:
                return original(*args, **kwargs)
            return self.fused(*args, **kwargs, options=options)

        setattr(dispatch, SERVED, original)
        return dispatch
