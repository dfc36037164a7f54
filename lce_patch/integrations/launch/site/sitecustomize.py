"""Put first on ``PYTHONPATH`` by ``lce-patch run``, so that every Python process the launched command starts (the
command itself, torchrun's workers, ``accelerate launch``'s, a front end's own launcher's) runs it at startup.

It imports nothing heavy: it only watches for ``transformers.trainer`` to be imported and then wraps
``Trainer.__init__`` so that the first Trainer built imports ``lce_patch.integrations.launch``, which gives every
Trainer of the process ``FusedLCECallback`` (see there). A process that never imports transformers' Trainer is not
touched. Then the ``sitecustomize`` this one shadows, if any, runs as it would have.
"""

import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TRAINER_MODULE = "transformers.trainer"


def _switch_on(module):
    """Wrap ``module.Trainer.__init__``: the first call hands over to lce_patch (imported then, not at startup)."""
    trainer_class = getattr(module, "Trainer", None)
    if trainer_class is None or getattr(trainer_class.__init__, "__lce_patch_launcher__", False):
        return
    original = trainer_class.__init__

    def __init__(self, *args, **kwargs):
        try:
            from lce_patch.integrations.launch import install
        except Exception as err:  # an interpreter that cannot import lce_patch trains as it would have, loudly
            trainer_class.__init__ = original
            sys.stderr.write(
                f"lce_patch: lce-patch run could not import lce_patch in {sys.executable} ({err!r}): this process "
                "trains without the fused loss. Install lce_patch in that environment.\n"
            )
            return original(self, *args, **kwargs)
        install(trainer_class, original)
        return trainer_class.__init__(self, *args, **kwargs)

    __init__.__lce_patch_launcher__ = True
    __init__.__wrapped__ = original
    trainer_class.__init__ = __init__


class _TrainerWatch(importlib.abc.MetaPathFinder):
    """Finds ``transformers.trainer`` as the other finders would, and runs :func:`_switch_on` once it is loaded."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRAINER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_switch_on(module):
            exec_module(module)
            _switch_on(module)

        loader.exec_module = exec_and_switch_on
        sys.meta_path.remove(self)  # once: the module is loaded now
        return spec


def _start():
    if _TRAINER_MODULE in sys.modules:  # imported before site ran (unusual): wrap it now
        _switch_on(sys.modules[_TRAINER_MODULE])
    else:
        sys.meta_path.insert(0, _TrainerWatch())
    home = os.environ.get("LCE_PATCH_HOME")
    if home and importlib.util.find_spec("lce_patch") is None:
        sys.path.append(home)  # lce_patch installed beside the launcher, not in this environment: found last


def _run_shadowed_sitecustomize():
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_start()
_run_shadowed_sitecustomize()
