"""`examples/own_loop/train.py` -- a plain torch pipelining loop with its own AdamW,
LambdaLR warmup + cosine and `torch.distributed.checkpoint` checkpoints, and the mpress
lines added -- launched with torchrun on 2 and 4 CPU ranks under plans with every
technique: host swap, recompute, D2D swap (4 ranks), optimizer-state offload to the
host (and to a peer, 4 ranks), the optimizer step on the host. Its parameters are
`torch.equal` to the same loop without mpress and to `mpress train` on the same model,
plan and optimizer settings (`examples/own_loop/train.yaml`), and a run resumed from its
own checkpoint equals the uninterrupted one, optimizer states included.

The loop without mpress splits the layers evenly whatever the world size; a pipeline
split changes no arithmetic, so one run of it (2 ranks) is the reference for both world
sizes. Launches: that one, and per world size the loop under mpress and `mpress train`
(plus the resumed run on 2 ranks)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from mpress.contract.actions import Kind
from mpress.launcher.checkpoints.checkpoint import read_step
from tests.support.documented import REPO, run_documented
from tests.support.plans import OWN_LOOP, d2d_rule, own_loop_plan, rule

pytestmark = pytest.mark.slow

STEPS = 6


def torchrun(cwd: Path, world: int, *args: str) -> str:
    """`torchrun --standalone --nproc-per-node WORLD train.py ARGS` as README.md shows it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), "train.py", "--steps", str(STEPS), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, f"train.py {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def read_dcp(path: Path) -> dict:
    dcp_to_torch_save(path, path.with_suffix(".pt"))
    return torch.load(path.with_suffix(".pt"), weights_only=False)


def losses(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


def example_dir(tmp: Path) -> Path:
    for f in ("model.py", "train.py", "train.yaml"):
        shutil.copy(OWN_LOOP / f, tmp / f)
    return tmp


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[dict, list[str]]:
    """The loop without mpress on 2 ranks: its final checkpoint and its loss lines."""
    cwd = example_dir(tmp_path_factory.mktemp("plain"))
    out = torchrun(cwd, 2, "--out", "plain")
    return read_dcp(cwd / "plain" / "final"), losses(out)


PLANS = {
    2: {"rules": {0: [rule("optim:*", "host"), rule("blocks.0.**", "host"), rule("blocks.1.**", "recompute")]},
        "host_step": (1,)},
    4: {"rules": {0: [rule("optim:*", "host"), rule("blocks.0.**", "host")],
                  1: [d2d_rule("blocks.1.**", {3: 1.0}), rule("blocks.2.**", "recompute"),
                      d2d_rule("optim:*", {3: 1.0})],
                  2: [rule("blocks.3.**", "host")]},
        "host_step": (2,), "peer_pools": {3: 1 << 20}},
}


@pytest.mark.parametrize("world", [2, 4])
def test_own_loop_equals_plain_loop_and_mpress_train(tmp_path, plain, world):
    cwd = example_dir(tmp_path)
    plan = own_loop_plan(cwd / "plan.yaml", world, **PLANS[world])
    kinds = {a.kind for r in range(world) for a in plan.program(r)}
    want = {Kind.SO, Kind.SI, Kind.DR, Kind.RC, Kind.OI, Kind.OO} | ({Kind.DO, Kind.DI} if world == 4 else set())
    assert want <= kinds, kinds - want  # every technique, optimizer offload included
    assert any(sp.optimizer_step.value == "host" for sp in plan.stages)

    resume = ["--save-every", "3"] if world == 2 else []
    out = torchrun(cwd, world, "--plan", "plan.yaml", "--out", "own", *resume)
    code, train_out, err = run_documented(["train", "--config", "train.yaml", "--nproc-per-node", str(world),
                                           "--checkpoint.dir", "ckpt"], cwd=cwd)
    assert code == 0, f"mpress train failed:\n{train_out[-3000:]}\n{err[-3000:]}"

    own = read_dcp(cwd / "own" / "final")
    reference, reference_losses = plain
    trained = read_step(cwd / "ckpt" / f"step{STEPS - 1:06d}")
    assert len(own["model"]) == 40 and own["model"].keys() == reference["model"].keys() == trained["model"].keys()
    for name, value in own["model"].items():
        assert torch.equal(value, reference["model"][name]), f"{name}: the loop without mpress differs"
        assert torch.equal(value, trained["model"][name]), f"{name}: mpress train differs"
    for name, state in trained["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(own["optim"]["state"][name][key], value), f"{name} {key}: mpress train differs"
    assert losses(out) == reference_losses and len(reference_losses) == STEPS

    if world == 2:  # resumed from the loop's own checkpoint after step 3
        again = torchrun(cwd, world, "--plan", "plan.yaml", "--out", "resumed", "--resume", "own/step3")
        assert losses(again) == reference_losses[3:]
        resumed = read_dcp(cwd / "resumed" / "final")
        for name, value in own["model"].items():
            assert torch.equal(resumed["model"][name], value), f"{name}: the resumed run differs"
        for name, state in own["optim"]["state"].items():
            for key, value in state.items():
                assert torch.equal(resumed["optim"]["state"][name][key], value), f"{name} {key}: resumed differs"
        assert resumed["scheduler"] == own["scheduler"] and resumed["step"] == STEPS
