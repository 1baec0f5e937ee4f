"""The flags of every `mpress` command: named as the train config's keys, one name per
concept, the old spellings still accepted but not shown; help keeps its examples verbatim
and lists the presets and the exit status."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json

import pytest

from mpress.cli import SUBCOMMANDS, build_parser, main
from mpress.config.presets import hardware_presets
from mpress.config.model_config import model_presets
from mpress.runtime.train_config import TrainConfig, train_presets

OLD_SPELLINGS = {  # old flag -> the flag named as the train config's key (or the concept's one name)
    "--stages": "--num-stages", "--microbatches": "--num-microbatches", "--ranks": "--num-ranks",
    "--devices": "--num-devices", "--strategies": "--strategy", "--budget": "--device-memory",
    "--family": "--model", "--network": "--model", "--policy": "--swap-in-policy", "--batch": "--microbatch-size",
}
TRAIN_KEYS = ["num_stages", "num_microbatches", "microbatch_size", "device_memory", "strategy", "schedule",
              "hardware", "model", "module", "layers"]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _help(argv: list[str], capsys) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def test_train_config_keys_are_the_flags_names():
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    shown: dict[str, set[str]] = {}
    for name, sub in _subparsers().items():
        for action in sub._actions:
            longs = [s for s in action.option_strings if s.startswith("--")]
            if longs:
                shown.setdefault(action.dest, set()).add(longs[0])
    for key in TRAIN_KEYS:
        assert key in keys
        assert shown.get(key) == {"--" + key.replace("_", "-")}, (key, shown.get(key))


def test_one_flag_per_concept_and_old_spellings_hidden_but_accepted(capsys):
    subs = _subparsers()
    for name, sub in subs.items():
        text = _help([name], capsys)
        for action in sub._actions:
            longs = [s for s in action.option_strings if s.startswith("--")]
            for old in longs[1:]:  # every second name is an old spelling of the first
                assert OLD_SPELLINGS[old] == longs[0], (name, old)
                assert old + " " not in text and old + "\n" not in text and old + "," not in text, (name, old)
        shown = {a.option_strings[0] for a in sub._actions if a.option_strings}
        assert not shown & set(OLD_SPELLINGS), (name, shown & set(OLD_SPELLINGS))
    accepted = {s for sub in subs.values() for a in sub._actions for s in a.option_strings}
    assert set(OLD_SPELLINGS) <= accepted


def test_old_and_new_spellings_give_the_same_figures(capsys):
    base = ["emulate", "--model", "gpt-tiny", "--hardware", "cpu-local", "--json"]
    assert main([*base, "--stages", "2", "--microbatches", "4", "--devices", "2", "--device-memory", "3MB"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert main([*base, "--num-stages", "2", "--num-microbatches", "4", "--num-devices", "2",
                 "--device-memory", "3MB"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert old == new and new["settings"]["num_stages"] == 2 and new["settings"]["num_microbatches"] == 4


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_help_keeps_the_examples_verbatim(name, capsys):
    module = importlib.import_module(f"mpress.commands.{name}")
    text = _help([name], capsys)
    source = "\n".join([module.__doc__ or "", getattr(module, "EPILOG", ""), getattr(module, "EXAMPLES", "")])
    examples = [line for line in source.splitlines() if line.lstrip().startswith("mpress ")]
    assert examples, f"mpress {name}: no examples in its help"
    for line in examples:  # whole lines, a continued one with its trailing backslash
        assert line in text.splitlines(), line
    assert "exit status" in text.lower()


def test_top_level_help_lists_commands_presets_and_exit_status(capsys):
    text = _help([], capsys)
    for name in [*SUBCOMMANDS, *model_presets(), *hardware_presets(), *train_presets()]:
        assert name in text, name
    for code, words in [("0", "done"), ("1", "runtime failure"), ("2", "bad input"), ("130", "interrupted")]:
        assert any(line.split()[:1] == [code] and words in line for line in text.splitlines()), code
