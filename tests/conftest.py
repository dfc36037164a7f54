"""Test setup: on a machine without a GPU the Triton kernels run under the CPU interpreter.

TRITON_INTERPRET must be set before triton is imported, hence here. Set LCE_TEST_GPU=1 to run
the suite against real kernels on a CUDA machine instead.
"""

import os

if os.environ.get("LCE_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# One intra-op thread per test process: the tests run tiny tensors, where a second thread only
# contends for the cores (CI has two, used by two pytest-xdist workers).
import torch  # noqa: E402

torch.set_num_threads(1)
