"""TRL's trainers served by lce_patch's ops: one module per trainer family, each listed in the serving table
(``lce_patch.integrations.serving``) and following its ``serve`` / ``unserve`` protocol.

``head``: TRL's fused-LM-head protocol (SFT, DPO, KTO, GRPO, RLOO and the trainers built on them);
``distillation``, ``gkd``: the generalized JSD (``fused_linear_divergence``); ``preference`` (ORPO, CPO), ``tpo``,
``online_dpo``, ``a2po``: the log-probabilities (``fused_linear_log_probs``); ``async_distillation``,
``server_distillation``: the teacher's top-K (``fused_linear_sparse_divergence``); ``unserved``: the warning for the
trainers left on TRL's path. ``protocol`` holds what they check TRL's code against; ``redirect`` the module-function
redirection two of them use.
"""

from .head import find_trl_head, maybe_install_trl_head, remove_trl_head
from .protocol import TRLProtocolError

__all__ = ["TRLProtocolError", "find_trl_head", "maybe_install_trl_head", "remove_trl_head"]
