"""Setting presets: a published training setting (a paper's), as one named file.

A model preset says what a model is; a setting says how a paper trained a family of
them: precision, pipeline schedule, stages, microbatch size and count, and the servers.
`configs/settings/<name>.yaml` (e.g. `paper-bert`, `paper-gpt`: the MPress paper's) is
read by `load_setting`, checked like every config (`mpress.config.loader.from_dict`): an unknown
key, a wrong type, a model preset of another family or an unknown hardware preset is
one `ConfigError` naming the file and the key.

`mpress plan`, `mpress emulate` and `mpress maxsize` take `--setting NAME`: its shape
values are the defaults of the pipeline flags (explicit flags, and a plan's own values,
still win; `pipeline_args.resolve_shape`), and its precision replaces the model preset's
(`Setting.apply`), so `--setting paper-bert --model bert-4b` plans Bert-4B in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from mpress.config import limits
from mpress.config.loader import from_dict, load_yaml
from mpress.errors import ConfigError, UserError
from mpress.config.presets import CONFIG_DIR, hardware_presets, resolve_config
from mpress.config.model_config import ModelConfig, load_model_config, model_presets
from mpress.config.vocabulary import ScheduleName, as_word

SETTINGS_DIR = CONFIG_DIR / "settings"


@dataclass(frozen=True, kw_only=True)
class Setting:
    """How a family of models is trained in one published setting."""

    name: str
    """Setting name, e.g. paper-bert."""
    source: str
    """Where the setting comes from (paper and section), and what is chosen here instead."""
    family: Literal["gpt", "bert", "llama"]
    """Model family the setting trains."""
    models: list[str]
    """Model presets of `family` the setting covers; the first is the default model."""
    precision: Literal["fp32", "fp16", "bf16"]
    """Training precision, replacing the model preset's (fp32: no master weights)."""
    schedule: ScheduleName
    """Pipeline schedule."""
    num_stages: int = field(metadata={"min": 1, "max": limits.MAX_STAGES})
    """Pipeline stages."""
    microbatch_size: int = field(metadata={"min": 1, "max": limits.MAX_MICROBATCH_SIZE})
    """Samples per microbatch."""
    num_microbatches: int = field(metadata={"min": 1, "max": limits.MAX_MICROBATCHES})
    """Microbatches per iteration."""
    hardware: list[str]
    """Hardware presets the setting was run on."""

    def __post_init__(self) -> None:
        as_word(self, "schedule", ScheduleName)
        if not self.models:
            raise ConfigError("", "models", "give at least one model preset")
        if not self.hardware:
            raise ConfigError("", "hardware", "give at least one hardware preset")

    @property
    def default_model(self) -> str:
        """The model preset a command uses under this setting when none is named."""
        return self.models[0]

    def apply(self, model: ModelConfig) -> ModelConfig:
        """`model` as this setting trains it: its precision replaced by the setting's. A
        model of another family is a `UserError`."""
        if model.family != self.family:
            raise UserError(f"setting {self.name} trains the {self.family} family; model {model.name} is "
                            f"{model.family} (give a {self.family} model, or another --setting)")
        return model if model.precision == self.precision else replace(model, precision=self.precision)


def setting_presets() -> list[str]:
    """Names of the shipped setting presets."""
    return sorted(p.stem for p in SETTINGS_DIR.glob("*.yaml"))


def load_setting(name_or_path: str | Path) -> Setting:
    """A setting preset by name, or a setting YAML; every model it names must be a preset
    of its family and every hardware a hardware preset (else one `ConfigError`)."""
    path = resolve_config(name_or_path, SETTINGS_DIR, "setting")
    setting = from_dict(Setting, load_yaml(path), str(path))
    known_models, known_hardware = model_presets(), hardware_presets()
    for i, name in enumerate(setting.models):
        if name not in known_models:
            raise ConfigError(str(path), f"models[{i}]", f"unknown model preset {name!r} "
                                                         f"(presets of configs/models/)")
        family = load_model_config(name).family
        if family != setting.family:
            raise ConfigError(str(path), f"models[{i}]", f"{name} is a {family} model; the setting's family "
                                                         f"is {setting.family}")
    for i, name in enumerate(setting.hardware):
        if name not in known_hardware:
            raise ConfigError(str(path), f"hardware[{i}]", f"unknown hardware preset {name!r} "
                                                           f"(allowed: {', '.join(known_hardware)})")
    return setting
