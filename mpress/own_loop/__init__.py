"""mpress inside your own training loop (torch.distributed.pipelining, your optimizer and
LR scheduler): `apply_mpress` wraps a stage module under a plan, `wrap_optimizer` wraps
the optimizer so the plan's optimizer-state offload, master weights and host step run
around its `step()`. See README.md, "Your own training loop"."""

from mpress.own_loop.optimizer import MpressOptimizer, wrap_optimizer
from mpress.own_loop.stages import apply_mpress, close, load_plan, rank_program

__all__ = ["MpressOptimizer", "apply_mpress", "close", "load_plan", "rank_program", "wrap_optimizer"]
