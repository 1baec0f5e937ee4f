"""Setting presets (`mpress.config.settings`): the MPress paper's settings load as stated, bad
setting files are one line naming the file and key (exit 2 through the CLI), and a
setting's precision reaches the profile: Bert in fp32 holds about twice the activation
and parameter bytes of fp16 mixed precision, and no fp32 master copy."""

from __future__ import annotations

import pytest
import yaml

from mpress.cli import main
from mpress.errors import ConfigError, UserError
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.config.settings import SETTINGS_DIR, load_setting, setting_presets
from mpress.static.plan.evaluate import setup_pipeline
from mpress.config.vocabulary import ScheduleName
from tests.support.documented import one_line_error


def test_the_paper_settings_are_presets():
    assert {"paper-bert", "paper-gpt"} <= set(setting_presets())
    bert, gpt = load_setting("paper-bert"), load_setting("paper-gpt")
    assert (bert.family, bert.precision, bert.schedule, bert.num_stages, bert.microbatch_size) == \
        ("bert", "fp32", ScheduleName.PIPEDREAM, 8, 12)
    assert (gpt.family, gpt.precision, gpt.schedule, gpt.num_stages, gpt.microbatch_size) == \
        ("gpt", "fp16", ScheduleName.ONE_F_ONE_B, 8, 2)
    for s in (bert, gpt):
        assert s.num_microbatches >= s.num_stages  # stage 0 reaches num_stages microbatches in flight
        assert set(s.hardware) == {"dgx1-v100", "dgx-a100"}
        assert "HPCA 2023" in s.source
        assert all(load_model_config(m).family == s.family for m in s.models)
        assert s.default_model == s.models[0]


def _write(tmp_path, **changes):
    data = yaml.safe_load((SETTINGS_DIR / "paper-bert.yaml").read_text())
    data.update(changes)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("changes, key, words", [
    (dict(num_stage=8), "num_stage", "unknown key"),
    (dict(precision="fp8"), "precision", "one of"),
    (dict(schedule="zigzag"), "schedule", "one of"),
    (dict(num_stages=0), "num_stages", ">= 1"),
    (dict(models=["gpt-5.3b"]), "models[0]", "gpt model"),
    (dict(models=["bert-99b"]), "models[0]", "unknown model preset"),
    (dict(models=[]), "models", "at least one"),
    (dict(hardware=["dgx-z"]), "hardware[0]", "unknown hardware preset"),
])
def test_a_bad_setting_file_is_one_config_error_naming_file_and_key(tmp_path, changes, key, words):
    path = _write(tmp_path, **changes)
    with pytest.raises(ConfigError) as info:
        load_setting(path)
    msg = str(info.value)
    assert str(path) in msg and f"{key}:" in msg and words in msg and "\n" not in msg


@pytest.mark.parametrize("command", ["plan", "emulate", "maxsize"])
def test_a_bad_setting_file_through_the_cli_is_one_line_and_exit_2(tmp_path, capsys, command):
    path = _write(tmp_path, num_stage=8)
    code = main([command, "--setting", str(path)])
    one_line_error(code, capsys.readouterr().err, str(path), "num_stage", "unknown key")


def test_an_unknown_setting_name_is_one_line_and_exit_2(capsys):
    code = main(["emulate", "--setting", "paper-resnet"])
    one_line_error(code, capsys.readouterr().err, "unknown setting 'paper-resnet'", "paper-bert")


def test_the_settings_precision_replaces_the_presets():
    bert = load_setting("paper-bert")
    preset = load_model_config("bert-4b")
    assert preset.precision == "fp16"
    trained = bert.apply(preset)
    assert trained.precision == "fp32" and trained.name == preset.name
    assert trained.fingerprint() != preset.fingerprint()  # a plan for one is refused for the other
    with pytest.raises(UserError, match="trains the bert family; model gpt-5.3b is gpt"):
        bert.apply(load_model_config("gpt-5.3b"))


def test_fp32_bert_holds_twice_the_bytes_of_fp16_and_no_master_weights():
    """The precision reaches the analytic profile: each block saves about twice the bytes
    (all but its 1-byte dropout masks double), every stage holds twice the parameter,
    gradient and stashed-weight bytes, and fp32 keeps no master copy (so its model
    states are 4+4+8 = 16 bytes per parameter, as fp16 mixed's 2+2+4+8)."""
    hw = load_hardware("dgx-a100")
    shape = dict(schedule="pipedream", num_stages=4, microbatch_size=2, num_microbatches=4)
    preset = load_model_config("bert-0.35b")
    half = setup_pipeline(preset, hw, **shape)
    full = setup_pipeline(load_setting("paper-bert").apply(preset), hw, **shape, ranges=half.ranges)
    blocks = [(h, f) for h, f in zip(half.profile.layers, full.profile.layers) if h.name.startswith("layers.")]
    assert len(blocks) == preset.num_layers
    for h, f in blocks:
        assert 1.8 <= sum(t.bytes for t in f.saved) / sum(t.bytes for t in h.saved) <= 2.0
    for h, f in zip(half.memory, full.memory):
        assert h.master_bytes > 0 and f.master_bytes == 0
        assert f.param_bytes == 2 * h.param_bytes and f.grad_bytes == 2 * h.grad_bytes
        assert f.stash_bytes == 2 * h.stash_bytes
        assert f.optim_bytes == h.optim_bytes  # Adam's two fp32 states either way
        assert f.model_state_bytes == h.model_state_bytes
        assert f.activation_bytes_per_microbatch > 1.6 * h.activation_bytes_per_microbatch
