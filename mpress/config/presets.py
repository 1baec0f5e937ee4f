"""Where presets live: the repository's `configs/` folder, the names of the shipped
hardware presets and training configs, and how a preset name or a file path given by a user becomes a file
(`resolve_config`, used by every loader of a preset: hardware, models, settings, train
configs)."""

from __future__ import annotations

from pathlib import Path

from mpress.config.loader import input_file_problem
from mpress.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
HARDWARE_DIR = CONFIG_DIR / "hardware"
TRAIN_DIR = CONFIG_DIR / "train"


def hardware_presets() -> list[str]:
    """Names of the shipped hardware presets."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def train_presets() -> list[str]:
    """Names of the shipped training configs (configs/train/; `mpress --help` lists them
    without loading the runtime)."""
    return sorted(p.stem for p in TRAIN_DIR.glob("*.yaml"))


def resolve_config(name_or_path: str | Path, directory: Path, what: str) -> Path:
    """Path of a preset name (`directory/<name>.yaml`) or of an existing file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml", ".json") or p.exists():
        problem = input_file_problem(p)  # a directory or a FIFO named as such
        if problem is not None:
            raise UserError(f"{p}: {problem}")
        return p
    candidate = directory / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    known = ", ".join(sorted(q.stem for q in directory.glob("*.yaml")))
    raise UserError(f"unknown {what} {str(name_or_path)!r} (presets: {known}; or give a .yaml path)")
