"""Training configuration for the torchrun launcher: `configs/train/<name>.yaml`.

A `TrainConfig` names a model, a pipeline schedule, a memory plan and the data, and
carries the optimizer, checkpoint and logging settings. YAML is only storage: the file
is loaded by `mpress.config.loader.from_dict`, which rejects unknown keys, wrong types and
out-of-range values naming the file and the key; `load_train_config` adds the rules that
involve several fields or the file system (plan file present, model preset known, ...).

Relative paths (`model`, `plan`, `hardware` when paths, `hf_config` unless a built-in
config, `data.path`, `checkpoint.dir`) are relative to the config file's directory, so a
config travels with its plan and data; `load_train_config` returns them absolute. A
`model`/`hardware` value with no `.yaml`/`.yml`/`.json` suffix and no `/` is a preset name.

Rules that need the world size (stages per rank) are checked at launch (`check_world_size`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from mpress.config.loader import check_output_path, from_dict, input_file_problem, load_yaml
from mpress.errors import ConfigError, UserError
from mpress.hardware.cluster import MAX_NODES as MAX_REPLICAS
from mpress.config.presets import HARDWARE_DIR, TRAIN_DIR, resolve_config, train_presets
from mpress.config.limits import (
    MAX_MICROBATCH_SIZE,
    MAX_MICROBATCHES,
    MAX_SEED,
    MAX_STAGES,
    MAX_STEPS,
)
from mpress.config.model_config import ModelConfig, load_model_config
from mpress.models.hf_config import hf_presets, resolve_hf
from mpress.models.hf_model import check_hf_model, load_hf_model
from mpress.models.user import UserModel, check_user_module, load_user_model
from mpress.config.overrides import apply_overrides
from mpress.config.units import MAX_BYTES, parse_bytes
from mpress.config.vocabulary import RUNNABLE_SCHEDULES, V_SCHEDULES, ScheduleName, Strategy, as_word
from mpress.runtime.data_config import TOKENIZER_TRAIN, DataConfig
from mpress.runtime.param_groups import DEFAULT_NO_DECAY, NO_DECAY_CATEGORIES


PLAN_AUTO = "auto"
"""`plan: auto`: rank 0 plans at start-up for `hardware` (and `device_memory`)."""
PLAN_NONE = "none"
"""`plan: none`: no mpress compaction; every tensor stays on its device."""


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """The optimizer every stage runs on its own parameters after each step, its
    learning-rate schedule and gradient clipping (the same on every optimizer path: on
    the device, with offloaded states, on the host)."""

    name: Literal["adam", "adamw"] = "adam"
    """adam (torch.optim.Adam: weight decay as an L2 term added to the gradient) or adamw
    (torch.optim.AdamW: decoupled weight decay); both keep two fp32 states per parameter,
    as the planner assumes."""
    lr: float = field(default=1e-3, metadata={"gt": 0})
    """Peak learning rate (reached after `warmup_steps`)."""
    betas: tuple[float, ...] = (0.9, 0.999)
    """Adam's (beta1, beta2), each in [0, 1)."""
    eps: float = field(default=1e-8, metadata={"gt": 0})
    """Adam's epsilon."""
    weight_decay: float = field(default=0.0, metadata={"min": 0})
    """Weight decay of the parameters `no_decay` does not exempt (adam: L2 penalty added to
    the gradient; adamw: decoupled, p -= lr x weight_decay x p)."""
    no_decay: tuple[str, ...] = DEFAULT_NO_DECAY
    """Parameters that take no weight decay: the categories bias, norm (normalisation
    layers' weights) and embedding (embedding tables and tied copies), and/or globs over
    parameter names (`head.*`, `*.pos.weight`); [] = decay every parameter
    (`mpress/runtime/param_groups.py`)."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning rate after warmup: constant (lr), or cosine/linear decay from lr to
    `min_lr` at the last step (`mpress/runtime/lr_schedule.py`)."""
    warmup_steps: int = field(default=0, metadata={"min": 0, "max": MAX_STEPS})
    """Steps of linear warmup: step k (from 0) < warmup_steps runs at lr x (k + 1) / (warmup_steps + 1)."""
    min_lr: float = field(default=0.0, metadata={"min": 0})
    """Learning rate of the last step under cosine/linear; at most lr."""
    clip_grad_norm: float | None = field(default=None, metadata={"min": 0})
    """Clip gradients to this global 2-norm over every stage (torch's clip_grad_norm_
    rule); also reports the norm and skips steps whose norm is not finite; 0 or null = off."""
    max_skipped_steps: int = field(default=3, metadata={"min": 1, "max": MAX_STEPS})
    """Stop the run after this many consecutive steps skipped for a non-finite loss (or,
    with clipping, gradient norm)."""

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("", "betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if self.min_lr > self.lr:
            raise ConfigError("", "min_lr", f"must be at most lr ({self.lr}), got {self.min_lr}")
        if self.schedule == "constant" and self.min_lr:
            raise ConfigError("", "min_lr", "only with schedule: cosine or linear (constant keeps lr)")
        bad = [p for p in self.no_decay if not p.strip()]
        if bad:
            raise ConfigError("", "no_decay", f"entries must be {', '.join(NO_DECAY_CATEGORIES)} or name globs, "
                                              "got an empty one")

    @property
    def clips(self) -> bool:
        """Whether gradients are clipped (`clip_grad_norm` set and > 0)."""
        return bool(self.clip_grad_norm)


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Per-stage checkpoints of parameters and optimizer state."""

    dir: str | None = None
    """Directory for checkpoints; null = never checkpoint."""
    every_steps: int = field(default=0, metadata={"min": 0, "max": MAX_STEPS})
    """Save every this many steps (and after the last step); 0 = only after the last step."""
    resume: bool = False
    """Resume from the newest checkpoint in `dir` if there is one."""
    keep_last: int = field(default=3, metadata={"min": 1, "max": 1000})
    """Keep only this many newest complete checkpoints in `dir` (older ones are removed
    once a newer one is complete)."""

    def __post_init__(self) -> None:
        if self.resume and self.dir is None:
            raise ConfigError("", "resume", "needs checkpoint.dir (where to resume from)")


HARDWARE_DETECT = "detect"
"""`hardware: detect`: plan for the GPUs pynvml finds on this machine."""


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """One pipeline-parallel training run under torchrun."""

    model: str | None = None
    """Model preset name (configs/models/) or a model YAML path; or `module` instead."""
    module: str | None = None
    """A user's own model instead of a preset: `package.module:factory` (the current
    directory importable), a factory returning `(nn.Module, example_input[, loss_fn])` with
    one microbatch as the example (`mpress/models/user_module.py`); the same factory
    `mpress profile --module` and `mpress plan --module` take."""
    hf_config: str | None = None
    """A Hugging Face `transformers` model instead of a preset: a built-in config's name
    (configs/hf/: gpt2-tiny, llama-tiny, bert-tiny, llama-2-7b), a `config.json` path
    (random weights under `seed`) or a directory with `config.json` and local weights;
    never downloaded (`mpress/models/hf_config.py`). Its layers (embed, each block, final
    norm + head) are found for GPT-2, Llama-style and BERT models; name them with
    `layers` for others. Needs `pip install 'mpress[hf]'`."""
    seq_len: int | None = field(default=None, metadata={"min": 1, "max": 1 << 20})
    """With `hf_config`: tokens per sequence; default: the config's maximum positions."""
    dtype: Literal["fp32", "bf16", "fp16"] | None = None
    """With `hf_config`: the parameters' and activations' precision, fp32 (the default) or
    bf16/fp16 mixed precision with fp32 master weights; a plan must be made for the same
    (`mpress profile --hf-config ... --dtype`)."""
    layers: list[str] | None = None
    """With `module`: the layers stages are made of, as module paths (`*` one name segment,
    e.g. [embed, "blocks.*", head]); default: the module's own (`layer_names()`, an
    `nn.Sequential`, children its forward chains). With `hf_config`: the model's
    [EMBED, BLOCKS, NORM, HEAD] module paths (e.g. [model.embed_tokens, "model.layers.*",
    model.norm, lm_head]), for a family mpress does not know."""
    schedule: ScheduleName = ScheduleName.ONE_F_ONE_B
    """Pipeline schedule: gpipe, 1f1b, interleaved, interleaved-zb, looped-bfs, zbv or dualpipev."""
    num_stages: int | None = field(default=None, metadata={"min": 1, "max": MAX_STAGES})
    """Pipeline stages; default = world size (one per rank; zbv, dualpipev: twice it)."""
    dp: int = field(default=1, metadata={"min": 1, "max": MAX_REPLICAS})
    """Data-parallel replicas of the pipeline: the job's ranks are dp x pp, replica k on
    ranks [k * pp, (k + 1) * pp) (one node each under `mpress train --nnodes dp`), each
    stage's gradients averaged over its replicas (`mpress/runtime/data_parallel.py`).
    Every replica trains on its own microbatch_size x num_microbatches samples a step."""
    microbatch_size: int = field(default=1, metadata={"min": 1, "max": MAX_MICROBATCH_SIZE})
    """Samples per microbatch."""
    num_microbatches: int = field(default=1, metadata={"min": 1, "max": MAX_MICROBATCHES})
    """Microbatches per step; a step trains on microbatch_size x num_microbatches samples."""
    steps: int = field(default=100, metadata={"min": 1, "max": MAX_STEPS})
    """Optimizer steps to run (also the length of `optimizer.schedule`: its last step runs at `min_lr`)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer settings."""
    plan: str = PLAN_NONE
    """Memory plan: a plan file path, `auto` (plan on rank 0 at start-up) or `none` (no compaction)."""
    strategy: Strategy = Strategy.MPRESS
    """With `plan: auto`: the planner strategy (mpress = the cheapest technique per tensor,
    D2D rounds included; the others use one technique only)."""
    hardware: str = "cpu-local"
    """Hardware preset or YAML that `plan: auto` plans for, and that a plan file must have
    been made for; `detect` = the GPUs of this machine as pynvml reports them. On CUDA the
    detected topology must match a named preset's, or training does not start."""
    device_memory: str | int | None = None
    """The per-device memory, e.g. "3MB" (GB = 1e9) or a plain number of bytes (3000000):
    what `plan: auto` plans for (instead of the preset's) and, on CPU runs with any plan
    (`none` included), the capacity of each rank's stand-in device: live bytes over it
    stop the run with an out-of-memory error."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto = nccl where CUDA is available, else gloo."""
    seed: int = field(default=0, metadata={"min": 0, "max": MAX_SEED})
    """Seed of parameter init, synthetic data, masking and dropout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    nvme_dir: str | None = None
    """A local drive's directory for what a plan's `nvme` rules keep there; null: none."""
    dropout: float | None = field(default=None, metadata={"min": 0, "max": 0.99})
    """Override the model preset's dropout probability; null = keep the preset's."""
    trace: str | None = None
    """Write a Perfetto trace of the last step as executed (compute, memory actions, swap copies
    and waits, each CPU device's live bytes) to this JSON path, as `mpress emulate --trace`; null: none."""
    report: str | None = None
    """Also write the end-of-run per-rank figures (predicted and measured peaks, swaps,
    recomputes) as JSON to this path; null = the tables only."""
    metrics: str | None = None
    """Append one JSON line per logged step to this path (step, loss, lr, grad_norm,
    samples/s, tokens/s, MFU, each rank's peak; `mpress/launcher/metrics_log.py`), and
    TensorBoard event files to `tensorboard/` beside it when tensorboard is installed;
    `mpress train` sets it to RUN_DIR/metrics.jsonl; a resume drops the lines of the steps
    it runs again; null = none."""
    profiler_trace: str | None = None
    """Also record the last step under torch.profiler and write its Chrome/Perfetto trace
    (one file per rank, `<path>.rank<N>.json`); null = none."""
    memory_snapshot: str | None = None
    """On CUDA: record the caching allocator's history over the last step and write
    `torch.cuda.memory._snapshot()` as a pickle per rank (`<path>.rank<N>.pickle`, for
    pytorch.org/memory_viz); refused on CPU; null = none."""
    log_every: int = field(default=10, metadata={"min": 1, "max": MAX_STEPS})
    """Log the loss every this many steps (and at the first and last step)."""
    eval_every: int = field(default=0, metadata={"min": 0, "max": MAX_STEPS})
    """With a validation set (data.val_fraction): the validation loss and perplexity every
    this many steps and after the last step, forward-only through the pipeline
    (`mpress/launcher/evaluate.py`); 0 = after the last step only."""
    eval_batches: int = field(default=4, metadata={"min": 1, "max": MAX_STEPS})
    """Global batches (microbatch_size x num_microbatches samples each) of the fixed
    held-out set every evaluation runs over (fewer if the validation set is smaller)."""

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.model, self.module, self.hf_config)) != 1:
            raise ConfigError("", "model", "give a model preset (model:), your own module (module: pkg.mod:factory) "
                                           "or a Hugging Face config (hf_config:), exactly one")
        if self.layers is not None and self.module is None and self.hf_config is None:
            raise ConfigError("", "layers", "only with module: or hf_config: (a preset's layers are fixed)")
        if self.seq_len is not None and self.hf_config is None:
            raise ConfigError("", "seq_len", "only with hf_config: (a preset has its own, a module its example's)")
        if self.dtype is not None and self.hf_config is None:
            raise ConfigError("", "dtype", "only with hf_config: (a preset has its precision, a module its "
                                           "parameters')")
        if self.dropout is not None and self.model is None:
            raise ConfigError("", "dropout", "only with a model preset (your module or HF config sets its own dropout)")
        as_word(self, "schedule", ScheduleName)
        as_word(self, "strategy", Strategy)
        if self.schedule not in RUNNABLE_SCHEDULES:
            raise ConfigError("", "schedule", f"{self.schedule} is planned only; torch's pipelining runs "
                                              f"{', '.join(RUNNABLE_SCHEDULES)}")
        if self.device_memory is not None:
            try:
                parse_bytes(self.device_memory, "device_memory")
            except UserError as exc:
                raise ConfigError("", "device_memory", str(exc).split(": ", 1)[-1]) from None
        if self.strategy is not Strategy.MPRESS and self.plan != PLAN_AUTO:
            raise ConfigError("", "strategy", "only used with plan: auto (remove it, or set plan: auto)")
        if self.num_stages is not None:
            _check_microbatches(self, self.num_stages, "num_microbatches")
        if self.eval_every and not self.data.has_validation:
            raise ConfigError("", "eval_every", "needs a validation set: data.kind: text with data.val_fraction > 0")
        if self.optimizer.warmup_steps > self.steps:
            raise ConfigError("", "optimizer.warmup_steps", f"must be at most steps ({self.steps}), "
                                                            f"got {self.optimizer.warmup_steps}")

    @property
    def device_memory_bytes(self) -> int | None:
        """`device_memory` in bytes (GB = 1e9, GiB = 2**30), or None."""
        return None if self.device_memory is None else parse_bytes(self.device_memory, "device_memory")

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, over every replica."""
        return self.microbatch_size * self.num_microbatches * self.dp


def _check_microbatches(cfg: TrainConfig, num_stages: int, key: str, source: str = "") -> None:
    """1F1B needs at least one microbatch per stage (torch's `Schedule1F1B` refuses fewer)."""
    if cfg.schedule is ScheduleName.ONE_F_ONE_B and cfg.num_microbatches < num_stages:
        raise ConfigError(source, key, f"1f1b needs num_microbatches >= num_stages ({num_stages}), "
                                       f"got {cfg.num_microbatches}")


def _is_path(value: str) -> bool:
    return Path(value).suffix in (".yaml", ".yml", ".json") or "/" in value


def _absolute(value: str, base: Path) -> str:
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def load_train_config(name_or_path: str | Path, overrides: Sequence[tuple[str, str]] = ()) -> TrainConfig:
    """Load a training config: a preset name (configs/train/<name>.yaml) or a YAML path.

    overrides: (dotted key, raw value) pairs set in the file's mapping before it is typed
    (`mpress.config.overrides`: `--steps 10 --optimizer.lr 1e-3`); checked as the file's own values.

    Returns the config with relative paths made absolute (relative to the file's
    directory). Raises `ConfigError` (naming the file and key) for unknown keys, wrong
    types, out-of-range values, an unknown model or hardware preset, a missing plan or
    token file, or more stages than the model has layers.
    """
    path = resolve_config(name_or_path, TRAIN_DIR, "training config")
    source = str(path)
    try:
        cfg = from_dict(TrainConfig, apply_overrides(load_yaml(path), list(overrides), TrainConfig, source), source)
    except ConfigError as exc:  # a bad value given on the command line: name its flag
        if exc.key not in {key for key, _ in overrides}:
            raise
        raise ConfigError(source, f"--{exc.key}", exc.problem) from None
    overridden = {key for key, _ in overrides}  # parse_override_args wrote them with underscores

    def absolute(key: str, value: str) -> str:
        # a path in the file is relative to the file; one given on the command line, to
        # the directory the command runs in
        return _absolute(value, Path.cwd() if key in overridden else path.resolve().parent)

    model = absolute("model", cfg.model) if cfg.model is not None and _is_path(cfg.model) else cfg.model
    hf = cfg.hf_config
    if hf is not None and not (hf in hf_presets() and not Path(absolute("hf_config", hf)).exists()):
        hf = absolute("hf_config", hf)  # a path (a built-in name stays one unless such a path exists)
    hardware = absolute("hardware", cfg.hardware) if _is_path(cfg.hardware) else cfg.hardware
    plan = cfg.plan if cfg.plan in (PLAN_AUTO, PLAN_NONE) else absolute("plan", cfg.plan)
    data = cfg.data
    if data.path is not None:
        data = dataclasses.replace(data, path=absolute("data.path", data.path))
    if data.cache_dir is not None:
        data = dataclasses.replace(data, cache_dir=absolute("data.cache_dir", data.cache_dir))
    if data.tokenizer is not None and data.tokenizer != TOKENIZER_TRAIN:
        data = dataclasses.replace(data, tokenizer=absolute("data.tokenizer", data.tokenizer))
    ckpt = cfg.checkpoint
    if ckpt.dir is not None:
        ckpt = dataclasses.replace(ckpt, dir=absolute("checkpoint.dir", ckpt.dir))
    nvme_dir = absolute("nvme_dir", cfg.nvme_dir) if cfg.nvme_dir is not None else None
    outputs = {k: absolute(k, v) if k in overridden and v is not None else v
               for k, v in (("trace", cfg.trace), ("report", cfg.report), ("profiler_trace", cfg.profiler_trace),
                            ("memory_snapshot", cfg.memory_snapshot), ("metrics", cfg.metrics))}
    cfg = dataclasses.replace(cfg, model=model, hf_config=hf, hardware=hardware, plan=plan, data=data,
                              checkpoint=ckpt, nvme_dir=nvme_dir, **outputs)
    check_outputs(cfg, source)

    if cfg.model is None and cfg.data.kind == "file":
        raise ConfigError(source, "data.kind", "a token file feeds a model preset; a module or HF model trains on "
                                               "synthetic inputs shaped like its example microbatch (kind: synthetic) "
                                               "or on text (kind: text)")
    if cfg.hf_config is not None:
        num_layers = check_hf_model(cfg.hf_config, seq_len=cfg.seq_len, layers=cfg.layers, source=source,
                                    dtype=cfg.dtype or "fp32")
        what = f"{cfg.hf_config} has {num_layers} layers (embed, {num_layers - 2} blocks, head)"
    elif cfg.module is not None:
        num_layers, microbatch_size = check_user_module(cfg.module, cfg.layers, source)
        if cfg.microbatch_size != microbatch_size:
            raise ConfigError(source, "microbatch_size", f"{cfg.module}'s example input is one microbatch of "
                                                         f"{microbatch_size}; set microbatch_size: {microbatch_size}")
        what = f"{cfg.module} has {num_layers} layers"
    else:
        try:
            model_cfg = load_model_config(cfg.model)
        except UserError as exc:
            raise ConfigError(source, "model", str(exc)) from None
        num_layers = model_cfg.num_layers + 2  # embed + blocks + head
        what = f"{cfg.model} has {num_layers} layers (embed, {model_cfg.num_layers} blocks, head)"
    plan_problem = None if cfg.plan in (PLAN_AUTO, PLAN_NONE) else input_file_problem(cfg.plan)
    if plan_problem == "no such file":
        raise ConfigError(source, "plan", f"no such plan file {cfg.plan} (or use auto / none)")
    if plan_problem is not None:  # a directory, a FIFO, a file beyond the size bound: named as such
        raise ConfigError(source, "plan", f"{cfg.plan} {plan_problem}")
    if cfg.plan == PLAN_AUTO and cfg.hardware != HARDWARE_DETECT:
        try:
            resolve_config(cfg.hardware, HARDWARE_DIR, "hardware")
        except UserError as exc:
            raise ConfigError(source, "hardware", str(exc)) from None
    token_problem = input_file_problem(data.path, max_bytes=MAX_BYTES) if data.kind == "file" else None
    if token_problem == "no such file":
        raise ConfigError(source, "data.path", f"no such token file {data.path}")
    if token_problem is not None:
        raise ConfigError(source, "data.path", f"{data.path} {token_problem}")
    if data.kind == "text":
        _check_text_data(cfg, source)
    if cfg.num_stages is not None and cfg.num_stages > num_layers:
        raise ConfigError(source, "num_stages", f"{what}; cannot make {cfg.num_stages} stages")
    return cfg


def _check_text_data(cfg: TrainConfig, source: str) -> None:
    """`data.kind: text` needs a causal model (a preset, an HF model; a module's example
    must be token ids, checked when it is built) and paths that exist."""
    data = cfg.data
    if cfg.model is not None and not load_model_config(cfg.model).causal:
        raise ConfigError(source, "data.kind", f"text trains a causal decoder (gpt, llama); {cfg.model} is a masked "
                                               "LM (use kind: synthetic or file)")
    if cfg.hf_config is not None and resolve_hf(cfg.hf_config, seq_len=cfg.seq_len, layers=cfg.layers,
                                                dtype=cfg.dtype or "fp32").masked_lm:
        raise ConfigError(source, "data.kind", f"text trains a causal LM; {cfg.hf_config} is a masked LM "
                                               "(use kind: synthetic)")
    if data.path is not None and not Path(data.path).exists():
        raise ConfigError(source, "data.path", f"no such file or directory {data.path}")
    if data.tokenizer != TOKENIZER_TRAIN and not Path(data.tokenizer).exists():
        raise ConfigError(source, "data.tokenizer", f"no such tokenizer.json or model directory {data.tokenizer} "
                                                    f"(or use {TOKENIZER_TRAIN})")


def check_outputs(cfg: TrainConfig, source: str) -> None:
    """Refuse, before any rank trains, output paths that cannot be written: files, prefixes of
    per-rank files, directories (`checkpoint.dir`, `nvme_dir`). `ConfigError` naming the key."""
    outputs = [("trace", cfg.trace, "file"), ("report", cfg.report, "file"), ("metrics", cfg.metrics, "file"),
               ("profiler_trace", cfg.profiler_trace, "prefix"), ("memory_snapshot", cfg.memory_snapshot, "prefix"),
               ("checkpoint.dir", cfg.checkpoint.dir, "dir"), ("nvme_dir", cfg.nvme_dir, "dir")]
    for key, path, kind in outputs:
        if path is not None:
            check_output_path(path, source, key, kind)  # type: ignore[arg-type]


def model_config(cfg: TrainConfig) -> ModelConfig | UserModel:
    """What `cfg` trains: the model preset `cfg.model` with `cfg.dropout` applied when it is
    set, the user's module `cfg.module` (its factory called under `cfg.seed`), or the
    Hugging Face model `cfg.hf_config` (built under `cfg.seed`, an `HFModel`)."""
    if cfg.module is not None:
        user = load_user_model(cfg.module, layers=cfg.layers, seed=cfg.seed)
        user.text = cfg.data.kind == "text"  # a language model: the loss is against the next tokens
        return user
    if cfg.hf_config is not None:
        return load_hf_model(cfg.hf_config, microbatch_size=cfg.microbatch_size, seq_len=cfg.seq_len,
                             layers=cfg.layers, seed=cfg.seed, dtype=cfg.dtype or "fp32")
    model = load_model_config(cfg.model)
    return model if cfg.dropout is None else dataclasses.replace(model, dropout=cfg.dropout)


def resolve_backend(cfg: TrainConfig) -> str:
    """"gloo" or "nccl": `auto` picks nccl where CUDA is available; nccl without CUDA is a `UserError`."""
    cuda = torch.cuda.is_available()
    if cfg.backend == "auto":
        return "nccl" if cuda else "gloo"
    if cfg.backend == "nccl" and not cuda:
        raise UserError("backend: nccl needs CUDA GPUs and none is available (use backend: gloo or auto)")
    return cfg.backend


def pipeline_ranks(cfg: TrainConfig, world_size: int) -> int:
    """The ranks of one replica's pipeline when the launch has `world_size` ranks: world =
    dp x pp. Raises `UserError` naming `dp` when the world is not a whole number of replicas."""
    if world_size % cfg.dp:
        raise UserError(f"dp: {world_size} ranks cannot hold {cfg.dp} replicas of the pipeline (the world size must "
                        f"be dp x pp, a multiple of dp; change dp or the ranks)")
    return world_size // cfg.dp


LOOPED = (ScheduleName.INTERLEAVED, ScheduleName.INTERLEAVED_ZB, ScheduleName.LOOPED_BFS)  # stages round-robin


def check_world_size(cfg: TrainConfig, world_size: int) -> int:
    """Check the config against the launch's world size (every replica's ranks: dp x pp);
    return the number of stages.

    GPipe and 1F1B run one stage per rank; the `LOOPED` schedules (interleaved-zb with
    one stage per rank is ZB-H1) a whole number per rank, the interleaved ones with
    num_microbatches in whole rounds; zbv and dualpipev two per rank (the default), and
    dualpipev num_microbatches >= num_stages. Raises `UserError` naming the key to change.
    """
    if world_size < 1:
        raise UserError(f"world size must be >= 1, got {world_size}")
    world_size = pipeline_ranks(cfg, world_size)
    v, looped = cfg.schedule in V_SCHEDULES, cfg.schedule in LOOPED
    num_stages = cfg.num_stages if cfg.num_stages is not None else world_size * (2 if v else 1)
    if num_stages != world_size * (2 if v else 1) and not looped or looped and num_stages % world_size:
        runs, need = ("two stages per rank", "be twice") if v else ("stages round-robin", "be a multiple of") \
            if looped else ("one stage per rank", "equal")
        raise UserError(f"num_stages: {cfg.schedule} runs {runs}, so num_stages ({num_stages}) must {need} the "
                        f"world size ({world_size}); change num_stages or --nproc-per-node")
    rounds = max(1, cfg.num_microbatches // world_size)  # torch's interleaved schedules' rounds
    if cfg.schedule in (ScheduleName.INTERLEAVED, ScheduleName.INTERLEAVED_ZB) and cfg.num_microbatches % rounds \
            or cfg.schedule is ScheduleName.DUALPIPEV and cfg.num_microbatches < num_stages:
        need = f"at least num_stages ({num_stages})" if v else f"a multiple of the world size ({world_size})"
        raise UserError(f"num_microbatches: {cfg.schedule} needs {need}, got {cfg.num_microbatches}")
    try:
        _check_microbatches(cfg, num_stages, "num_microbatches")
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    return num_stages


__all__ = [
    "PLAN_AUTO",
    "PLAN_NONE",
    "TRAIN_DIR",
    "CheckpointConfig",
    "DataConfig",
    "OptimizerConfig",
    "TrainConfig",
    "check_world_size",
    "pipeline_ranks",
    "load_train_config",
    "model_config",
    "resolve_backend",
    "train_presets",
]
