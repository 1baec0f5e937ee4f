"""Plans that cannot be right are refused before anything runs (issue 17): a plan file
with one defect each is one line naming the file, the plan's key and what is allowed,
exit status 2, through `mpress emulate PLAN` and through training start-up (the check
rank 0 makes before any rank builds a stage, `mpress.launcher.startup.plan_for`); and
every plan the shipped training configs train under passes the same check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml

from mpress.cli import main
from mpress.errors import UserError
from mpress.launcher.startup import load_checked_plan, plan_for
from mpress.runtime.train_config import TRAIN_DIR, check_world_size, load_train_config, model_config
from mpress.config.vocabulary import ScheduleName
from tests.support.plans import one_line

ROOT = Path(__file__).resolve().parents[2]
MB = 10**6
PB = 10**15


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-stage plan for gpt-tiny on a 5 MB cpu-local device: it offloads the optimizer
    states to the host and recomputes layers (a plan a single process trains under)."""
    path = tmp_path_factory.mktemp("plan") / "tiny.yaml"
    assert main(["plan", "--model", "gpt-tiny", "--hardware", "cpu-local", "--devices", "1", "--device-memory",
                 "5MB", "--stages", "1", "--microbatch-size", "4", "--microbatches", "4", "--out", str(path)]) == 0
    rules = yaml.safe_load(path.read_text())["stages"][0]["rules"]
    assert {r["technique"] for r in rules} >= {"host", "recompute"}, rules
    return path


def train_config(tmp_path: Path, plan: Path, **overrides: object) -> Path:
    """A one-process training config for `plan` (the job the fixture's plan is for)."""
    data = {"model": "gpt-tiny", "schedule": "1f1b", "num_stages": 1, "microbatch_size": 4, "num_microbatches": 4,
            "steps": 1, "plan": str(plan), "hardware": "cpu-local", "device_memory": "5MB", "seed": 0, **overrides}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start_up(config: Path) -> None:
    """What rank 0 of a one-process job does with the plan before training."""
    cfg = load_train_config(config)
    plan_for(cfg, model_config(cfg), check_world_size(cfg, 1), 1)


def defective(tmp_path: Path, plan_file: Path, edit: Callable[[dict], None]) -> Path:
    data = yaml.safe_load(plan_file.read_text())
    edit(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def add_rule(tensor: str, technique: str = "host") -> Callable[[dict], None]:
    return lambda d: d["stages"][0]["rules"].append({"tensor": tensor, "technique": technique})


def set_stage(**values: object) -> Callable[[dict], None]:
    return lambda d: d["stages"][0].update(values)


def on_device(device: int) -> Callable[[dict], None]:
    return lambda d: (d.update(stage_to_device=[device]), d["stages"][0].update(device=device))


def last_rule(key: str) -> Callable[[dict], str]:
    return lambda d: f"stages[0].rules[{len(d['stages'][0]['rules']) - 1}].{key}"


# (name, edit, key (or a function of the edited plan giving it), words in the line)
DEFECTS = [
    ("rule for a layer the stage lacks", add_rule("layers.9.**"), last_rule("tensor"),
     ["names 'layers.9.**', which the profile does not have", "its layers embed, layers.0"]),
    ("rule for a saved tensor the layer lacks", add_rule("layers.0.attn#99"), last_rule("tensor"),
     ["names 'layers.0.attn#99'", "MODULE#INDEX"]),
    ("optimizer rule for a layer the stage lacks", add_rule("optim:layers.9"), last_rule("tensor"),
     ["names 'optim:layers.9'", "optim:LAYER"]),
    ("stage on a device the hardware lacks", on_device(3), "stage_to_device[0]",
     ["stage 0 is mapped to device 3", "cpu-local has devices 0..0"]),
    ("1 PB peer pool", set_stage(peer_pool_bytes=PB), "stages[0].peer_pool_bytes",
     ["peer pool of 1e+03 TB exceeds its memory", "5 MB usable"]),
    ("1 PB pinned host pool", set_stage(pinned_host_bytes=PB), "stages[0].pinned_host_bytes",
     ["pinned host pools need 1e+03 TB", "of host memory"]),
    ("peer quota on a device the hardware lacks", set_stage(peer_quotas=[{"device": 2, "quota_bytes": MB}]),
     "stages[0].peer_quotas[0].device", ["quota on device 2, which is not an NVLink neighbour"]),
    ("stripes to a device the hardware lacks",
     lambda d: d["stages"][0]["rules"].insert(0, {"tensor": "layers.0.**", "technique": "d2d",
                                                  "stripes": [{"device": 1, "fraction": 1.0}]}),
     "stages[0].rules[0].stripes[0].device", ["stripes to device 1, which is not an NVLink neighbour"]),
    ("a billion microbatches", lambda d: d.update(num_microbatches=10**9), "num_microbatches", ["<= 4096"]),
    ("NaN iteration time", lambda d: d.update(predicted_iteration_s=float("nan")), "predicted_iteration_s",
     ["must be a finite number"]),
    ("1e400-byte pool", set_stage(pinned_host_bytes="1e400"), "stages[0].pinned_host_bytes", ["1e400"]),
    ("model fingerprint of another model", lambda d: d.update(model_fingerprint="0123456789abcdef"),
     "model_fingerprint", ["made for model 'gpt-tiny', not 'gpt-tiny'", "fingerprints differ: the plan's 0123456789abcdef"]),
]


@pytest.mark.parametrize("name, edit, key, words", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_a_defective_plan_is_one_line_exit_2_in_emulate(plan_file, tmp_path, capsys, name, edit, key, words):
    bad = defective(tmp_path, plan_file, edit)
    key = key(yaml.safe_load(bad.read_text())) if callable(key) else key
    assert main(["emulate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"mpress emulate: error: {bad}: {key}: "), err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("name, edit, key, words", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_a_defective_plan_is_refused_at_training_start_up(plan_file, tmp_path, name, edit, key, words):
    bad = defective(tmp_path, plan_file, edit)
    key = key(yaml.safe_load(bad.read_text())) if callable(key) else key
    with pytest.raises(UserError) as info:
        start_up(train_config(tmp_path, bad))
    msg = one_line(info.value)
    assert msg.startswith(f"{bad}: {key}: ") and all(w in msg for w in words), msg


# The job's own mismatches: only training has a job (emulate takes its shape from the plan,
# and its model and hardware from the plan unless flags name others).
JOB_DEFECTS = [
    ("plan for gpipe, job runs 1f1b", lambda d: d.update(schedule="gpipe"), {}, "schedule",
     ["made for gpipe, 1 stages, 4 x 4 microbatches; this pipeline is 1f1b, 1 stages, 4 x 4"]),
    ("plan for 8 microbatches, job runs 4", lambda d: d.update(num_microbatches=8), {}, "num_microbatches",
     ["8 x 4 microbatches; this pipeline is 1f1b, 1 stages, 4 x 4"]),
    ("plan for another microbatch size", lambda d: None, {"microbatch_size": 2}, "microbatch_size",
     ["4 x 4 microbatches; this pipeline is 1f1b, 1 stages, 4 x 2"]),
    ("plan for another model", lambda d: None, {"model": "gpt-small"}, "model_fingerprint",
     ["made for model 'gpt-tiny'", "not 'gpt-small'"]),
    ("last stage ends before the model's last layer", set_stage(end_layer=5), {}, "stages[0].end_layer",
     ["must be 6: the last stage ends at the model's last layer"]),
    ("plan for hardware the job does not run on", lambda d: d.update(hardware="dgx9"), {}, "hardware",
     ["made for 'dgx9', not 'cpu-local'"]),
]


@pytest.mark.parametrize("name, edit, config, key, words", JOB_DEFECTS, ids=[d[0] for d in JOB_DEFECTS])
def test_a_plan_for_another_job_is_refused_at_training_start_up(plan_file, tmp_path, name, edit, config, key,
                                                                  words):
    bad = defective(tmp_path, plan_file, edit)
    with pytest.raises(UserError) as info:
        start_up(train_config(tmp_path, bad, **config))
    msg = one_line(info.value)
    assert msg.startswith(f"{bad}: {key}: ") and all(w in msg for w in words), msg


def test_emulate_refuses_a_plan_for_another_pipeline_by_key(plan_file, capsys):
    assert main(["emulate", str(plan_file), "--microbatches", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mpress emulate: error: {plan_file}: num_microbatches: made for 1f1b, 1 stages, 4 x 4 "
                   "microbatches; this pipeline is 1f1b, 1 stages, 8 x 4"), err


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_documented_commands_refuse_a_rule_for_a_missing_layer(plan_file, tmp_path):
    bad = defective(tmp_path, plan_file, add_rule("layers.9.**"))
    rule = len(yaml.safe_load(bad.read_text())["stages"][0]["rules"]) - 1
    where = f"{bad}: stages[0].rules[{rule}].tensor: stage 0 rule {rule} names 'layers.9.**'"
    res = _run("mpress", "emulate", str(bad))
    assert res.returncode == 2 and res.stderr.startswith(f"mpress emulate: error: {where}"), res.stderr
    assert len(res.stderr.splitlines()) == 1, res.stderr
    res = _run("mpress.train", "--config", str(train_config(tmp_path, bad)))
    assert res.returncode == 2 and res.stderr.startswith(f"mpress.train: error: {where}"), res.stderr
    assert len(res.stderr.splitlines()) == 1 and "step 0" not in res.stdout, res.stderr


def test_the_fixture_plan_itself_is_accepted(plan_file, tmp_path, capsys):
    assert main(["emulate", str(plan_file)]) == 0
    start_up(train_config(tmp_path, plan_file))


SHIPPED = sorted(p for p in TRAIN_DIR.glob("*.yaml") if yaml.safe_load(p.read_text()).get("plan") != "none")


@pytest.mark.parametrize("config", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_configs_plan_passes_the_check(config, tmp_path, capsys):
    """No false refusals: the plan each shipped config trains under (planned at start-up,
    and checked there), written to a file, passes the start-up check of a plan file and
    `mpress emulate`."""
    cfg = load_train_config(config)
    world = cfg.num_stages // 2 if cfg.schedule is ScheduleName.INTERLEAVED else cfg.num_stages
    num_stages = check_world_size(cfg, world)
    start = plan_for(cfg, model_config(cfg), num_stages, world)
    assert start.plan is not None
    path = tmp_path / "plan.yaml"
    start.plan.save(path)
    data = yaml.safe_load(config.read_text())
    data.update(plan=str(path), strategy="mpress")
    own = tmp_path / "train.yaml"
    own.write_text(yaml.safe_dump(data))
    file_cfg = load_train_config(own)
    plan, _setup = load_checked_plan(file_cfg, model_config(file_cfg), num_stages, world)
    assert plan == start.plan
    assert main(["emulate", str(path)]) == 0, capsys.readouterr().err
