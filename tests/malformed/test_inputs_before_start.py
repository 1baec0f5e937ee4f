"""Inputs checked before anything starts (issue 34): each is one line on stderr and exit
status 2 through the documented command, before a rank is launched, a plan is searched or
a file is opened that could hold the command (a FIFO) or fill its memory (100 MB).

Numbers (HF config sizes, process counts, tile counts), sizes as plain integers (taken),
the environment of `python -m mpress.train`, YAML bounded in bytes and in values, output
paths (unwritable, wrong suffix) and file types (a directory, a FIFO where a file goes),
and `mpress` without a command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mpress.config import loader
from mpress.config.limits import MAX_FILE_BYTES
from mpress.runtime.train_config import load_train_config
from tests.malformed.cases import Case, check, params
from tests.support.documented import REPO, one_line_error, run_documented

HF = json.loads((REPO / "configs" / "hf" / "gpt2-tiny.json").read_text())
HF_TRAIN = "hf_config: config.json\nschedule: 1f1b\nnum_stages: 2\nmicrobatch_size: 2\nnum_microbatches: 2\nsteps: 1\n"
TRAIN = ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "1")
ONE_STAGE = "model: gpt-tiny\nnum_stages: 1\nsteps: 1\n"
HUGE = 100 * 2**20
PLAN = ("plan", "--model", "gpt-tiny", "--hardware", "cpu-local")


def hf(key: str, value: object) -> Case:
    data = {**HF, key: value}
    return Case(f"hf-{key}-{value}", ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "2"),
                {"train.yaml": HF_TRAIN, "config.json": json.dumps(data)},
                ("config.json", f"{key} must be a positive integer, got {value}"))


def huge(text_of: Callable[[int], str]) -> Callable[[Path], str]:
    """A file of HUGE bytes, written by the case (100 MB: only its size is ever read)."""
    return lambda d: text_of(HUGE)


CASES = [
    hf("n_layer", -1), hf("n_layer", 0), hf("n_embd", 0), hf("n_head", -2), hf("vocab_size", 0),
    hf("n_positions", -1),
    Case("rdzv-endpoint-on-one-node", (*TRAIN, "--rdzv-endpoint", "node0:29500"), {"train.yaml": ONE_STAGE},
         ("--rdzv-endpoint: node0:29500 joins machines, and --nnodes is 1",)),
    Case("nproc-per-node-1000", ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "1000"),
         {"train.yaml": "model: gpt-tiny\nsteps: 1\n"}, ("--nproc-per-node: 1000 ranks on this machine's", "cores")),
    Case("tiles-100000", ("tile", "--tiles", "100000"), {},
         ("--tiles 100000: segment features.0..features.30 can be cut into 128 tiles per side at most",
          "give --tiles 128 or fewer")),
    Case("config-of-100MB-comments", TRAIN, {"train.yaml": huge(lambda n: "#" * (n - 1) + "\n")},
         ("train.yaml", f"more than the {MAX_FILE_BYTES} (4 MiB)"), subprocess=True),
    Case("config-of-a-100MB-list", TRAIN, {"train.yaml": huge(lambda n: ONE_STAGE + "x:\n" + "- 1\n" * (n // 4))},
         ("train.yaml", "bytes, more than the")),
    Case("100MB-flow-list-under-an-unknown-key", TRAIN,
         {"train.yaml": huge(lambda n: ONE_STAGE + "flows: [" + "1, " * (n // 3) + "]\n")}, ("train.yaml", "4 MiB")),
    Case("plan-out-under-proc", (*PLAN, "--out", "/proc/mpress/plan.yaml"), {},
         ("--out", "cannot write under /proc", "making a file there failed")),
    Case("plan-out-txt", (*PLAN, "--out", "{d}/plan.txt"), {},
         ("--out", "plan.txt: unknown format '.txt'; give a name ending in .yaml, .yml, .json")),
    Case("config-a-directory", ("train", "--config", "{d}/cfg.yaml"), {}, ("cfg.yaml: is a directory, not a file",),
         mkdirs=("cfg.yaml",)),
    Case("plan-a-directory", TRAIN, {"train.yaml": ONE_STAGE + "plan: plans\n"},
         ("train.yaml: plan:", "plans is a directory, not a file"), mkdirs=("plans",)),
    Case("token-file-a-directory", TRAIN, {"train.yaml": ONE_STAGE + "data: {kind: file, path: tokens}\n"},
         ("train.yaml: data.path:", "tokens is a directory, not a file"), mkdirs=("tokens",)),
    Case("emulate-a-directory", ("emulate", "{d}/plans"), {}, ("plans: is a directory, not a file",),
         mkdirs=("plans",)),
]


@pytest.mark.parametrize("case", params(CASES))
def test_refused_in_one_line_before_anything_starts(case, tmp_path):
    check(case, tmp_path)


@pytest.mark.parametrize("argv, where", [
    (("train", "--config", "{d}/fifo.yaml"), "fifo.yaml"),
    (("emulate", "{d}/fifo.yaml"), "fifo.yaml"),
    (("plan", "--model", "gpt-tiny", "--out", "{d}/fifo.yaml"), "--out"),
    (("train", "--config", "{d}/train.yaml", "--nproc-per-node", "1"), "train.yaml: plan:"),
])
def test_a_fifo_is_named_as_such_and_never_opened(tmp_path, argv, where):
    """Opening a FIFO to read or write waits for the other end: the type is read first.
    A real process, so a hang would end in the documented runner's timeout."""
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "train.yaml").write_text(ONE_STAGE + "plan: fifo.yaml\n")
    code, _out, err = run_documented([a.replace("{d}", str(tmp_path)) for a in argv], cwd=tmp_path)
    one_line_error(code, err, where, "is a FIFO (named pipe), not a file")


def test_a_yaml_document_of_too_many_values_is_refused_before_values_are_built(tmp_path, monkeypatch):
    """The bound on values (scalars, lists, mappings) is counted while composing: a list of
    more than the bound under an unknown key ends there, naming its line."""
    monkeypatch.setattr(loader, "MAX_YAML_NODES", 1000)
    path = tmp_path / "train.yaml"
    path.write_text(ONE_STAGE + "flows: [" + "1, " * 2000 + "]\n")
    code, _out, err = run_documented(["train", "--config", str(path)], in_process=True)
    one_line_error(code, err, "train.yaml", "line 4: more than 1000 values in one document")


@pytest.mark.parametrize("value", ["2500000", "2.5e6", "2500000B", "2.5MB"])
def test_device_memory_as_a_plain_number_of_bytes_is_taken(tmp_path, value):
    path = tmp_path / "train.yaml"
    path.write_text(f"model: gpt-tiny\nplan: auto\nnum_stages: 1\ndevice_memory: {value}\n")
    assert load_train_config(path).device_memory_bytes == 2_500_000
    assert load_train_config("gpt-tiny-mixed", [("device_memory", value)]).device_memory_bytes == 2_500_000


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE=abc without RANK: set both (as torchrun does) or neither"),
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc': expected a whole number >= 0"),
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5: must be in 0..1 with WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc': expected a whole number >= 0"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR='' MASTER_PORT='': a world of 2 ranks meets at rank 0's host"),
])
def test_a_bad_rank_environment_is_one_line_never_a_wait(tmp_path, env, words):
    """`python -m mpress.train` under a torchrun-like environment: checked before the
    rendezvous, which would wait for ranks that never come (or trace back)."""
    path = tmp_path / "train.yaml"
    path.write_text(ONE_STAGE)
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "mpress.train", "--config", str(path)], capture_output=True,
                          text=True, timeout=120, check=False, env={**clean, "PYTHONPATH": str(REPO), **env}, cwd=tmp_path)
    one_line_error(done.returncode, done.stderr, f"mpress.train: error: {words}")
    assert "step 0" not in done.stdout


def test_mpress_without_a_command_prints_a_short_usage(tmp_path):
    code, out, err = run_documented([], cwd=tmp_path)
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: mpress COMMAND"), err
    assert "plan" in lines[0] and "train" in lines[0] and "`mpress --help`" in lines[1], err


def test_the_config_size_bound_leaves_room_for_the_largest_plans(tmp_path):
    """No false refusal: a plan for gpt-20.4b on dgx1-v100 (8 stages, 16 microbatches) is
    read, and is far inside both bounds."""
    path = tmp_path / "plan.yaml"
    code, _out, err = run_documented(["plan", "--model", "gpt-20.4b", "--hardware", "dgx1-v100", "--microbatches",
                                      "16", "--out", str(path)], in_process=True)
    assert code == 0, err
    assert path.stat().st_size * 50 < MAX_FILE_BYTES
    assert loader.load_yaml(path)["model"] == "gpt-20.4b"

