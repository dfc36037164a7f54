"""A count of the fused ops' calls in this process, by op name: what the Trainer callback's line and the
launcher's report read to say whether a fused op really ran, rather than whether it was set up to run.

Counted where each op's public function starts, once per call (a call's backward is not a second call). Under
``torch.compile`` the count is one of the compiled frame's side effects, replayed on every run of the graph.
A plain dict: reading it costs nothing, and nothing here touches a device.
"""

from __future__ import annotations

_CALLS: dict[str, int] = {}


def count_call(op_name: str) -> None:
    """Add one call of ``op_name`` (e.g. ``"fused_linear_cross_entropy"``)."""
    _CALLS[op_name] = _CALLS.get(op_name, 0) + 1


def op_calls() -> dict[str, int]:
    """The calls of each fused op in this process so far, by op name (a copy)."""
    return dict(_CALLS)


def calls_since(before: dict[str, int]) -> dict[str, int]:
    """The calls of each op since ``before`` (an earlier :func:`op_calls`), the ops not called left out."""
    now = op_calls()
    return {name: count - before.get(name, 0) for name, count in now.items() if count > before.get(name, 0)}
