"""`mpress emulate` end to end: the imbalance it must show, its outputs, its bad input."""

import json

import pytest

from mpress.contract.actions import Action, Kind
from mpress.cli import main
from mpress.hardware.server import load_hardware
from mpress.config.presets import HARDWARE_DIR
from mpress.config.model_config import load_model_config
from mpress.contract.plan import Plan
from mpress.static.plan.evaluate import evaluate, setup_pipeline
from mpress.static.profile.profile import Profile
from tests.support.traces import events_without_args, format_errors, overlaps


def _setup(schedule, model="gpt-5.3b", hardware="dgx1-v100", stages=8, mbs=16):
    return setup_pipeline(load_model_config(model), load_hardware(hardware), schedule=schedule,
                          num_stages=stages, microbatch_size=2, num_microbatches=mbs)


def test_first_stages_need_much_more_than_last_and_pipedream_more_again():
    sync = _setup("1f1b")
    totals = [m.total_bytes for m in sync.memory]
    # stage 0 holds 8 microbatches in flight, stage 6 only 2 (the last stage also holds the head)
    assert totals[0] > 1.5 * totals[-2]
    assert totals[0] > totals[-1]
    assert all(a >= b for a, b in zip(totals[1:-1], totals[2:-1]))
    stash = _setup("pipedream")
    assert stash.memory[0].total_bytes > sync.memory[0].total_bytes
    assert stash.memory[0].stash_bytes == 7 * sync.memory[0].param_bytes
    assert stash.memory[-1].stash_bytes == 0


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream", "gpipe"])
def test_emulated_peak_agrees_with_memory_model_without_compaction(schedule):
    # The emulated peak is the memory model's categories (`StageMemory`) composed layer by
    # layer (`stage_memory.py`), exactly; its `total_bytes` is an estimate that does not
    # compose them (it adds the largest transient of any layer's forward or backward on top
    # of all activations), so it is not compared here. The analytic profile gives the last
    # stage's last layer a 4-byte loss.
    ev = evaluate(_setup(schedule))
    num_mb = ev.setup.schedule.num_microbatches
    for m, c in zip(ev.setup.memory, ev.setup.costs):
        top = c.layers[-1]  # the stage's last layer: the first whose backward runs
        if schedule == "gpipe":
            # at the step's first backward, its last layer's: every microbatch's
            # activations, and of the gradients only that layer's (with its input's) so far
            expected = (m.static_bytes - m.grad_bytes + m.activation_bytes
                        + max(top.memory.backward_peak_bytes, top.memory.input_grad_bytes + top.grad_bytes))
        else:
            # at the last backward with max_in_flight microbatches held (the one after the
            # stage's last forward), its last layer's; of the microbatches done before it,
            # the losses (none but on the last stage) stay until the step ends, and the
            # input gradient of the latest (none on the first stage): Schedule1F1B holds
            # its send until this backward ends (the earlier ones went at the end of their
            # next backward); and one more output (none on the last stage): a warm-up
            # forward's, whose send Schedule1F1B holds until this backward ends
            done = num_mb - m.max_in_flight
            assert done > 0
            expected = (m.static_bytes + m.activation_bytes + top.memory.backward_peak_bytes
                        + done * top.memory.loss_bytes + c.input_bytes + c.output_bytes)
        assert ev.result.peak_bytes[m.device] == expected, m.stage
    assert ev.result.iteration_s > 0 and ev.result.samples_per_s == pytest.approx(32 / ev.result.iteration_s)


def test_gpipe_needs_more_than_1f1b_on_the_first_stage():
    assert _setup("gpipe").memory[0].total_bytes > _setup("1f1b").memory[0].total_bytes


def test_default_run_prints_table_and_verdict(capsys):
    assert main(["emulate"]) == 0
    out = capsys.readouterr().out
    assert "gpt-20.4b on dgx1-v100" in out and "samples/s" in out
    assert "does not fit" in out  # without a plan: that is what `mpress plan` is for
    assert main(["emulate", "--model", "gpt-5.3b"]) == 0
    assert "fits: every device" in capsys.readouterr().out


def test_does_not_fit_is_reported(capsys):
    assert main(["emulate", "--model", "gpt-25.5b", "--schedule", "pipedream"]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_interleaved_adds_stages_sharing_a_device(capsys):
    assert main(["emulate", "--schedule", "interleaved", "--stages", "8", "--ranks", "4",
                 "--model", "gpt-10.3b"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out  # two stages per device


def test_trace_and_plot(tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "m.png"
    assert main(["emulate", "--model", "gpt-tiny", "--hardware", "cpu-local", "--stages", "4",
                 "--microbatches", "8", "--trace", str(trace), "--plot", str(plot)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X") >= 4 * 8 * 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gpt20_plan(tmp_path_factory):
    """The GPT-20.4B plan on a DGX-1 (mpress strategy: recompute, host and D2D swaps,
    optimizer offload), as `mpress plan` writes it."""
    path = tmp_path_factory.mktemp("plan") / "p.yaml"
    assert main(["plan", "--model", "gpt-20.4b", "--hardware", "dgx1-v100", "--strategy", "mpress",
                 "--out", str(path)]) == 0
    return path


def test_plan_trace_has_no_overlapping_slices_and_args_everywhere(gpt20_plan, tmp_path):
    trace = tmp_path / "t.json"
    assert main(["emulate", str(gpt20_plan), "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert overlaps(events) == []
    assert events_without_args(events) == [] and format_errors(events) == []
    copies = [e for e in events if e["ph"] == "X" and e["cat"] == "copy"]
    planned = [Action.parse(a) for actions in Plan.load(gpt20_plan).actions for a in actions.split()]
    copy_kinds = {a.kind.value for a in planned if not a.is_compute and a.kind is not Kind.DR}
    assert copy_kinds and {e["args"]["kind"] for e in copies} == copy_kinds
    assert all(e["args"]["bytes"] > 0 and "tensor" in e["args"] for e in copies)
    assert {e["args"]["action"] for e in copies} == {str(a) for a in planned if a.kind.value in copy_kinds}
    recomputes = [e for e in events if e["ph"] == "X" and e["args"].get("kind") == "RC"]
    assert recomputes and all(e["name"] == f"recompute {e['args']['layer']} mb{e['args']['microbatch']}"
                              for e in recomputes)
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(" #2" in lane for lane in lanes)  # concurrent copies on one channel: lanes of their own
    # every pipeline send is an arrow: 8 stages, 16 microbatches, activations and gradients
    assert sum(1 for e in events if e["ph"] == "s") == 2 * 7 * 16


def test_measured_profile_is_accepted(tmp_path):
    path = tmp_path / "p.yaml"
    assert main(["profile", "--model", "gpt-tiny", "--microbatch-size", "2", "--warmup", "0", "--iters", "1",
                 "--out", str(path)]) == 0
    assert main(["emulate", "--model", "gpt-tiny", "--hardware", "cpu-local", "--stages", "2",
                 "--microbatches", "4", "--profile", str(path)]) == 0


@pytest.mark.parametrize("argv, words", [
    (["--stages", "9"], "9 pipeline ranks need 9 devices"),
    (["--model", "gpt-tiny", "--hardware", "cpu-local", "--devices", "8", "--stages", "7"], "cannot split 6 layers"),
    (["--microbatches", "0"], "--microbatches"),
    (["--microbatch-size", "0"], "--microbatch-size"),
    (["--model", "gpt-999b"], "unknown model"),
    (["--hardware", "dgx-9000"], "unknown hardware"),
    (["--device-memory", "lots"], "--device-memory"),
    (["--schedule", "interleaved", "--stages", "6", "--ranks", "4"], "stages"),
])
def test_bad_input_is_one_line_exit_2(argv, words, capsys):
    assert main(["emulate", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert "Traceback" not in captured.err


def test_profile_of_another_model_is_refused(tmp_path, capsys):
    path = tmp_path / "bert.yaml"
    assert main(["profile", "--model", "bert-tiny", "--warmup", "0", "--iters", "1", "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["emulate", "--model", "gpt-tiny", "--hardware", "cpu-local", "--stages", "2",
                 "--profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert "bert-tiny" in err and len(err.strip().splitlines()) == 1


def test_asymmetric_hardware_file_is_refused(tmp_path, capsys):
    text = (HARDWARE_DIR / "dgx1-v100.yaml").read_text()
    bad = text.replace("[0, 1, 1, 2, 2, 0, 0, 0]", "[0, 1, 1, 2, 2, 1, 0, 0]", 1)
    assert bad != text
    path = tmp_path / "hw.yaml"
    path.write_text(bad)
    assert main(["emulate", "--hardware", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "nvlink_links[0][5]" in err and "symmetric" in err


def test_profile_microbatch_must_match(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    assert main(["profile", "--model", "gpt-tiny", "--microbatch-size", "1", "--warmup", "0", "--iters", "1",
                 "--out", str(path)]) == 0
    assert Profile.load(path).microbatch_size == 1
    assert main(["emulate", "--model", "gpt-tiny", "--hardware", "cpu-local", "--stages", "2",
                 "--microbatch-size", "2", "--profile", str(path)]) == 2


def test_a_plan_recomputing_a_set_no_profile_measured_is_one_line_naming_the_file(tmp_path, capsys):
    """A planned op-level choice edited into one the profile never measured: `mpress
    emulate` refuses it with exit 2, one line naming the plan file, the stage, the
    microbatch, the layer and what it would keep."""
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "gpt-20.4b", "--hardware", "dgx-a100", "--out", str(out)]) == 0
    plan = Plan.load(str(out))
    rules = plan.stages[0].rules
    keep = next(i for i, r in enumerate(rules) if r.technique == "keep" and r.tensor.startswith("layers.0."))
    assert rules[keep + 1].tensor == "layers.0.**" and rules[keep + 1].technique == "recompute"
    edited = [*rules[:keep], type(rules[keep])(**{**rules[keep].__dict__, "tensor": "layers.0.mlp.drop#0"}),
              *rules[keep + 1:]]
    stages = [type(plan.stages[0])(**{**plan.stages[0].__dict__, "rules": edited}), *plan.stages[1:]]
    bad = tmp_path / "bad.yaml"
    Plan(**{**plan.__dict__, "stages": stages}).save(str(bad))
    capsys.readouterr()
    assert main(["emulate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"mpress emulate: error: {bad}: stage 0 microbatch ")
    assert "layers.0 recomputed keeping layers.0.mlp.drop#0 is not a choice its profile measured" in err


def test_a_plan_made_with_memory_balance_emulates_on_its_own_stages(tmp_path, capsys):
    """`mpress emulate PLAN` keeps the plan's stage split; it does not re-split the layers
    by the default (compute) balance and then refuse the plan for not matching."""
    out = tmp_path / "plan.yaml"
    assert main(["plan", "--model", "llama-3-8b", "--hardware", "hgx-h100", "--balance", "memory",
                 "--out", str(out)]) == 0
    plan = Plan.load(str(out))
    compute = setup_pipeline(load_model_config("llama-3-8b"), load_hardware("hgx-h100"), schedule=plan.schedule,
                             num_stages=plan.num_stages, microbatch_size=plan.microbatch_size,
                             num_microbatches=plan.num_microbatches)
    assert [(sp.first_layer, sp.end_layer) for sp in plan.stages] != compute.ranges  # the balances differ here
    capsys.readouterr()
    assert main(["emulate", str(out), "--json"]) == 0
    capsys.readouterr()
    assert main(["emulate", str(out), "--balance", "compute"]) == 2  # another split: refused, one line
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"mpress emulate: error: {out}: stages[0].end_layer: stage 0 holds layers")
