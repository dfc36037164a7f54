"""The torch backend keeps a bounded chunk of logits, not N x V.

Measured in a fresh subprocess through the peak resident set size, since CPU allocations have
no allocator statistics: N x V fp32 logits here would take 1 GiB (the unfused path needs about
three such tensors), while the torch backend's chunk budget is 32 MiB.
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a large subprocess run

SCRIPT = textwrap.dedent(
    """
    import json, resource, torch
    from lce_patch import fused_linear_cross_entropy
    torch.manual_seed(0)
    n, d, v = 8192, 32, 32768
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(v, d, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    fused_linear_cross_entropy(hidden[:64], weight, labels[:64], backend="torch").backward()  # warm up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss = fused_linear_cross_entropy(hidden, weight, labels, backend="torch")
    loss.backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_growth_mib": (after - before) / 1024, "logits_mib": n * v * 4 / 2**20}))
    """
)


def test_torch_backend_peak_memory_is_bounded_by_its_chunk_budget():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=300)
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    # budget (32 MiB) + dW/dh buffers (~5 MiB) + allocator slack; far below the 1024 MiB of logits
    assert stats["peak_growth_mib"] < 200, stats
    assert stats["logits_mib"] == 1024
