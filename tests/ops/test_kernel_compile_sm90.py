"""Every kernel variant the op launches compiles for the H100 (sm_90), checked on a machine without a GPU.

The CPU interpreter runs the kernels' Python, not Triton's compiler, which rejects things the
interpreter accepts (a helper returning different shapes from constexpr branches, say). Here the
op runs under the interpreter with each launch recorded, and every distinct variant is then compiled
for sm_90 down to a cubin with the same argument types, specializations and num_warps (in a
subprocess: under the interpreter the kernels are not compilable objects).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from lce_patch import fused_linear_cross_entropy, fused_linear_log_probs
from lce_patch.ops.core import backend, labels
from lce_patch.ops.linear_cross_entropy import launchers, rows

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # compiles every kernel variant in a subprocess
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("records launches under the CPU interpreter", allow_module_level=True)

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int8: "*i8",
}


class _Recorder:
    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.kernel, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


class _RecordingKernels:
    def __init__(self, module, launches):
        self.module, self.launches = module, launches

    def __getattr__(self, name):
        value = getattr(self.module, name)
        return _Recorder(value, self.launches) if hasattr(value, "fn") else value


def _variant(kernel, args, kwargs):
    """(signature, constexprs, num_warps) of one launch, specialized as Triton's launcher would."""
    names = list(inspect.signature(kernel.fn).parameters)
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    signature, constexprs = {}, {}
    for index, name in enumerate(names):
        value = bound[name]
        annotation = kernel.fn.__annotations__.get(name)
        if isinstance(value, torch.Tensor):
            signature[name] = _POINTER_TYPES[value.dtype]
        elif annotation is not None and "constexpr" in str(annotation) or isinstance(value, bool):
            signature[name], constexprs[(index,)] = "constexpr", value
        elif isinstance(value, int) and value == 1:  # Triton specializes integers equal to 1
            signature[name], constexprs[(index,)] = "constexpr", 1
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
        else:
            signature[name] = "fp32"
    return signature, constexprs, kwargs.get("num_warps", 4)


def _run_ops():
    """bf16 calls of every kind the kernels are launched for (on the GPU the buffers are bf16 too)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(80, 16, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(200, 16, generator=generator).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 200, (80,), generator=generator)
    labels[::5] = -100
    for options in ({}, {"softcap": 30.0}, {"softcap": 100.0, "label_smoothing": 0.1, "z_loss": 1e-4}):
        fused_linear_cross_entropy(hidden, weight, labels, backend="triton", chunk_size=64, **options).backward()
        fused_linear_cross_entropy(
            hidden, weight, labels, backend="triton", reduction="none", **options
        ).sum().backward()
        with torch.no_grad():
            fused_linear_cross_entropy(hidden, weight, labels, backend="triton", **options)
        bias = torch.randn(200, generator=generator).to(torch.bfloat16).requires_grad_()
        num_valid = int((labels != -100).sum())  # the row selection, and a third gradient (scaled on its own)
        fused_linear_cross_entropy(
            hidden, weight, labels, bias=bias, backend="triton", num_valid_tokens=num_valid, **options
        ).backward()
        if options.get("softcap") == 30.0:  # a frozen W: the one-pass softcapped gradient
            fused_linear_cross_entropy(hidden, weight.detach(), labels, backend="triton", **options).backward()
        out = fused_linear_log_probs(
            hidden, weight, labels, backend="triton", return_entropy=True, return_is_top1=True, skip_ignored=True,
            precompute_grad=True, softcap=options.get("softcap"), return_mean_logits=True,
            return_log_sum_sq_probs=True,
        )  # fmt: skip
        (out.log_probs.sum() + out.entropy.sum()).backward()
        # a causal LM's call: labels shifted inside the label launch, num_items_in_batch as a tensor
        fused_linear_cross_entropy(
            hidden.view(8, 10, 16), weight, labels.view(8, 10), backend="triton", shift=True,
            num_items_in_batch=torch.tensor(50), num_valid_tokens=int((labels.view(8, 10)[:, 1:] != -100).sum()),
            **options,
        ).backward()  # fmt: skip


def _run_shard_steps(launches):
    """A vocabulary shard's row pass (vocab_parallel.py) without a process group: the statistics kernel writing
    the exchanged block (with and without smoothing) and the merge of every rank's blocks."""
    from lce_patch.ops.core.transform import LogitTransform
    from lce_patch.ops.linear_cross_entropy import vocab_parallel_kernels

    generator = torch.Generator().manual_seed(1)
    raw = torch.randn(24, 50, generator=generator).to(torch.bfloat16)
    ids = torch.randint(-1, 50, (24,), generator=generator)
    target_raw = torch.randn(24, generator=generator)
    for smoothing in (False, True):
        block = torch.empty(4, 24)
        out = rows.RowOutputs(loss=block[1], lse=block[0], mean_logit=block[3] if smoothing else None)
        rows.chunk_stats(raw, ids, LogitTransform(softcap=30.0), out, None, True, target_raw, shard_target=block[2])
        loss, lse = torch.empty(24), torch.empty(24)
        _Recorder(vocab_parallel_kernels.shard_merge_kernel, launches)[(1,)](
            torch.randn(3, 4, 24, generator=generator), ids, loss, lse, 24, 3, -100, 0.1 if smoothing else 0.0,
            1.0 / 150, 1e-4, SMOOTHING=smoothing, Z_LOSS=smoothing, BLOCK=32,
        )  # fmt: skip


def test_every_launched_kernel_variant_compiles_for_sm90(monkeypatch):
    launches = []
    monkeypatch.setattr(launchers, "_kernels", _RecordingKernels(launchers._kernels, launches))
    monkeypatch.setattr(backend, "_triton_helpers", _RecordingKernels(backend._triton_helpers, launches))
    monkeypatch.setattr(labels, "_kernels", _RecordingKernels(labels._kernels, launches))
    _run_ops()
    _run_shard_steps(launches)
    payload = {}
    for kernel, args, kwargs in launches:
        signature, constexprs, num_warps = _variant(kernel, args, kwargs)
        variant = {
            "module": kernel.fn.__module__,
            "kernel": kernel.fn.__name__,
            "signature": signature,
            "constexprs": [[index[0], value] for index, value in constexprs.items()],
            "num_warps": num_warps,
        }
        payload[json.dumps(variant, sort_keys=True)] = variant
    payload = list(payload.values())
    names = {variant["kernel"] for variant in payload}
    assert {
        "stats_kernel",
        "grad_kernel",
        "target_logit_kernel",
        "scale_inplace_kernel",
        "scale_pair_inplace_kernel",
        "prepare_labels_kernel",
        "shard_merge_kernel",
    } <= names
    assert any(kwargs.get("SHARD_PACK") for _, _, kwargs in launches)
    assert any(kwargs.get("SHIFT") for _, _, kwargs in launches)
    assert any(kwargs.get("UNNORMALIZED_GRAD") for _, _, kwargs in launches)  # the one-pass variant too
    assert any(kwargs.get("WANT_LOG_SUM_SQ") and kwargs.get("WRITE_GRAD") for _, _, kwargs in launches)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], input=json.dumps(payload), env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("compiled ") == len(payload), result.stdout


_COMPILE_SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget

for variant in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(variant["module"]), variant["kernel"])
    constexprs = {(index,): value for index, value in variant["constexprs"]}
    source = triton.compiler.ASTSource(fn=kernel, signature=variant["signature"], constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": variant["num_warps"]})
    assert compiled.asm.get("cubin"), variant["kernel"]
    print("compiled", variant["kernel"])
"""
