"""metrics.jsonl (`mpress.launcher.metrics_log`): the rates of a step, the writer's lines
and its truncation on resume (pure), then a short 2-rank `mpress train` whose metrics file
has every field and, after a resume from an earlier step, each step exactly once."""

from __future__ import annotations

import json
import shutil

import pytest

from mpress.launcher.metrics_log import MetricsLog, Throughput, rates_text, read_metrics, truncate_after
from tests.support.documented import run_documented


def test_rates_of_a_step():
    t = Throughput(samples_per_step=8, tokens_per_sample=16, model_flops_per_step=4e9, peak_flops_per_s=1e11)
    r = t.rates(0.5)
    assert r == {"samples_per_s": 16.0, "tokens_per_s": 256.0, "mfu": pytest.approx(0.08)}
    assert rates_text(r) == "256 tokens/s  16.0 samples/s  MFU 8.00%"
    bare = Throughput(samples_per_step=8, tokens_per_sample=None, model_flops_per_step=None, peak_flops_per_s=1e11)
    assert bare.rates(2.0) == {"samples_per_s": 4.0}


def test_writer_lines_accept_extra_fields_and_nulls(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl", tensorboard=False)
    log.write({"step": 0, "loss": 2.5, "lr": 1e-3, "peak_bytes": {"0": 10, "1": 20}})
    log.write({"step": 1, "loss": float("nan"), "val_loss": 2.0})
    log.close()
    assert read_metrics(tmp_path / "m.jsonl") == [
        {"step": 0, "loss": 2.5, "lr": 1e-3, "peak_bytes": {"0": 10, "1": 20}},
        {"step": 1, "loss": None, "val_loss": 2.0}]


def test_no_path_writes_nothing(tmp_path):
    log = MetricsLog(None)
    log.write({"step": 0, "loss": 1.0})
    log.close()
    assert list(tmp_path.iterdir()) == []


def test_resume_keeps_earlier_steps_only(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(5)) + '{"step": 5, "lo')
    assert truncate_after(path, 3) == 3
    log = MetricsLog(path, first_step=3, tensorboard=False)
    log.write({"step": 3, "loss": 0.5})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2, 3]
    MetricsLog(path, first_step=0, tensorboard=False).close()  # a fresh run in the same place
    assert path.read_text() == ""


def test_malformed_lines_are_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 has no integer step"):
        read_metrics(path)


def test_tensorboard_events_when_installed(tmp_path):
    pytest.importorskip("tensorboard")
    log = MetricsLog(tmp_path / "m.jsonl")
    assert log.has_tensorboard
    log.write({"step": 0, "loss": 1.0, "peak_bytes": {"0": 5}})
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_two_rank_run_writes_every_field_and_resumes_without_duplicates(tmp_path):
    train = ["train", "--config", "gpt-tiny-plain", "--nproc-per-node", "2", "--num-stages", "2",
             "--num-microbatches", "2", "--log-every", "1", "--optimizer.clip-grad-norm", "1.0",
             "--optimizer.schedule", "cosine", "--optimizer.warmup-steps", "1",
             "--checkpoint.dir", "ckpt", "--checkpoint.every-steps", "2"]
    code, out, err = run_documented([*train, "--steps", "3", "--run-dir", "run"], cwd=tmp_path)
    assert code == 0, out[-2000:] + err[-2000:]
    assert "tokens/s" in out and "MFU" in out
    metrics = tmp_path / "run" / "metrics.jsonl"
    first = read_metrics(metrics)
    assert [r["step"] for r in first] == [0, 1, 2]
    for r in first:
        assert set(r) >= {"step", "loss", "lr", "grad_norm", "step_s", "samples_per_s", "tokens_per_s", "mfu",
                          "peak_bytes"}
        assert set(r["peak_bytes"]) == {"0", "1"} and all(v > 0 for v in r["peak_bytes"].values())
        assert 0 < r["mfu"] < 1 and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32)
    shutil.rmtree(tmp_path / "ckpt" / "step000002")  # resume at step 2: the line of step 2 is rewritten
    code, out, err = run_documented([*train, "--steps", "4", "--run-dir", "run", "--checkpoint.resume", "true"],
                                    cwd=tmp_path)
    assert code == 0, out[-2000:] + err[-2000:]
    assert "resuming at step 2" in out
    again = read_metrics(metrics)
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    assert again[:2] == first[:2]
    # the same step again from the same weights, data and generators: the same loss
    assert again[2]["loss"] == first[2]["loss"]


def test_start_plan_carries_the_profiles_flops_and_the_presets_peak():
    """MFU's figures come from what the static half computed for the plan: the analytic
    profile's forward + backward FLOPs of a microbatch and cpu-local's fp32 peak."""
    from mpress.launcher.startup import plan_for
    from mpress.runtime.train_config import load_train_config, model_config
    from mpress.static.profile.analytic import layer_backward_flops, layer_forward_flops

    cfg = load_train_config("gpt-tiny-plain", [("num_stages", "2"), ("num_microbatches", "2")])
    model = model_config(cfg)
    start = plan_for(cfg, model, 2, 2)
    b = cfg.microbatch_size
    expected = sum(layer_forward_flops(model, i, b) + layer_backward_flops(model, i, b)
                   for i in range(model.num_layers + 2))
    assert start.model_flops_per_microbatch == pytest.approx(expected) and expected > 0
    assert start.peak_flops_per_device == 50.0e9  # configs/hardware/cpu-local.yaml, fp32
