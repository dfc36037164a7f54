"""What every op shares, owned by none: input checks (``checks``), backend choice and device helpers
(``backend``), the chunk-size policy (``chunking``), the chunk GEMMs and gradient accumulation (``grads``), an
op's options as its custom operators' arguments (``schema``), the Triton helpers the kernels share
(``triton_helpers``), the logit transform (``transform``), the reductions and the loss scaling (``reduction``)
and the final logits of the references (``naive``).

An op imports from here and from its own folder only."""

from .backend import BACKENDS, stats_dtype
from .checks import check_weights
from .grads import fp32_output_gemm_available

__all__ = ["BACKENDS", "check_weights", "fp32_output_gemm_available", "stats_dtype"]
