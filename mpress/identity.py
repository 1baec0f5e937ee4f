"""The identity of a tensor the runtime moves: which rank, stage, microbatch and tensor.

One `TensorKey` names one tensor everywhere at run time: the memory manager's residency
table, the swap engine's handles and every error message, so a failure reads
"rank 1 stage 1 microbatch 3 tensor layers.2.mlp.fc1#0" and can be matched against the
plan. The `tensor` part follows the plan's naming (see DESIGN.md, "Identity of a tensor"):

- saved activations: `<module path>#<saved index>` (module path as in `named_modules()`,
  saved index = order in which that module's forward saved tensors for backward);
- model data: `param:<name>`, `grad:<name>`, `optim:<name>:<state>`,
  `stash:<version>:<name>`; these carry `microbatch=None`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorKey:
    """Immutable, hashable name of one tensor at run time."""

    rank: int
    """Global rank of the process that owns the tensor."""
    stage: int
    """Pipeline stage index the tensor belongs to (a rank may hold several stages)."""
    microbatch: int | None
    """Microbatch index for activations; None for model data (params, optimizer states)."""
    tensor: str
    """`module#index` for saved activations, `optim:<param>:<state>` etc. for model data."""

    @classmethod
    def activation(cls, *, rank: int, stage: int, microbatch: int, module: str,
                   index: int) -> TensorKey:
        """Key of the `index`-th tensor saved for backward by `module` in `microbatch`."""
        return cls(rank=rank, stage=stage, microbatch=microbatch, tensor=f"{module}#{index}")

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else f" microbatch {self.microbatch}"
        return f"rank {self.rank} stage {self.stage}{mb} tensor {self.tensor}"
