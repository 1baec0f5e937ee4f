"""Dotted overrides of a train config's keys (`mpress train --steps 10 --optimizer.lr 1e-3`)."""

from __future__ import annotations

import pytest
import yaml

from mpress.errors import ConfigError
from mpress.config.overrides import apply_overrides, override_argv, parse_override_args
from mpress.runtime.train_config import TrainConfig, load_train_config


def test_flags_become_dotted_keys_and_raw_values():
    args = ["--steps", "10", "--optimizer.lr=1e-3", "--num-microbatches", "8", "--seed", "-1"]
    assert parse_override_args(args, "cfg.yaml") == [("steps", "10"), ("optimizer.lr", "1e-3"),
                                                     ("num_microbatches", "8"), ("seed", "-1")]


def test_the_ranks_read_back_what_the_launcher_parsed():
    overrides = [("steps", "10"), ("optimizer.betas", "[0.9, 0.95]"), ("checkpoint.dir", "a b")]
    assert parse_override_args(override_argv(overrides), "cfg.yaml") == overrides


@pytest.mark.parametrize("args, message", [
    (["--steps"], "cfg.yaml: --steps: needs a value"),
    (["--steps", "--seed", "1"], "cfg.yaml: --steps: needs a value"),
    (["steps", "1"], "cfg.yaml: steps: unexpected argument"),
])
def test_malformed_flags_are_one_line(args, message):
    with pytest.raises(ConfigError) as exc:
        parse_override_args(args, "cfg.yaml")
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_values_are_read_as_yaml_and_missing_sections_are_made():
    data = {"model": "gpt-tiny", "optimizer": {"name": "adam"}}
    out = apply_overrides(data, [("steps", "10"), ("optimizer.lr", "0.5"), ("checkpoint.dir", "ck"),
                                 ("dropout", "null"), ("optimizer.betas", "[0.5, 0.6]")], TrainConfig, "f.yaml")
    assert out == {"model": "gpt-tiny", "steps": 10, "optimizer": {"name": "adam", "lr": 0.5, "betas": [0.5, 0.6]},
                   "checkpoint": {"dir": "ck"}, "dropout": None}
    assert data == {"model": "gpt-tiny", "optimizer": {"name": "adam"}}  # the file's mapping is not changed


@pytest.mark.parametrize("key, message", [
    ("stepz", "f.yaml: --stepz: no such key (allowed: backend, checkpoint, "),
    ("optimizer.lrr", "f.yaml: --optimizer.lrr: no such key under optimizer (allowed: betas, clip_grad_norm, "
                      "eps, lr, max_skipped_steps, min_lr, name, no_decay, schedule, warmup_steps, weight_decay)"),
    ("steps.x", "f.yaml: --steps.x: steps has no keys below it"),
])
def test_an_unknown_key_names_the_flag_the_file_and_the_allowed_keys(key, message):
    with pytest.raises(ConfigError) as exc:
        apply_overrides({"model": "gpt-tiny"}, [(key, "1")], TrainConfig, "f.yaml")
    assert str(exc.value).startswith(message), str(exc.value)


def test_load_train_config_applies_overrides_and_names_a_bad_value_by_its_flag(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"model": "gpt-tiny", "steps": 100, "optimizer": {"lr": 0.1}}))
    cfg = load_train_config(path, [("steps", "7"), ("optimizer.lr", "1e-3")])
    assert (cfg.steps, cfg.optimizer.lr) == (7, 1e-3)
    assert load_train_config(path).steps == 100
    with pytest.raises(ConfigError) as exc:
        load_train_config(path, [("steps", "0")])
    assert str(exc.value) == f"{path}: --steps: must be >= 1, got 0"
