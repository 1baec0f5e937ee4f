"""Training configs: presets load, bad files are refused naming file and key, world-size
and backend rules."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mpress.errors import ConfigError, UserError
from mpress.runtime.train_config import (
    TRAIN_DIR,
    DataConfig,
    TrainConfig,
    check_world_size,
    load_train_config,
    model_config,
    resolve_backend,
    train_presets,
)


def write(tmp_path: Path, text: str, name: str = "train.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def refused(path: Path, key: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    assert info.value.key == key, str(info.value)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("name", ["gpt-tiny-mixed", "gpt-tiny-plain", "gpt-tiny-gpipe", "bert-tiny-1f1b"])
def test_shipped_presets_load(name):
    assert name in train_presets()
    cfg = load_train_config(name)
    assert cfg == load_train_config(TRAIN_DIR / f"{name}.yaml")
    assert cfg.num_stages == 4 and cfg.microbatch_size == 4 and cfg.num_microbatches == 8
    assert 60 <= cfg.steps <= 100
    assert check_world_size(cfg, 4) == 4
    assert model_config(cfg).num_layers == 4


def test_mixed_and_plain_differ_only_in_plan():
    mixed = load_train_config("gpt-tiny-mixed")
    plain = load_train_config("gpt-tiny-plain")
    assert mixed.schedule == "1f1b" and mixed.plan == "auto" and mixed.hardware == "cpu-local"
    assert mixed.device_memory_bytes == 3_450_000
    assert plain.plan == "none" and plain.device_memory is None
    assert (mixed.model, mixed.schedule, mixed.steps, mixed.seed, mixed.optimizer, mixed.data) == \
        (plain.model, plain.schedule, plain.steps, plain.seed, plain.optimizer, plain.data)
    assert load_train_config("gpt-tiny-gpipe").schedule == "gpipe"
    bert = load_train_config("bert-tiny-1f1b")
    assert model_config(bert).family == "bert"


def test_adamw_schedule_and_clipping_keys(tmp_path):
    cfg = load_train_config(write(tmp_path, "model: gpt-tiny\nsteps: 20\noptimizer: {name: adamw, weight_decay: 0.1, "
                                            "no_decay: [bias, 'head.*'], schedule: cosine, warmup_steps: 5, "
                                            "min_lr: 1.0e-5, clip_grad_norm: 1.0, max_skipped_steps: 2}\n"))
    opt = cfg.optimizer
    assert (opt.name, opt.no_decay, opt.schedule, opt.warmup_steps, opt.min_lr) == \
        ("adamw", ("bias", "head.*"), "cosine", 5, 1e-5)
    assert opt.clips and opt.max_skipped_steps == 2
    plain = load_train_config(write(tmp_path, "model: gpt-tiny\n")).optimizer
    assert plain.no_decay == ("bias", "norm", "embedding") and plain.schedule == "constant"
    assert not plain.clips and plain.warmup_steps == 0


def test_defaults(tmp_path):
    cfg = load_train_config(write(tmp_path, "model: gpt-tiny\n"))
    assert cfg.schedule == "1f1b" and cfg.num_stages is None and cfg.plan == "none"
    assert cfg.optimizer.name == "adam" and cfg.optimizer.betas == (0.9, 0.999)
    assert cfg.data.kind == "synthetic" and cfg.checkpoint.dir is None and cfg.backend == "auto"
    assert cfg.global_batch_size == 1 and cfg.device_memory_bytes is None


@pytest.mark.parametrize("text, key", [
    ("model: gpt-tiny\nstepz: 3\n", "stepz"),
    ("model: gpt-tiny\noptimizer: {lr: 0.1, momentum: 0.9}\n", "optimizer.momentum"),
    ("model: gpt-tiny\ndata: {kind: synthetic, shuffle: true}\n", "data.shuffle"),
    ("model: gpt-tiny\ncheckpoint: {dir: x, every: 3}\n", "checkpoint.every"),
    ("schedule: 1f1b\n", "model"),
    ("model: gpt-tiny\nsteps: many\n", "steps"),
    ("model: gpt-tiny\nsteps: 0\n", "steps"),
    ("model: gpt-tiny\nnum_stages: 0\n", "num_stages"),
    ("model: gpt-tiny\nschedule: pipedream\n", "schedule"),
    ("model: gpt-tiny\nbackend: mpi\n", "backend"),
    ("model: gpt-tiny\noptimizer: {name: sgd}\n", "optimizer.name"),
    ("model: gpt-tiny\noptimizer: {lr: 0}\n", "optimizer.lr"),
    ("model: gpt-tiny\noptimizer: {betas: [0.9]}\n", "optimizer.betas"),
    ("model: gpt-tiny\noptimizer: {betas: [0.9, 1.0]}\n", "optimizer.betas"),
    ("model: gpt-tiny\noptimizer: {schedule: step}\n", "optimizer.schedule"),
    ("model: gpt-tiny\noptimizer: {schedule: cosine, min_lr: 0.1}\n", "optimizer.min_lr"),
    ("model: gpt-tiny\noptimizer: {min_lr: 1.0e-5}\n", "optimizer.min_lr"),
    ("model: gpt-tiny\noptimizer: {warmup_steps: -1}\n", "optimizer.warmup_steps"),
    ("model: gpt-tiny\nsteps: 4\noptimizer: {warmup_steps: 5}\n", "optimizer.warmup_steps"),
    ("model: gpt-tiny\noptimizer: {clip_grad_norm: -1}\n", "optimizer.clip_grad_norm"),
    ("model: gpt-tiny\noptimizer: {clip_grad_norm: .nan}\n", "optimizer.clip_grad_norm"),
    ("model: gpt-tiny\noptimizer: {max_skipped_steps: 0}\n", "optimizer.max_skipped_steps"),
    ("model: gpt-tiny\noptimizer: {no_decay: bias}\n", "optimizer.no_decay"),
    ("model: gpt-tiny\noptimizer: {no_decay: [bias, '']}\n", "optimizer.no_decay"),
    ("model: gpt-tiny\ndropout: 1.5\n", "dropout"),
    ("model: gpt-tiny\nlog_every: 0\n", "log_every"),
    ("model: gpt-tiny\ndata: {kind: file}\n", "data.path"),
    ("model: gpt-tiny\ndata: {kind: synthetic, path: x.bin}\n", "data.path"),
    ("model: gpt-tiny\ndata: {kind: file, path: nowhere.bin}\n", "data.path"),
    ("model: gpt-tiny\ndata: {token_dtype: int8}\n", "data.token_dtype"),
    ("model: gpt-tiny\ncheckpoint: {resume: true}\n", "checkpoint.resume"),
    ("model: gpt-tiny\nplan: missing-plan.yaml\n", "plan"),
    ("model: gpt-tiny\nplan: auto\ndevice_memory: lots\n", "device_memory"),
    ("model: gpt-tiny\ndevice_memory: 0MB\n", "device_memory"),
    ("model: gpt-tiny\nplan: auto\nhardware: no-such-box\n", "hardware"),
    ("model: gpt-nano\n", "model"),
    ("model: gpt-tiny\nnum_stages: 7\nnum_microbatches: 8\n", "num_stages"),
    ("model: gpt-tiny\nnum_stages: 4\nnum_microbatches: 2\n", "num_microbatches"),
])
def test_bad_config_names_file_and_key(tmp_path, text, key):
    refused(write(tmp_path, text), key)


@pytest.mark.parametrize("text, key", [
    ("model: gpt-tiny\noptimizer: {lr: .nan}\n", "optimizer.lr"),
    ("model: gpt-tiny\noptimizer: {lr: .inf}\n", "optimizer.lr"),
    ("model: gpt-tiny\noptimizer: {eps: .nan}\n", "optimizer.eps"),
    ("model: gpt-tiny\noptimizer: {weight_decay: .nan}\n", "optimizer.weight_decay"),
    ("model: gpt-tiny\noptimizer: {betas: [.nan, 0.9]}\n", "optimizer.betas[0]"),
    ("model: gpt-tiny\ndata: {mask_prob: .nan}\n", "data.mask_prob"),
    ("model: gpt-tiny\ndropout: .nan\n", "dropout"),
    ("model: gpt-tiny\nnum_microbatches: 1e9\n", "num_microbatches"),
    ("model: gpt-tiny\nmicrobatch_size: 1e9\n", "microbatch_size"),
    ("model: gpt-tiny\nnum_stages: 1e6\n", "num_stages"),
    ("model: gpt-tiny\nsteps: 1e30\n", "steps"),
    ("model: gpt-tiny\nseed: 1e30\n", "seed"),
    ("model: gpt-tiny\nseed: 4294967296\n", "seed"),
    ("model: gpt-tiny\ndata: {branching: 1e9}\n", "data.branching"),
    ("model: gpt-tiny\ncheckpoint: {dir: ck, every_steps: 1e30}\n", "checkpoint.every_steps"),
    ("model: gpt-tiny\ndevice_memory: 1e400\n", "device_memory"),
    ("model: gpt-tiny\ndevice_memory: 1e400GB\n", "device_memory"),
])
def test_numbers_are_finite_and_bounded(tmp_path, text, key):
    # NaN passed `gt: 0`; 1e9 microbatches ran 45 s into a SystemError; 1e400 bytes was an OverflowError
    refused(write(tmp_path, text), key)


@pytest.mark.parametrize("key, text", [
    ("checkpoint.dir", "checkpoint: {dir: afile}"),
    ("checkpoint.dir", "checkpoint: {dir: afile/sub}"),
    ("trace", "trace: afile/trace.json"),
    ("trace", "trace: adir"),
    ("report", "report: adir"),
    ("report", "report: afile/report.json"),
    ("profiler_trace", "profiler_trace: afile/prof"),
    ("memory_snapshot", "memory_snapshot: afile/snap"),
    ("metrics", "metrics: afile/metrics.jsonl"),
    ("metrics", "metrics: adir"),
])
def test_output_paths_are_checked_at_load(tmp_path, monkeypatch, key, text):
    # a checkpoint.dir that is a file was found only after the whole run had trained
    monkeypatch.chdir(tmp_path)  # trace and report are relative to the working directory
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "adir").mkdir()
    e = refused(write(tmp_path, f"model: gpt-tiny\n{text}\n"), key)
    assert "afile" in e.problem or "adir" in e.problem


def test_writable_output_paths_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_train_config(write(tmp_path, "model: gpt-tiny\ntrace: out/t.json\nreport: r.json\n"
                                            "checkpoint: {dir: ckpt/run1}\nprofiler_trace: out/prof\n"))
    assert cfg.trace == "out/t.json" and Path(cfg.checkpoint.dir) == tmp_path / "ckpt" / "run1"


def test_duplicate_key_in_a_train_config(tmp_path):
    path = write(tmp_path, "model: gpt-tiny\nsteps: 5\nsteps: 6\n")
    with pytest.raises(UserError) as info:
        load_train_config(path)
    assert str(path) in str(info.value) and "duplicate key 'steps'" in str(info.value)


@pytest.mark.parametrize("plan", ["none", "auto"])
def test_device_memory_goes_with_any_plan(tmp_path, plan):
    """With `plan: none` it is the capacity of each CPU rank's stand-in device."""
    cfg = load_train_config(write(tmp_path, f"model: gpt-tiny\nplan: {plan}\ndevice_memory: 3MB\n"))
    assert cfg.device_memory_bytes == 3_000_000


def test_bad_yaml_and_unknown_preset(tmp_path):
    with pytest.raises(UserError, match="not valid YAML"):
        load_train_config(write(tmp_path, "model: [gpt-tiny\n"))
    with pytest.raises(UserError, match="unknown training config 'nope'.*gpt-tiny-mixed"):
        load_train_config("nope")


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    (conf / "plans").mkdir(parents=True)
    (conf / "plans" / "p.yaml").write_text("{}\n")
    (conf / "tokens.txt").write_text("1 2 3\n")
    model_text = (TRAIN_DIR.parent / "models" / "gpt-tiny.yaml").read_text()
    (conf / "my-model.yaml").write_text(model_text)
    path = write(conf, "model: my-model.yaml\nplan: plans/p.yaml\n"
                       "data: {kind: file, path: tokens.txt}\ncheckpoint: {dir: ckpt}\n")
    monkeypatch.chdir(tmp_path)  # somewhere else: the paths must not depend on the CWD
    cfg = load_train_config(path)
    assert Path(cfg.plan) == (conf / "plans" / "p.yaml").resolve()
    assert Path(cfg.data.path) == (conf / "tokens.txt").resolve()
    assert Path(cfg.checkpoint.dir) == (conf / "ckpt").resolve()
    assert Path(cfg.model) == (conf / "my-model.yaml").resolve()
    assert model_config(cfg).name == "gpt-tiny"


def test_dropout_override(tmp_path):
    cfg = load_train_config(write(tmp_path, "model: gpt-tiny\ndropout: 0.0\n"))
    assert model_config(cfg).dropout == 0.0
    assert model_config(load_train_config(write(tmp_path, "model: gpt-tiny\n", "b.yaml"))).dropout == 0.1


def test_check_world_size():
    cfg = TrainConfig(model="gpt-tiny", num_microbatches=8)
    assert check_world_size(cfg, 4) == 4  # default: one stage per rank
    with pytest.raises(UserError, match="num_stages.*world size"):
        check_world_size(TrainConfig(model="gpt-tiny", num_stages=4, num_microbatches=8), 2)
    with pytest.raises(UserError, match="num_microbatches"):
        check_world_size(TrainConfig(model="gpt-tiny", num_microbatches=2), 4)
    assert check_world_size(TrainConfig(model="gpt-tiny", schedule="gpipe", num_microbatches=2), 4) == 4
    inter = TrainConfig(model="gpt-tiny", schedule="interleaved", num_stages=6, num_microbatches=8)
    assert check_world_size(inter, 2) == 6
    assert check_world_size(inter, 3) == 6
    with pytest.raises(UserError, match="num_stages.*multiple of the world size \\(4\\)"):
        check_world_size(inter, 4)
    odd = TrainConfig(model="gpt-tiny", schedule="interleaved", num_stages=4, num_microbatches=5)
    with pytest.raises(UserError, match="num_microbatches: interleaved"):
        check_world_size(odd, 2)
    with pytest.raises(UserError):
        check_world_size(cfg, 0)


def test_the_split_backward_and_v_schedules_take_their_stage_counts():
    """ZB-H1 is interleaved-zb with one stage per rank; zbv and dualpipev run two per rank
    in a V (the default); each count that cannot run is one line naming the key."""
    assert check_world_size(TrainConfig(model="gpt-tiny", schedule="interleaved-zb", num_microbatches=4), 2) == 2
    assert check_world_size(TrainConfig(model="gpt-tiny", schedule="zbv", num_microbatches=4), 2) == 4
    assert check_world_size(TrainConfig(model="gpt-tiny", schedule="looped-bfs", num_stages=4,
                                        num_microbatches=4), 2) == 4
    for schedule, stages, message in [
            ("zbv", 6, (r"^num_stages: zbv runs two stages per rank, so num_stages \(6\) must be twice the world "
                        r"size \(2\); change num_stages or --nproc-per-node$")),
            ("looped-bfs", 3, (r"^num_stages: looped-bfs runs stages round-robin, so num_stages \(3\) must be a "
                               r"multiple of the world size \(2\)"))]:
        with pytest.raises(UserError, match=message):
            check_world_size(TrainConfig(model="gpt-tiny", schedule=schedule, num_stages=stages,
                                         num_microbatches=4), 2)
    with pytest.raises(UserError, match=r"^num_microbatches: dualpipev needs at least num_stages \(4\), got 2$"):
        check_world_size(TrainConfig(model="gpt-tiny", schedule="dualpipev", num_microbatches=2), 2)
    with pytest.raises(UserError, match=r"^num_microbatches: interleaved-zb needs a multiple of the world size"):
        check_world_size(TrainConfig(model="gpt-tiny", schedule="interleaved-zb", num_stages=4,
                                     num_microbatches=5), 2)


def test_resolve_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend(TrainConfig(model="gpt-tiny")) == "gloo"
    assert resolve_backend(TrainConfig(model="gpt-tiny", backend="gloo")) == "gloo"
    with pytest.raises(UserError, match="nccl needs CUDA"):
        resolve_backend(TrainConfig(model="gpt-tiny", backend="nccl"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend(TrainConfig(model="gpt-tiny")) == "nccl"
    assert resolve_backend(TrainConfig(model="gpt-tiny", backend="gloo")) == "gloo"


def test_the_mixed_example_mixes_host_swap_and_recompute():
    """The main example (the tiny GPT on text, 512-id vocabulary): its first two stages need
    more than the budget without mpress, and the plan compacts them with a mix -- the
    first stage swaps activations to the host AND recomputes layers, and optimizer states
    go to the host; the plan fits the budget."""
    from mpress.launcher.startup import plan_for

    cfg = load_train_config("gpt-tiny-mixed")
    budget = cfg.device_memory_bytes
    start = plan_for(cfg, model_config(cfg), 4, 4)
    assert start.plan is not None and start.plan.fits and len(start.ranges) == 4
    plain = plan_for(dataclasses.replace(cfg, plan="none"), model_config(cfg), 4, 4)
    assert [peak > budget for peak in plain.predicted_peak_bytes] == [True, True, False, False], \
        plain.predicted_peak_bytes
    assert all(peak <= budget for peak in start.predicted_peak_bytes), start.predicted_peak_bytes
    techniques = [{(r.tensor.split(":")[0] if ":" in r.tensor else "activation", str(r.technique)) for r in sp.rules}
                  for sp in start.plan.stages]
    assert {("activation", "host"), ("activation", "recompute")} <= techniques[0], techniques
    assert ("optim", "host") in techniques[0] | techniques[1], techniques


def test_the_mixed_example_on_gpt_tiny_plans_a_mix_of_techniques():
    """The main example's schedule on gpt-tiny (256 ids, synthetic data) at 2.5 MB: every
    stage compacts, with more than one technique; the plan fits the budget."""
    from mpress.launcher.startup import plan_for

    cfg = dataclasses.replace(load_train_config("gpt-tiny-mixed"), model="gpt-tiny", device_memory="2.5MB",
                              data=DataConfig(), eval_every=0)
    budget = cfg.device_memory_bytes
    start = plan_for(cfg, model_config(cfg), 4, 4)
    plan = start.plan
    assert plan is not None and plan.fits and len(start.ranges) == 4
    plain = plan_for(dataclasses.replace(cfg, plan="none"), model_config(cfg), 4, 4)
    assert all(peak > budget for peak in plain.predicted_peak_bytes), plain.predicted_peak_bytes
    assert all(peak <= budget for peak in start.predicted_peak_bytes), start.predicted_peak_bytes
    assert all(sp.rules for sp in plan.stages)
    techniques = {(r.tensor.split(":")[0] if ":" in r.tensor else "activation", r.technique)
                  for sp in plan.stages for r in sp.rules}
    assert ("optim", "host") in techniques and ("activation", "recompute") in techniques


def test_the_d2d_example_needs_peer_memory_and_finds_it():
    """Stage 0 of the D2D example needs more than its budget without mpress; the d2d
    strategy fits every rank by parking data in other ranks' spare memory."""
    from mpress.launcher.startup import plan_for

    cfg = load_train_config("gpt-tiny-d2d")
    budget = cfg.device_memory_bytes
    plain = plan_for(dataclasses.replace(cfg, plan="none", strategy="mpress"), model_config(cfg), 4, 4)
    assert plain.predicted_peak_bytes[0] > budget, plain.predicted_peak_bytes
    start = plan_for(cfg, model_config(cfg), 4, 4)
    assert start.plan is not None and start.plan.fits
    assert all(peak <= budget for peak in start.predicted_peak_bytes), start.predicted_peak_bytes
    rules = [r for sp in start.plan.stages for r in sp.rules]
    assert rules and all(r.technique == "d2d" for r in rules)
    assert any(sp.peer_pool_bytes for sp in start.plan.stages)


# ---- a user's own module ---------------------------------------------------------------------

MODULE = "examples.own_model.mymodel:make"


def test_a_module_config_names_its_factory_and_layers(tmp_path):
    cfg = load_train_config(write(tmp_path, f"module: {MODULE}\nlayers: [embed, 'blocks.*', head]\n"
                                            "microbatch_size: 2\nnum_stages: 4\nnum_microbatches: 4\n"))
    assert cfg.module == MODULE and cfg.model is None and cfg.layers == ["embed", "blocks.*", "head"]


@pytest.mark.parametrize("text,key,says", [
    ("steps: 3\n", "model", "exactly one"),
    (f"model: gpt-tiny\nmodule: {MODULE}\n", "model", "exactly one"),
    ("model: gpt-tiny\nlayers: [embed]\n", "layers", "only with module"),
    (f"module: {MODULE}\nmicrobatch_size: 2\n", "layers", "does not chain"),
    (f"module: {MODULE}\nlayers: ['blockz.*']\nmicrobatch_size: 2\n", "layers", "names no module"),
    (f"module: {MODULE}\nlayers: [embed, 'blocks.*', head]\n", "microbatch_size", "set microbatch_size: 2"),
    (f"module: {MODULE}\nlayers: [embed, 'blocks.*', head]\nmicrobatch_size: 2\nnum_stages: 9\n"
     "num_microbatches: 9\n", "num_stages", "has 8 layers"),
    (f"module: {MODULE}\nlayers: [embed, 'blocks.*', head]\nmicrobatch_size: 2\ndropout: 0.1\n", "dropout", "preset"),
    (f"module: {MODULE}\nlayers: [embed, 'blocks.*', head]\nmicrobatch_size: 2\n"
     "data: {kind: file, path: t.txt}\n", "data.kind", "synthetic"),
    ("module: nosuchpkg.mod:make\n", "module", "no module 'nosuchpkg'"),
])
def test_a_bad_module_config_is_one_line_naming_the_key(tmp_path, text, key, says):
    (tmp_path / "t.txt").write_text("1 2 3\n")
    e = refused(write(tmp_path, text), key)
    assert says in str(e) and "\n" not in str(e)


def test_a_path_given_on_the_command_line_is_relative_to_where_the_command_runs(tmp_path, monkeypatch):
    """In the file a path is relative to the file; as an override (`--checkpoint.dir c`),
    to the working directory, as any command-line path."""
    conf = tmp_path / "conf"
    conf.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path = write(conf, "model: gpt-tiny\ncheckpoint: {dir: in-file}\n")
    assert Path(load_train_config(path).checkpoint.dir) == conf / "in-file"
    cfg = load_train_config(path, overrides=[("checkpoint.dir", "on-cli")])
    assert Path(cfg.checkpoint.dir) == work / "on-cli"
