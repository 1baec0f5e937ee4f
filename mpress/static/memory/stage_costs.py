"""One pipeline stage's share of a profile, for one microbatch (`StageCosts`), and the
grouping of a profile's layers into stages (`stage_costs`): what the memory model
(`model.py`), the data-parallel buffers (`data_parallel.py`) and the lowering read.

Units: bytes, seconds, FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpress.errors import ScheduleError
from mpress.static.profile.profile import LayerProfile, Profile, SavedTensor


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """One pipeline stage's share of a profile, for one microbatch."""

    stage: int
    first_layer: int
    end_layer: int
    """Layer range [first_layer, end_layer) of the profile."""
    layers: tuple[LayerProfile, ...]
    forward_s: float
    backward_s: float
    forward_flops: float
    backward_flops: float
    saved_bytes: int
    """Activation bytes saved for backward per microbatch."""
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    master_bytes: int
    input_bytes: int
    """Bytes received from the previous stage per microbatch (0 for stage 0)."""
    output_bytes: int
    """Bytes sent to the next stage per microbatch (0 for the last stage)."""
    batch_bytes: int
    """Per microbatch, the input batch on the first stage and the targets on the last."""

    @property
    def optimizer_data_bytes(self) -> int:
        """Optimizer states + fp32 master weights of the stage: what `optim:*` moves."""
        return self.optim_bytes + self.master_bytes

    @property
    def saved(self) -> list[SavedTensor]:
        return [t for layer in self.layers for t in layer.saved]


def stage_costs(profile: Profile, ranges: list[tuple[int, int]]) -> list[StageCosts]:
    """Group a profile's layers into stages by `ranges` ([start, end) per stage)."""
    if not ranges:
        raise ScheduleError("a pipeline needs at least one stage")
    expected = 0
    for start, end in ranges:
        if start != expected or end <= start:
            raise ScheduleError(f"stage layer ranges must be contiguous and non-empty, got {ranges}")
        expected = end
    if expected != profile.num_layers:
        raise ScheduleError(f"stage layer ranges cover {expected} layers, profile has {profile.num_layers}")
    out = []
    last = len(ranges) - 1
    for s, (start, end) in enumerate(ranges):
        layers = tuple(profile.layers[start:end])
        out.append(StageCosts(
            stage=s, first_layer=start, end_layer=end, layers=layers,
            forward_s=sum(x.forward_time_s for x in layers),
            backward_s=sum(x.backward_time_s for x in layers),
            forward_flops=sum(x.forward_flops for x in layers),
            backward_flops=sum(x.backward_flops for x in layers),
            saved_bytes=sum(x.saved_bytes for x in layers),
            param_bytes=sum(x.param_bytes for x in layers),
            grad_bytes=sum(x.grad_bytes for x in layers),
            optim_bytes=sum(x.optim_bytes for x in layers),
            master_bytes=sum(x.master_bytes for x in layers),
            input_bytes=0 if s == 0 else profile.layers[start - 1].output_bytes,
            output_bytes=0 if s == last else layers[-1].output_bytes,
            batch_bytes=(profile.input_bytes if s == 0 else 0) + (profile.target_bytes if s == last else 0),
        ))
    return out
