"""Malformed training configs through `mpress train`: each is refused by the launcher
before any rank starts, in one line naming the file and key, exit status 2."""

from __future__ import annotations

import pytest

from tests.malformed.cases import DEEP, Case, check, laughs, params

BASE = "model: gpt-tiny\nnum_stages: 1\nsteps: 1\n"
TRAIN = ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "1")


def cfg(case_id: str, extra: str, *words: str, subprocess: bool = False, base: str = BASE,
        files: dict | None = None, mkdirs: tuple[str, ...] = ()) -> Case:
    return Case(case_id, TRAIN, {"train.yaml": base + extra, **(files or {})}, ("train.yaml", *words),
                subprocess=subprocess, mkdirs=mkdirs)


CASES = [
    cfg("lr-nan", "optimizer: {lr: .nan}\n", "optimizer.lr", "finite", subprocess=True),
    cfg("lr-inf", "optimizer: {lr: .inf}\n", "optimizer.lr", "finite"),
    cfg("lr-negative", "optimizer: {lr: -1.0}\n", "optimizer.lr", "> 0"),
    cfg("lr-word", "optimizer: {lr: fast}\n", "optimizer.lr"),
    cfg("eps-nan", "optimizer: {eps: .nan}\n", "optimizer.eps"),
    cfg("betas-one", "optimizer: {betas: [0.9]}\n", "optimizer.betas"),
    cfg("betas-nan", "optimizer: {betas: [.nan, 0.9]}\n", "optimizer.betas[0]"),
    cfg("optimizer-sgd", "optimizer: {name: sgd}\n", "optimizer.name"),
    cfg("schedule-unknown", "optimizer: {schedule: step}\n", "optimizer.schedule"),
    cfg("min-lr-over-lr", "optimizer: {schedule: cosine, min_lr: 1.0}\n", "optimizer.min_lr", "at most lr"),
    cfg("warmup-over-steps", "optimizer: {warmup_steps: 2}\n", "optimizer.warmup_steps", "at most steps"),
    cfg("clip-negative", "optimizer: {clip_grad_norm: -1}\n", "optimizer.clip_grad_norm", ">= 0"),
    cfg("microbatches-1e9", "num_microbatches: 1e9\n", "num_microbatches", subprocess=True),
    cfg("microbatches-zero", "num_microbatches: 0\n", "num_microbatches"),
    cfg("microbatch-size-fraction", "microbatch_size: 2.5\n", "microbatch_size"),
    cfg("microbatch-size-huge", "microbatch_size: 1.0e12\n", "microbatch_size"),
    cfg("steps-word", "steps: many\n", "steps", base="model: gpt-tiny\nnum_stages: 1\n"),
    cfg("steps-1e30", "steps: 1e30\n", "steps", base="model: gpt-tiny\nnum_stages: 1\n"),
    cfg("steps-beyond-int64", "steps: 100000000000000000000000\n", "steps", base="model: gpt-tiny\nnum_stages: 1\n"),
    cfg("seed-negative", "seed: -1\n", "seed"),
    cfg("seed-huge", "seed: 1e30\n", "seed"),
    cfg("num-stages-huge", "num_stages: 1e6\n", "num_stages", base="model: gpt-tiny\nsteps: 1\n"),
    cfg("num-stages-over-layers", "num_stages: 9\n", "num_stages", base="model: gpt-tiny\nsteps: 1\n"),
    cfg("unknown-key", "stpes: 3\n", "stpes", "unknown key"),
    cfg("unknown-nested-key", "optimizer: {learning_rate: 0.1}\n", "optimizer.learning_rate"),
    cfg("duplicate-key", "steps: 2\n", "duplicate key 'steps'", "line 4", subprocess=True),
    cfg("alias-bomb", laughs(), "aliases expand", subprocess=True),
    cfg("recursive-alias", "x: &x [*x]\n", "recursive alias"),
    cfg("deep-nesting", "x: " + DEEP + "\n", "nested too deeply"),
    Case("top-level-list", TRAIN, {"train.yaml": "- model\n- gpt-tiny\n"}, ("train.yaml", "mapping")),
    Case("empty-file", TRAIN, {"train.yaml": ""}, ("train.yaml", "mapping")),
    cfg("yaml-syntax", "optimizer: {lr: [1\n", "not valid YAML"),
    Case("binary-file", TRAIN, {"train.yaml": b"\xff\xfe\x00garbage\x81"}, ("train.yaml", "not valid YAML"),
         subprocess=True),
    Case("missing-model", TRAIN, {"train.yaml": "steps: 1\n"}, ("train.yaml", "model", "exactly one")),
    Case("unknown-model", TRAIN, {"train.yaml": "model: gpt-nano\nnum_stages: 1\n"}, ("model", "gpt-nano")),
    cfg("unknown-schedule", "schedule: zigzag\n", "schedule"),
    cfg("plan-file-missing", "plan: nowhere.yaml\n", "plan", "nowhere.yaml"),
    cfg("device-memory-1e400", "device_memory: 1e400\n", "device_memory", subprocess=True),
    cfg("device-memory-word", "device_memory: lots\n", "device_memory"),
    cfg("device-memory-negative", "device_memory: -1GB\n", "device_memory"),
    cfg("device-memory-nan", "device_memory: .nan\n", "device_memory"),
    cfg("trace-under-a-file", "trace: afile/trace.json\n", "trace", "afile", files={"afile": "x"}),
    cfg("report-is-a-directory", "report: adir\n", "report", "adir", mkdirs=("adir",)),
    cfg("checkpoint-dir-is-a-file", "checkpoint: {dir: afile}\n", "checkpoint.dir", "afile",
        files={"afile": "x"}, subprocess=True),
    cfg("profiler-trace-under-a-file", "profiler_trace: afile/prof\n", "profiler_trace", files={"afile": "x"}),
    cfg("memory-snapshot-under-a-file", "memory_snapshot: afile/snap\n", "memory_snapshot", files={"afile": "x"}),
    cfg("resume-without-dir", "checkpoint: {resume: true}\n", "checkpoint.resume"),
    cfg("checkpoint-every-negative", "checkpoint: {dir: ck, every_steps: -3}\n", "checkpoint.every_steps"),
    cfg("dropout-above-one", "dropout: 2\n", "dropout"),
    cfg("data-file-without-path", "data: {kind: file}\n", "data.path"),
    cfg("data-path-missing", "data: {kind: file, path: none.bin}\n", "data.path"),
    cfg("mask-prob-nan", "data: {mask_prob: .nan}\n", "data.mask_prob"),
    cfg("branching-zero", "data: {branching: 0}\n", "data.branching"),
    cfg("strategy-without-auto", "strategy: d2d\n", "strategy"),
    cfg("hardware-unknown", "plan: auto\nhardware: dgx-9000\n", "hardware"),
    cfg("backend-mpi", "backend: mpi\n", "backend"),
    cfg("log-every-zero", "log_every: 0\n", "log_every"),
    Case("config-missing", ("train", "--config", "{d}/none.yaml", "--nproc-per-node", "1"), {}, ("none.yaml",)),
    Case("config-is-a-directory", ("train", "--config", "{d}/adir.yaml", "--nproc-per-node", "1"), {},
         ("adir.yaml",), mkdirs=("adir.yaml",)),
    Case("model-yaml-bad", TRAIN, {"train.yaml": "model: my-model.yaml\nnum_stages: 1\n",
                                   "my-model.yaml": "name: m\nfamily: gpt\nnum_layers: 2\nhidden_size: .nan\n"
                                                    "num_heads: 2\nseq_len: 8\nvocab_size: 16\n"},
         ("model", "hidden_size")),
]


@pytest.mark.parametrize("case", params(CASES))
def test_malformed_train_config(case: Case, tmp_path) -> None:
    check(case, tmp_path)
