"""An op's options object as the argument list of its ``torch.library`` custom operators.

Each op keeps everything about a call that is not a tensor in one frozen dataclass. Under ``torch.compile`` it
runs as custom operators, whose arguments must be plain schema types; this module derives that part of their
schema from the dataclass's fields (in declaration order), flattens an options object into values and builds it
back, so an op's option names are written once, in its dataclass.

A field's annotation (a string, under ``from __future__ import annotations``) must be one of those in
``_SCHEMA_TYPES``; a field that cannot cross the operator boundary (a process group, say) is declared with
``dataclasses.field(metadata={OPERATOR: False})``; inside the operator it holds its default.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

OPERATOR = "operator"  # metadata key: False keeps a field out of the operator's arguments

_SCHEMA_TYPES = {
    "bool": "bool",
    "int": "int",
    "float": "float",
    "str": "str",
    "int | None": "int?",
    "float | None": "float?",
    "str | None": "str?",
}


def _schema_type(annotation: Any, cls: type, name: str) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    if text in _SCHEMA_TYPES:
        return _SCHEMA_TYPES[text]
    if text.startswith("tuple[bool"):
        return "bool[]"
    raise TypeError(f"{cls.__name__}.{name}: annotation {text!r} has no custom-operator schema type")


class OptionsSchema:
    """The operator arguments of an options dataclass ``cls``: build one per op at import time (``dataclasses.fields``
    is not traced by ``torch.compile``; this object's methods are).

    ``fields``: (name, schema type) of each field the operators take, in declaration order. ``text``: the schema
    fragment, e.g. ``"int ignore_index, float? softcap"``.
    """

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.fields = tuple(
            (f.name, _schema_type(f.type, cls, f.name))
            for f in dataclasses.fields(cls)
            if f.metadata.get(OPERATOR, True)
        )
        self.names = tuple(name for name, _kind in self.fields)
        self.all_names = tuple(f.name for f in dataclasses.fields(cls))
        self.text = ", ".join(f"{kind} {name}" for name, kind in self.fields)

    def values(self, options: Any) -> tuple:
        """The operator's argument values for ``options`` (tuples as lists), in schema order."""
        return tuple(_as_argument(getattr(options, name)) for name in self.names)

    def build(self, values: tuple | list) -> Any:
        """The options object back from an operator's argument values (lists as tuples)."""
        return self.cls(**{name: _as_field(v) for name, v in zip(self.names, values, strict=True)})

    def replace(self, options: Any, **changes: Any) -> Any:
        """``dataclasses.replace`` in a form ``torch.compile`` traces (the field names known in advance); eager
        calls take :func:`replace_checked_fields`'s shortcut."""
        if not torch.compiler.is_compiling():
            return replace_checked_fields(options, **changes)
        return self.cls(**{name: changes.get(name, getattr(options, name)) for name in self.all_names})


def replace_checked_fields(options: Any, **changes: Any) -> Any:
    """A copy of a frozen options dataclass with ``changes`` set, for an op's own changes to options it has
    built and checked: the changed values are already of their fields' types (a bool, a checked int, a
    shard), so the copy skips ``__post_init__``'s checks, which cost the host tens of microseconds per call.
    Not under ``torch.compile`` (use :meth:`OptionsSchema.replace` there)."""
    new = copy.copy(options)
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new


def _as_argument(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _as_field(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
