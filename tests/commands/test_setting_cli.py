"""`--setting` on `mpress plan`, `emulate` and `maxsize`: the setting's shape fills the
flags left unset (explicit flags win), its precision replaces the model's, and the
settings line and `--json` say where each value came from."""

from __future__ import annotations

import json

from mpress.cli import main
from mpress.hardware.server import load_hardware
from mpress.config.model_config import load_model_config
from mpress.config.settings import load_setting
from mpress.static.plan.evaluate import setup_pipeline
from mpress.static.studies.maxsize import find_max_size
from tests.support.documented import one_line_error

BERT = ["--setting", "paper-bert", "--model", "bert-0.35b", "--hardware", "dgx-a100"]
FROM_SETTING = "the setting paper-bert's"


def _json(argv: list[str], capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_emulate_takes_shape_and_precision_from_the_setting(capsys):
    doc = _json(["emulate", *BERT, "--json"], capsys)
    s = doc["settings"]
    assert (s["schedule"], s["num_stages"], s["microbatch_size"], s["num_microbatches"]) == ("pipedream", 8, 12, 16)
    assert s["precision"] == "fp32" and s["setting"] == "paper-bert"
    assert s["defaults"] == {k: FROM_SETTING for k in ("schedule", "num_stages", "microbatch_size",
                                                       "num_microbatches", "precision")}
    setting = load_setting("paper-bert")
    expected = setup_pipeline(setting.apply(load_model_config("bert-0.35b")), load_hardware("dgx-a100"),
                              schedule="pipedream", num_stages=8, microbatch_size=12, num_microbatches=16)
    assert [x["need_bytes"] for x in doc["stages"]] == [m.total_bytes for m in expected.memory]
    assert [x["stash_bytes"] for x in doc["stages"]] == [m.stash_bytes for m in expected.memory]


def test_explicit_flags_win_over_the_setting_and_the_line_says_whose_values(capsys):
    assert main(["emulate", *BERT, "--schedule", "1f1b", "--num-microbatches", "8"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("settings: "))
    assert f"model bert-0.35b, precision fp32 ({FROM_SETTING}), hardware dgx-a100 (8 x " in line
    assert "schedule 1f1b," in line and "num_microbatches 8," in line
    assert f"num_stages 8 ({FROM_SETTING})" in line and f"microbatch_size 12 ({FROM_SETTING})" in line


def test_the_settings_first_model_and_server_are_the_defaults(capsys):
    s = _json(["emulate", "--setting", "paper-gpt", "--json"], capsys)["settings"]
    gpt = load_setting("paper-gpt")
    assert (s["model"], s["hardware"], s["precision"]) == (gpt.models[0], gpt.hardware[0], "fp16")
    assert {s["defaults"][k] for k in ("model", "hardware", "precision")} == {"the setting paper-gpt's"}
    assert main(["emulate", "--setting", "paper-gpt"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("settings: "))
    assert line.startswith(f"settings: model {gpt.models[0]} (the setting paper-gpt's), precision fp16 (the setting "
                           f"paper-gpt's), hardware {gpt.hardware[0]} (8 x ")
    assert ") (the setting paper-gpt's), schedule 1f1b (the setting paper-gpt's)" in line
    assert (s["schedule"], s["microbatch_size"]) == ("1f1b", 2)


def test_plan_under_the_setting_plans_the_fp32_model(capsys):
    doc = _json(["plan", *BERT, "--num-microbatches", "8", "--json"], capsys)
    assert doc["settings"]["precision"] == "fp32" and doc["settings"]["schedule"] == "pipedream"
    assert doc["settings"]["defaults"]["microbatch_size"] == FROM_SETTING


def test_a_model_of_another_family_is_one_line_and_exit_2(capsys):
    code = main(["plan", "--setting", "paper-gpt", "--model", "bert-4b"])
    one_line_error(code, capsys.readouterr().err, "setting paper-gpt trains the gpt family", "bert-4b")
    code = main(["maxsize", "--setting", "paper-gpt", "--model", "bert"])
    one_line_error(code, capsys.readouterr().err, "paper-gpt", "gpt family", "--model bert")


def test_a_profile_with_a_setting_is_one_line_and_exit_2(tmp_path, capsys):
    prof = tmp_path / "p.yaml"
    assert main(["profile", "--model", "bert-tiny", "--analytic", "--hardware", "cpu-local", "--out", str(prof)]) == 0
    capsys.readouterr()
    code = main(["emulate", "--setting", "paper-bert", "--profile", str(prof)])
    one_line_error(code, capsys.readouterr().err, "--setting paper-bert", "precision", "--model")


def test_maxsize_searches_the_family_in_the_settings_precision(capsys):
    assert main(["maxsize", "--setting", "paper-bert", "--hardware", "dgx-a100", "--strategy", "none", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    s = doc["settings"]
    assert (s["model"], s["precision"], s["schedule"], s["num_stages"], s["microbatch_size"],
            s["num_microbatches"]) == ("bert", "fp32", "pipedream", 8, 12, 16)
    assert set(s["defaults"]) == {"model", "precision", "schedule", "num_stages", "microbatch_size",
                                  "num_microbatches"}  # not the hardware: --hardware was given
    line = next(x for x in err.splitlines() if x.startswith("settings: "))
    assert line.startswith(f"settings: model family bert ({FROM_SETTING}), precision fp32 ({FROM_SETTING}), "
                           "hardware dgx-a100 (8 x ")
    row = doc["strategies"][0]
    shape = dict(schedule="pipedream", num_stages=8, microbatch_size=12, num_microbatches=16)
    hw = load_hardware("dgx-a100")
    fp32 = find_max_size("bert", hw, "none", precision="fp32", **shape)
    fp16 = find_max_size("bert", hw, "none", **shape)
    assert row["largest_model"] == fp32.model.name and fp32.model.precision == "fp32"
    assert fp16.model.precision == "fp16"
    assert fp32.num_parameters < fp16.num_parameters  # fp32 activations and weights take more memory


def test_a_plan_made_under_a_setting_is_emulated_with_it_and_refused_without(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    assert main(["plan", *BERT, "--num-microbatches", "8", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["emulate", str(plan), "--setting", "paper-bert"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("settings: "))
    assert "precision fp32 (the setting paper-bert's)" in line and "num_microbatches 8 (the plan's)" in line
    code = main(["emulate", str(plan)])
    one_line_error(code, capsys.readouterr().err, "made for bert-0.35b in fp32", "--setting paper-bert")


def test_an_hf_config_with_a_setting_is_one_line_and_exit_2(capsys):
    code = main(["emulate", "--setting", "paper-gpt", "--hf-config", "gpt2-tiny"])
    one_line_error(code, capsys.readouterr().err, "--setting paper-gpt", "--hf-config")
