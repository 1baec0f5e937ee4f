"""`mpress plan`, `mpress emulate PLAN` and `mpress maxsize` end to end, with bad input."""

import json

import pytest
import yaml

from mpress.cli import main
from mpress.hardware.server import load_hardware
from mpress.config.presets import HARDWARE_DIR
from mpress.contract.plan import Plan


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    assert main(["plan", "--model", "gpt-10.3b", "--out", str(path)]) == 0
    return path


def one_line_error(capsys, words):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in err, err
    return err


def test_plan_prints_tables_and_writes_a_loadable_plan(plan_file, capsys):
    plan = Plan.load(plan_file)
    assert plan.model == "gpt-10.3b" and plan.strategy == "mpress" and plan.fits
    assert any(rule.technique != "keep" for sp in plan.stages for rule in sp.rules)


def test_plan_output_names_every_strategy(capsys, tmp_path):
    assert main(["plan", "--model", "gpt-10.3b", "--strategy", "recompute", "--out", str(tmp_path / "r.yaml")]) == 0
    out = capsys.readouterr().out
    for name in ("none", "recompute", "host-swap", "d2d", "mpress"):
        assert name in out
    assert "time / mpress" in out and "planned peak" in out
    assert Plan.load(tmp_path / "r.yaml").strategy == "recompute"


def test_emulate_replays_the_plan(plan_file, capsys):
    assert main(["emulate", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "mpress strategy" in out and "fits: every device" in out


def test_plan_for_another_model_or_hardware_is_refused(plan_file, capsys):
    assert main(["emulate", str(plan_file), "--model", "gpt-15.4b"]) == 2
    one_line_error(capsys, "made for model 'gpt-10.3b'")
    assert main(["emulate", str(plan_file), "--hardware", "dgx-a100"]) == 2
    one_line_error(capsys, "made for hardware 'dgx1-v100'")
    assert main(["emulate", str(plan_file), "--microbatches", "8"]) == 2
    one_line_error(capsys, f"16 x {Plan.load(plan_file).microbatch_size} microbatches")


def test_stripes_to_a_non_neighbour_are_refused(plan_file, tmp_path, capsys):
    data = yaml.safe_load(plan_file.read_text())
    stage = data["stages"][0]
    device = stage["device"]
    hw = load_hardware("dgx1-v100")  # the cube-mesh: every GPU lacks NVLink to three others
    stranger = next(p for p in range(8) if p != device and hw.links(device, p) == 0)
    stage["rules"].insert(0, {"tensor": "embed.**", "technique": "d2d",
                              "stripes": [{"device": stranger, "fraction": 1.0}]})
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["emulate", str(bad)]) == 2
    one_line_error(capsys, f"stripes to device {stranger}, which is not an NVLink neighbour")


def test_plan_naming_unknown_tensors_is_refused(plan_file, tmp_path, capsys):
    data = yaml.safe_load(plan_file.read_text())
    data["stages"][1]["rules"].insert(0, {"tensor": "layers.999.**", "technique": "recompute"})
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["emulate", str(bad)]) == 2
    one_line_error(capsys, "names 'layers.999.**', which the profile does not have")


def test_plan_file_with_unknown_key_is_refused(plan_file, tmp_path, capsys):
    data = yaml.safe_load(plan_file.read_text())
    data["stages"][0]["rules"][0]["speed"] = "fast"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["emulate", str(bad)]) == 2
    one_line_error(capsys, f"{bad}: stages[0].rules[0].speed: unknown key")


def test_model_no_strategy_can_fit(capsys):
    assert main(["plan", "--model", "gpt-25.5b", "--stages", "2"]) == 2
    one_line_error(capsys, "does not fit even with every tensor swapped: stage 0 needs")


def test_host_memory_too_small(tmp_path, capsys):
    text = (HARDWARE_DIR / "dgx1-v100.yaml").read_text()
    data = yaml.safe_load(text)
    data["host_memory_bytes"] = 50 * 10**9
    data["pinnable_host_bytes"] = 40 * 10**9  # what plans may pin of it
    for key in ("nvme_bytes", "nvme_read_gbps", "nvme_write_gbps"):  # no drive to take optimizer data instead
        data.pop(key)
    path = tmp_path / "small-host.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", "--model", "gpt-20.4b", "--hardware", str(path)]) == 2
    one_line_error(capsys, "host memory too small for the host-swap volume")


def test_unknown_strategy_is_refused(capsys):
    assert main(["plan", "--strategy", "zero"]) == 2
    assert "invalid choice: 'zero'" in capsys.readouterr().err


def test_maxsize_table(capsys):
    assert main(["maxsize", "--family", "gpt", "--hardware", "dgx-a100", "--strategies", "recompute,mpress"]) == 0
    out = capsys.readouterr().out
    assert "largest GPT on dgx-a100" in out and "recompute" in out and "mpress" in out
    assert main(["maxsize", "--strategies", "magic"]) == 2
    one_line_error(capsys, "unknown strategy 'magic'")


def test_maxsize_of_a_llama_preset(capsys):
    """`--model` names a Llama preset: its family is searched on the family's depth rule,
    the preset's sequence, vocabulary and key/value heads (`maxsize.family_rule`); a name
    that is no family and no preset is one line, exit 2."""
    import json

    from mpress.static.studies.maxsize import family_rule

    assert main(["maxsize", "--model", "llama-3-8b", "--hardware", "hgx-h100", "--strategy", "recompute",
                 "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["settings"]["model"] == "llama-3-8b"
    assert any(x.startswith("settings: model family llama, scaled from llama-3-8b") for x in err.splitlines()), err
    row = doc["strategies"][0]
    model = family_rule("llama-3-8b").model(row["hidden_size"])
    assert (row["largest_model"], row["num_layers"]) == (model.name, model.num_layers)
    assert model.family == "llama" and model.kv_heads == 8 and model.seq_len == 8192
    assert row["bound"] == "device memory"
    assert main(["maxsize", "--model", "llama-9"]) == 2
    one_line_error(capsys, "--model: 'llama-9' is neither a family (gpt, bert, llama) nor a model preset")


def test_plan_from_a_preset_profile_alone(tmp_path, capsys):
    profile = tmp_path / "p.yaml"
    assert main(["profile", "--model", "gpt-10.3b", "--microbatch-size", "2", "--analytic",
                 "--hardware", "dgx1-v100", "--out", str(profile)]) == 0
    assert main(["plan", "--profile", str(profile), "--out", str(tmp_path / "plan.yaml")]) == 0
    assert Plan.load(tmp_path / "plan.yaml").model == "gpt-10.3b"
    assert main(["plan", "--profile", str(profile), "--model", "gpt-15.4b"]) == 2
    one_line_error(capsys, "made for model 'gpt-10.3b'")


def test_a_factory_given_as_model_gets_a_hint(capsys):
    assert main(["plan", "--model", "mymodel:make"]) == 2
    one_line_error(capsys, "--module mymodel:make")


def test_when_the_strategy_does_not_fit_balanced_by_compute_the_layers_are_balanced_by_memory(tmp_path, capsys):
    """Llama 3 70B at 8k tokens on 8 H100s: host swap alone fits neither split (its pinned
    volume exceeds the host's), so without --balance the plan command says it tries the
    memory balance after the compute one, plans the strategy to write on both, and every
    other strategy once, on the split chosen; mpress (stage 0's optimizer step on the host)
    fits the compute split, and --balance memory writes a plan whose first stage holds
    fewer blocks."""
    assert main(["plan", "--model", "llama-3-70b", "--hardware", "hgx-h100", "--strategy", "host-swap"]) == 1
    printed = capsys.readouterr().out
    assert "host-swap does not fit with the layers balanced by compute; trying them balanced by memory" in printed
    # only the lines that end a strategy: a slow machine also prints news within one
    # (`[4/6] mpress: fit round 1 ...`) when a few seconds pass without a line
    planned = [line.split()[2].rstrip(":") for line in printed.splitlines()
               if line.startswith("[") and line.split()[1:2] == ["planned"]]
    assert planned == ["host-swap", "host-swap", "none", "recompute", "d2d", "mpress", "megatron-selective"]
    out = tmp_path / "llama.yaml"
    assert main(["plan", "--model", "llama-3-70b", "--hardware", "hgx-h100", "--balance", "memory",
                 "--out", str(out)]) == 0
    plan = Plan.load(str(out))
    stage0 = plan.stages[0].end_layer - plan.stages[0].first_layer
    assert stage0 < min(sp.end_layer - sp.first_layer for sp in plan.stages[1:-1])  # the first stage holds fewer


def _planned(printed: str) -> list[str]:
    """The strategies whose planning ended, in order (the lines `[n/6] planned name: ...`)."""
    return [line.split()[2].rstrip(":") for line in printed.splitlines()
            if line.startswith("[") and line.split()[1:2] == ["planned"]]


BERT_4B = ["plan", "--model", "bert-4b", "--hardware", "dgx1-v100", "--microbatch-size", "4", "--strategy", "none"]
"""bert-4b with 4 x 512 tokens per microbatch: without compaction, stage 0 of the compute
split needs 29.9 GB (8 microbatches in flight), the memory split's largest stage 26.2 GB."""


def test_the_memory_model_chooses_the_memory_balance_up_front_where_compute_cannot_fit(tmp_path, capsys):
    """On 32 GB devices (27.8 GB usable) `none` cannot fit the compute split by the memory
    model and can fit the memory split: it is planned once, on memory, and fits; the
    planner agrees that the compute split does not fit."""
    out = tmp_path / "none.yaml"
    assert main([*BERT_4B, "--device-memory", "32GB", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("none cannot fit the layers balanced by compute by the memory model (stage 0 keeps at least 29.9 GB "
            "of 27.8 GB usable); planning them balanced by memory") in printed
    assert _planned(printed) == ["none", "recompute", "host-swap", "d2d", "mpress", "megatron-selective"]
    plan = Plan.load(out)
    assert plan.fits and plan.strategy == "none"
    capsys.readouterr()
    by_memory = tmp_path / "memory.yaml"
    assert main([*BERT_4B, "--device-memory", "32GB", "--balance", "memory", "--out", str(by_memory)]) == 0
    assert [(sp.first_layer, sp.end_layer) for sp in plan.stages] == \
        [(sp.first_layer, sp.end_layer) for sp in Plan.load(by_memory).stages]
    assert main([*BERT_4B, "--device-memory", "32GB", "--balance", "compute"]) == 1  # does not fit


def test_the_compute_balance_is_kept_and_planned_once_where_the_memory_model_rules_out_both(capsys):
    """On 28 GB devices (23.8 GB usable) `none` fits neither split by the memory model: the
    compute split is kept and `none` planned once (before, on both splits); the other
    strategies are compared there."""
    assert main([*BERT_4B, "--device-memory", "28GB", "--json"]) == 1
    printed = capsys.readouterr()
    assert ("none cannot fit the layers balanced by compute nor by memory by the memory model (stage 0 keeps at "
            "least 29.9 GB of 23.8 GB usable; balanced by memory, stage 1 keeps at least 26.2 GB") in printed.err
    assert _planned(printed.err) == ["none", "recompute", "host-swap", "d2d", "mpress", "megatron-selective"]
    assert "balanced by memory (--balance memory)" not in printed.err
    stages = json.loads(printed.out)["stages"]
    assert main([*BERT_4B, "--device-memory", "28GB", "--balance", "compute", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["stages"] == stages  # the compute split's
