"""A run's metrics: one JSON line per logged step in `metrics.jsonl`, and TensorBoard
event files beside it when `tensorboard` is installed (the `mpress[tensorboard]` extra).

Rank 0 writes; what the other ranks know (the last stage's loss, each rank's peak) comes
to it in the step's one object collective (mpress/train.py). A line holds

    step             0-based index of the optimizer step
    loss             the mean training loss of the step (over the replicas' last stages)
    lr               the learning rate the step ran at
    grad_norm        the global gradient norm (only when clipping computes it)
    skipped          true when the step was skipped for a non-finite norm (only then)
    step_s           seconds the step took on rank 0 (forwards, backwards, optimizer)
    samples_per_s    global batch / step_s
    tokens_per_s     global batch x sequence length / step_s (models with a sequence)
    mfu              model FLOP utilisation: the model's matrix-product FLOPs of the step
                     (forward + backward, no recompute: the profile's) / step_s / (the
                     hardware preset's peak FLOP/s for the model's dtype x the job's devices)
    peak_bytes       each rank's peak device memory in the step, by rank

and any extra field a caller passes (`val_loss` after an evaluation). Resuming at step k
keeps the lines of steps < k and appends: a step is never written twice
(`truncate_after`). TensorBoard gets the numeric fields as scalars under the same names,
its files purged past the resumed step the same way (`SummaryWriter(purge_step=k)`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mpress.config.loader import write_text_atomic

METRICS_FILE = "metrics.jsonl"
"""Its name in a run directory (`mpress train` writes RUN_DIR/metrics.jsonl)."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard's event files go to this folder beside the metrics file."""


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """What one optimizer step processes, to turn its time into rates."""

    samples_per_step: int
    """The global batch: samples over every replica."""
    tokens_per_sample: int | None
    """Sequence length; None for models without one (a user's module)."""
    model_flops_per_step: float | None
    """Matrix-product FLOPs of the step's forwards and backwards over every replica; None: unknown."""
    peak_flops_per_s: float | None
    """Peak FLOP/s of every device of the job together for the model's dtype; None: unknown."""

    def rates(self, step_s: float) -> dict[str, float]:
        """samples_per_s, tokens_per_s and mfu (a fraction of 1) of a step of `step_s`
        seconds; the last two only where known."""
        step_s = max(step_s, 1e-9)
        out = {"samples_per_s": self.samples_per_step / step_s}
        if self.tokens_per_sample is not None:
            out["tokens_per_s"] = self.samples_per_step * self.tokens_per_sample / step_s
        if self.model_flops_per_step and self.peak_flops_per_s:
            out["mfu"] = self.model_flops_per_step / step_s / self.peak_flops_per_s
        return out


def rates_text(record: dict[str, Any]) -> str:
    """The progress line's rates: `1.2k tokens/s  40.0 samples/s  MFU 3.1%`."""
    parts = []
    if "tokens_per_s" in record:
        parts.append(f"{_si(record['tokens_per_s'])} tokens/s")
    parts.append(f"{record['samples_per_s']:.1f} samples/s")
    if "mfu" in record:
        parts.append(f"MFU {record['mfu']:.2%}")
    return "  ".join(parts)


def _si(x: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def truncate_after(path: Path, first_step: int) -> int:
    """Keep the lines of `path` whose step is below `first_step` (the step a run resumes
    at; 0 for a fresh run: nothing kept), dropping unreadable lines (a line cut short by a
    killed run); returns the lines kept. No file: nothing to do."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and step < first_step:
            kept.append(line)
    write_text_atomic(str(path), "".join(f"{line}\n" for line in kept))
    return len(kept)


class MetricsLog:
    """Rank 0's metrics writer for one run (`path` None: writes nothing)."""

    def __init__(self, path: str | Path | None, *, first_step: int = 0, tensorboard: bool = True) -> None:
        """Open `path` for appending after dropping its lines of steps >= `first_step`;
        with `tensorboard` (and the package installed), event files in the folder
        `tensorboard/` beside it, purged from `first_step` on."""
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = None
        self._tb: Any = None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_after(self.path, first_step)
        self._file = open(self.path, "a")
        if tensorboard:
            self._tb = _summary_writer(self.path.parent / TENSORBOARD_DIR, first_step)

    @property
    def has_tensorboard(self) -> bool:
        return self._tb is not None

    def write(self, record: dict[str, Any]) -> None:
        """Append `record` (a `step` and any JSON-able fields; floats that are not finite
        are written as null) as one line, flushed; its numbers to TensorBoard."""
        if self._file is None:
            return
        clean = {k: _finite(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in clean.items():
                if key == "step":
                    continue
                if isinstance(value, dict):
                    for sub, v in value.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool):
                            self._tb.add_scalar(f"{key}/{sub}", v, step)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    return value


def _summary_writer(folder: Path, first_step: int) -> Any:
    """torch's TensorBoard writer, or None where the `tensorboard` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch.utils.tensorboard imports tensorboard itself
        return None
    return SummaryWriter(str(folder), purge_step=first_step if first_step else None)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file, in order; a `ValueError` naming the line when one is
    not a JSON object with an integer `step`."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"line {number} is not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"line {number} has no integer step")
        records.append(record)
    return records


__all__ = ["METRICS_FILE", "MetricsLog", "TENSORBOARD_DIR", "Throughput", "rates_text", "read_metrics",
           "truncate_after"]
