"""The pipeline a command lays a model out on: its flags, and the values flags leave unset.

`mpress emulate`, `mpress plan` and `mpress maxsize` take the same pipeline flags
(`add_pipeline_args`) and resolve what is left unset the same way (`resolve_shape`):

- a plan given to `emulate` sets everything it records;
- `--setting NAME` (`mpress.config.settings`): its schedule, stages, microbatch size and count
  are the defaults of those flags, its precision replaces the model's, its first model
  and first server are the defaults of `--model` and `--hardware`;
- the schedule defaults to 1f1b;
- stages: one per device of the hardware (`--num-devices` included), at most one per
  layer of the model; interleaved: ranks = devices (at most half the layers), two stages
  per rank;
- microbatch size: the profile's (`--profile`, `--module`), else 1, the train config's
  default, which is also `mpress profile`'s;
- microbatches: `MICROBATCHES_PER_RANK` per pipeline rank (1F1B needs at least one per
  stage; 16 on an 8-GPU server).

`PipelineShape.describe()` says the resolved values and where each came from; the
commands print it, and `--json` carries it as `settings`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mpress.commands.flags import add_flag
from mpress.errors import UserError
from mpress.hardware.server import Hardware, load_hardware
from mpress.config.presets import hardware_presets
from mpress.config.model_config import DTYPE_BYTES, ModelConfig, model_presets
from mpress.contract.plan import Plan
from mpress.config.settings import Setting, load_setting, setting_presets
from mpress.hardware.cluster import NodeReplicas, Sharding, replica_devices
from mpress.static.emulate.dp_reduction import exposed_reduction_s, reduction_busy_s
from mpress.static.memory.data_parallel import DataParallel, replicas_of
from mpress.static.emulate.emulator_result import EmulatorResult
from mpress.static.profile.profile import Profile, model_for_profile
from mpress.config.units import fmt_bytes, fmt_seconds
from mpress.config.vocabulary import V_SCHEDULES, ScheduleName

if TYPE_CHECKING:  # the pipeline's setup loads torch (the analytic profile): only when a command runs
    from mpress.static.plan.evaluate import PipelineSetup

DEFAULT_MODEL = "gpt-20.4b"
DEFAULT_HARDWARE = "dgx1-v100"
DEFAULT_SCHEDULE = ScheduleName.ONE_F_ONE_B
DEFAULT_MICROBATCH_SIZE = 1
"""The train config's `microbatch_size` default (`TrainConfig`, which imports the runtime:
a test checks they agree), which `mpress profile --model` uses too."""
MICROBATCHES_PER_RANK = 2
"""Default microbatches per iteration = this x pipeline ranks."""
STAGES_PER_RANK = 2
"""Interleaved: default stages per rank (as `mpress train` runs interleaved configs)."""


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that lay a model out on a pipeline (unset: a plan's
    values, else derived from the inputs; see the module docstring)."""
    add_flag(p, "model", help=f"model preset ({', '.join(model_presets())}) or YAML (default: {DEFAULT_MODEL}, "
                              "or the profile's model)")
    add_flag(p, "hardware", help=f"hardware preset ({', '.join(hardware_presets())}) or YAML "
                                 f"(default: {DEFAULT_HARDWARE})")
    add_setting_flag(p)
    add_flag(p, "schedule", help=f"pipeline schedule (default: {DEFAULT_SCHEDULE.value})")
    add_flag(p, "num_stages", help="pipeline stages (default: one per device, at most one per layer; "
                                   f"interleaved: {STAGES_PER_RANK} per rank)")
    add_flag(p, "num_ranks", help="pipeline ranks; schedules with several stages per rank only (default: one "
                                  "per device, or num_stages / 2 when --num-stages is given)")
    add_flag(p, "microbatch_size", help=f"samples per microbatch (default: the profile's, else "
                                        f"{DEFAULT_MICROBATCH_SIZE})")
    add_flag(p, "num_microbatches", help=f"microbatches per iteration (default: {MICROBATCHES_PER_RANK} per "
                                         "pipeline rank)")
    add_flag(p, "profile", default=None, help="profile YAML/JSON from `mpress profile` (default: analytic)")
    add_flag(p, "hf_config", default=None, help="a Hugging Face transformers model, profiled now (fake tensors if "
                                                "it does not fit here): a built-in config (gpt2-tiny, llama-tiny, "
                                                "bert-tiny, llama-2-7b), a config.json or a local weights directory")
    add_flag(p, "seq_len", default=None)
    add_flag(p, "dtype")
    p.add_argument("--balance", default=None, choices=["compute", "memory"],
                   help="partition layers to balance compute (PipeDream/DAPPLE; the default) or memory; "
                        "with a plan: its stages' layers unless given")
    add_flag(p, "num_nodes", default=None, help="nodes, each running one replica of the pipeline, gradients "
                                                "reduced across them over the network of configs/clusters/"
                                                "<hardware>.yaml (default: 1)")
    add_flag(p, "replicas_per_node", default=None,
             help="replicas of the pipeline sharing each node, each on GPUs of its own linked as the plan's; the "
                  "plan is made over the node's GPUs / R unless --num-devices says (default: 1)")
    add_flag(p, "dp_sharding", default=None, help="with --nodes or --replicas-per-node: ddp (every replica holds all model states) or "
                                                  "fsdp (optimizer states and master weights sharded over the "
                                                  "nodes) (default: ddp)")
    add_flag(p, "num_devices", default=None, help="override the hardware's device count (cpu-local)")
    add_flag(p, "device_memory", default=None, help="override device memory, e.g. 2GB (cpu-local)")


def add_setting_flag(p: argparse.ArgumentParser) -> None:
    """`--setting`: a setting preset or YAML (`mpress.config.settings`)."""
    add_flag(p, "setting", default=None,
             help=f"training setting ({', '.join(setting_presets())}) or YAML: its precision replaces the "
                  "model's; its schedule, stages, microbatch size and count, model and hardware are the "
                  "defaults of those flags (default: none)")


def setting_from_args(args: argparse.Namespace) -> Setting | None:
    """The `--setting` the command was given (None without one)."""
    name = getattr(args, "setting", None)
    return load_setting(name) if name is not None else None


@dataclass(frozen=True)
class PipelineShape:
    """A pipeline's resolved shape, and for each value not given as a flag where it came from."""

    schedule: ScheduleName
    num_stages: int
    num_ranks: int | None
    """Interleaved only (None otherwise: one rank per stage)."""
    microbatch_size: int
    num_microbatches: int
    sources: dict[str, str] = field(default_factory=dict)
    """Key -> origin of a value no flag gave ("the plan", "2 per rank", ...)."""
    setting: str | None = None
    """The `--setting` the values were resolved under (None: none)."""

    @property
    def pipeline_ranks(self) -> int:
        return self.num_ranks if self.num_ranks is not None else self.num_stages

    def settings(self) -> dict[str, object]:
        """The values as the train config's keys (for `--json`)."""
        return {"schedule": self.schedule.value, "num_stages": self.num_stages, "num_ranks": self.pipeline_ranks,
                "microbatch_size": self.microbatch_size, "num_microbatches": self.num_microbatches,
                "setting": self.setting}

    def describe(self) -> str:
        """One line: every value, with the origin of those no flag gave."""
        def v(key: str, text: str) -> str:
            return f"{text} ({self.sources[key]})" if key in self.sources else text

        parts = [v("schedule", f"schedule {self.schedule.value}"), v("num_stages", f"num_stages {self.num_stages}")]
        if self.num_ranks is not None:
            parts.append(v("num_ranks", f"num_ranks {self.num_ranks}"))
        parts += [v("num_microbatches", f"num_microbatches {self.num_microbatches}"),
                  v("microbatch_size", f"microbatch_size {self.microbatch_size}")]
        return ", ".join(parts)


def resolve_shape(args: argparse.Namespace, hardware: Hardware, *, num_layers: int | None,
                  plan: Plan | None = None, profile: Profile | None = None,
                  setting: Setting | None = None) -> PipelineShape:
    """The pipeline's shape: flags, else the plan's, else the setting's, else derived (the
    module docstring). num_layers: the model's layer count (caps the default stage
    count), None = no cap."""
    sources: dict[str, str] = {}

    def pick(key: str, from_plan: object, derived: object, origin: str) -> object:
        value = getattr(args, key)
        if value is not None:
            return value
        if plan is not None:
            sources[key] = "the plan's"
            return from_plan
        if setting is not None and hasattr(setting, key):
            sources[key] = f"the setting {setting.name}'s"
            return getattr(setting, key)
        sources[key] = origin
        return derived

    schedule = ScheduleName(pick("schedule", plan and plan.schedule, DEFAULT_SCHEDULE, "default"))
    layers = num_layers if num_layers is not None else hardware.num_devices * STAGES_PER_RANK
    devices = hardware.num_devices
    ranks: int | None = None
    if schedule in V_SCHEDULES:  # two stages per rank, in a V
        if args.num_stages is not None:
            ranks_default, why = max(1, args.num_stages // 2), "num_stages / 2"
        else:
            ranks_default = max(1, min(devices, layers // 2))
            why = "one per device" if ranks_default == devices else f"the model's {layers} layers / 2"
        ranks = int(pick("num_ranks", plan and plan.num_ranks, ranks_default, why))  # type: ignore[arg-type]
        stages = int(pick("num_stages", plan and plan.num_stages, 2 * ranks, "2 per rank"))  # type: ignore[arg-type]
    elif schedule in (ScheduleName.INTERLEAVED, ScheduleName.INTERLEAVED_ZB, ScheduleName.LOOPED_BFS):
        if args.num_stages is not None:
            ranks_default, why = max(1, min(devices, args.num_stages // STAGES_PER_RANK)), "num_stages / 2"
        else:
            ranks_default = max(1, min(devices, layers // STAGES_PER_RANK))
            why = "one per device" if ranks_default == devices else f"the model's {layers} layers / 2"
        ranks = int(pick("num_ranks", plan and plan.num_ranks, ranks_default, why))  # type: ignore[arg-type]
        stages = int(pick("num_stages", plan and plan.num_stages, STAGES_PER_RANK * ranks,  # type: ignore[arg-type]
                          f"{STAGES_PER_RANK} per rank"))
    else:
        if args.num_ranks is not None:
            ranks = args.num_ranks  # build_schedule holds it to num_stages
        stages_default = min(devices, layers)
        why = (f"one per device of {hardware.name}" if stages_default == devices
               else f"one per layer: the model has {layers}")
        stages = int(pick("num_stages", plan and plan.num_stages, stages_default, why))  # type: ignore[arg-type]
    pipeline_ranks = ranks if ranks is not None else stages
    if profile is not None and args.microbatch_size is None and plan is None:
        size, size_origin = profile.microbatch_size, "the profile's"
    else:
        size, size_origin = DEFAULT_MICROBATCH_SIZE, "default"
    microbatch_size = int(pick("microbatch_size", plan and plan.microbatch_size, size, size_origin))  # type: ignore[arg-type]
    num_microbatches = int(pick("num_microbatches", plan and plan.num_microbatches,  # type: ignore[arg-type]
                                MICROBATCHES_PER_RANK * pipeline_ranks, f"{MICROBATCHES_PER_RANK} per rank"))
    return PipelineShape(schedule=schedule, num_stages=stages, num_ranks=ranks, microbatch_size=microbatch_size,
                         num_microbatches=num_microbatches, sources=sources,
                         setting=setting.name if setting is not None else None)


def check_plan_precision(plan: Plan, model: ModelConfig) -> None:
    """A plan made under a `--setting` for this preset in another precision, given without
    the setting, is refused naming the settings that train the family in that precision
    (the plan check would only say that the fingerprints differ)."""
    if plan.model_fingerprint == model.fingerprint():
        return
    for precision in DTYPE_BYTES:
        if precision != model.precision and replace(model, precision=precision).fingerprint() == plan.model_fingerprint:
            names = [n for n in setting_presets()
                     if (st := load_setting(n)).family == model.family and st.precision == precision]
            hint = f"give --setting {' or '.join(names)}" if names else "give a --setting in that precision"
            raise UserError(f"the plan was made for {model.name} in {precision}, not in the preset's "
                            f"{model.precision} (under a --setting): {hint}")


def hardware_from_args(args: argparse.Namespace, plan: Plan | None = None,
                       setting: Setting | None = None) -> Hardware:
    """`--hardware` with `--num-devices`/`--device-memory` applied; without `--hardware`, a
    plan's hardware (device count and memory included), else the setting's first, else
    `DEFAULT_HARDWARE`."""
    memory, devices = args.device_memory, args.num_devices
    if plan is not None and args.hardware is None:
        devices = devices if devices is not None else plan.num_devices
        memory = memory if memory is not None else plan.device_memory_bytes
    default = setting.hardware[0] if setting is not None else DEFAULT_HARDWARE
    name = args.hardware or (plan.hardware if plan is not None else default)
    per_node = getattr(args, "replicas_per_node", None) or 1
    if devices is None and per_node > 1:  # one replica's share of the node: the first 1/R of its GPUs
        node = load_hardware(name).num_devices
        if node < per_node:
            raise UserError(f"--replicas-per-node: {per_node} replicas on {name}'s {node} GPUs leave none "
                            f"for each; at most {node}")
        devices = node // per_node
        try:
            return load_hardware(name, num_devices=devices, memory_bytes=memory)
        except UserError as exc:  # a preset whose links are written for the whole node only
            raise UserError(f"--replicas-per-node {per_node}: one replica's {devices} GPUs of {name}: {exc}") from None
    return load_hardware(name, num_devices=devices, memory_bytes=memory)


def setup_from_args(args: argparse.Namespace, plan: Plan | None = None,
                    profile: Profile | None = None) -> tuple[PipelineSetup, PipelineShape]:
    """The `PipelineSetup` the pipeline flags describe and its resolved shape; flags left
    unset take the plan's values (when a plan is given), the `--setting`'s, or the derived
    defaults; a setting's precision replaces the model preset's."""
    from mpress.static.plan.evaluate import setup_pipeline

    setting = setting_from_args(args)
    hardware = hardware_from_args(args, plan, setting)
    if setting is not None and (profile is not None or args.profile or getattr(args, "hf_config", None)):
        raise UserError(f"--setting {setting.name} sets the precision of a model preset; a profile (--profile, "
                        "--module, --hf-config) keeps the precision it was made with: give --model instead")
    if getattr(args, "dtype", None) is not None and not getattr(args, "hf_config", None):
        raise UserError("--dtype is the precision of an --hf-config (a profile keeps the precision it was made "
                        "with: `mpress profile --hf-config ... --dtype`; a preset takes a --setting)")
    profile = profile or (Profile.load(args.profile) if args.profile else None)  # a profile alone names its model
    if profile is None:
        profile = hf_profile_from_args(args, hardware)
    model = model_for_profile(args.model or (plan.model if plan is not None else None), profile,
                              setting.default_model if setting is not None else DEFAULT_MODEL,
                              path=str(args.profile) if args.profile else "profile")
    if setting is not None:
        model = setting.apply(model)  # type: ignore[arg-type]  # no profile: a ModelConfig
    elif plan is not None and isinstance(model, ModelConfig):
        check_plan_precision(plan, model)
    num_layers = len(profile.layers) if profile is not None else None
    shape_profile = profile
    if profile is None and plan is None and args.num_stages is None and setting is None:
        from mpress.static.profile.analytic import analytic_profile

        # its layer count caps the default stage count; setup_pipeline would make the same
        profile = analytic_profile(model, hardware, args.microbatch_size or DEFAULT_MICROBATCH_SIZE)  # type: ignore[arg-type]
        num_layers = len(profile.layers)
    shape = resolve_shape(args, hardware, num_layers=num_layers, plan=plan, profile=shape_profile, setting=setting)
    if setting is not None:  # the settings line says which of model, hardware and precision are the setting's
        origin = f"the setting {setting.name}'s"
        shape.sources["precision"] = origin
        if plan is None and args.model is None:
            shape.sources["model"] = origin
        if plan is None and args.hardware is None:
            shape.sources["hardware"] = origin
    # a plan keeps its stages' layers unless --balance asks for another split or another
    # model is named (which the plan check then refuses, naming both)
    own = plan is not None and not args.balance and args.model in (None, plan.model)
    ranges = [(sp.first_layer, sp.end_layer) for sp in plan.stages] if own else None  # type: ignore[union-attr]
    setup = setup_pipeline(model, hardware, schedule=shape.schedule, num_stages=shape.num_stages,  # type: ignore[arg-type]
                           num_ranks=shape.num_ranks, microbatch_size=shape.microbatch_size,
                           num_microbatches=shape.num_microbatches, profile=profile, balance=args.balance or "compute",
                           ranges=ranges,
                           profile_path=str(args.profile) if args.profile else "profile",
                           data_parallel=data_parallel_from_args(args, hardware))
    return setup, shape


def data_parallel_from_args(args: argparse.Namespace, hardware: Hardware) -> DataParallel | None:
    """`--nodes` replicas of the pipeline with `--dp-sharding` (default ddp); None for
    one node (the single-server emulation, unchanged)."""
    nodes, sharding = getattr(args, "num_nodes", None), getattr(args, "dp_sharding", None)
    per_node = getattr(args, "replicas_per_node", None)
    if sharding is not None and nodes is None and per_node is None:
        raise UserError("--dp-sharding shards model states over the replicas of --nodes N or --replicas-per-node R")
    local = None
    if per_node is not None and per_node > 1:
        # the whole node, from what the user named (a YAML's path, not its display name)
        node = load_hardware(getattr(args, "hardware", None) or hardware.name, memory_bytes=hardware.device.memory_bytes)
        if per_node * hardware.num_devices > node.num_devices:
            raise UserError(f"--replicas-per-node: {per_node} replicas of a pipeline over {hardware.num_devices} "
                            f"GPUs need {per_node * hardware.num_devices}; {node.name} has {node.num_devices}: "
                            f"give --num-devices {node.num_devices // per_node} or fewer replicas")
        local = NodeReplicas(node, replica_devices(node, hardware.num_devices, per_node))
    return replicas_of(hardware, nodes or 1, local, Sharding(sharding or Sharding.DDP))


def cluster_line(setup: PipelineSetup, result: EmulatorResult) -> str | None:
    """One line on the whole cluster (None for one node): its throughput (the result's,
    all replicas counted), per replica, and the data-parallel reduction, overlapped and
    exposed (`data_parallel.exposed_reduction_s`)."""
    dp = setup.data_parallel
    if dp is None or dp.degree == 1:
        return None
    c, local = dp.cluster, dp.local
    node = local.node if local is not None else c.hardware  # type: ignore[union-attr]
    where = c.name if c is not None else f"1 x {node.name}"
    links = [f"the {dp.per_node} replicas' twin GPUs on each node"] if local is not None else []
    if c is not None:
        links.append(f"{c.network.num_nics} x {c.nic_gbps:.3g} GB/s NICs")
    return (f"cluster {where} ({dp.nodes * node.num_devices} GPUs, {dp.degree} replicas, {dp.sharding}): "
            f"{result.samples_per_s:.4g} samples/s for the cluster ({dp.degree} x "
            f"{result.samples_per_s / dp.degree:.4g} per replica), {result.model_tflops:.4g} model TFLOP/s; "
            f"dp reduction {fmt_seconds(reduction_busy_s(result))} per iteration over "
            f"{', then '.join(links)}, {fmt_seconds(exposed_reduction_s(result))} exposed")


def hf_profile_from_args(args: argparse.Namespace, hardware: Hardware) -> Profile | None:
    """`--hf-config`'s profile for one microbatch of `--microbatch-size` (default
    `DEFAULT_MICROBATCH_SIZE`) sequences of `--seq-len`, times for `hardware`; None
    without `--hf-config`."""
    name = getattr(args, "hf_config", None)
    if name is None:
        if getattr(args, "seq_len", None) is not None:
            raise UserError("--seq-len is the sequence length of an --hf-config")
        return None
    if args.profile or getattr(args, "module", None) or args.model:
        raise UserError("give --hf-config (profiled now) or --model, --module or --profile, not both")
    from mpress.models.user_module import parse_layers
    from mpress.static.profile.fake_profile import profile_hf_model

    return profile_hf_model(name, microbatch_size=args.microbatch_size or DEFAULT_MICROBATCH_SIZE,
                            hardware=hardware, fake=None, seq_len=args.seq_len,
                            layers=parse_layers(getattr(args, "layers", None)), dtype=args.dtype or "fp32")


def settings_line(setup: PipelineSetup, shape: PipelineShape) -> str:
    """One line of what the command runs with: model, hardware, and the resolved shape."""
    hw = setup.hardware
    dp = setup.data_parallel
    nodes = "" if dp is None else f", {dp.degree} nodes ({dp.sharding})" if dp.per_node == 1 else \
        f", {dp.degree} replicas, {dp.per_node} on each of {dp.nodes} x {dp.local.node.name} ({dp.sharding})"  # type: ignore[union-attr]

    def v(key: str, text: str) -> str:  # model, hardware and precision carry an origin under a --setting only
        return f"{text} ({shape.sources[key]})" if key in shape.sources else text

    precision = getattr(setup.model, "precision", None)
    trained = f", {v('precision', f'precision {precision}')}" if "precision" in shape.sources else ""
    return (f"settings: {v('model', f'model {setup.model.name}')}{trained}, "
            f"{v('hardware', f'hardware {hw.name} ({hw.num_devices} x {fmt_bytes(hw.device.memory_bytes)})')}"
            f"{nodes}, {shape.describe()}")


def settings_json(setup: PipelineSetup, shape: PipelineShape) -> dict[str, object]:
    """The resolved settings for `--json`, keyed as the train config's keys."""
    hw = setup.hardware
    return {"model": setup.model.name, "precision": getattr(setup.model, "precision", None),
            "hardware": hw.name, "num_devices": hw.num_devices,
            "device_memory_bytes": hw.device.memory_bytes, **shape.settings(), "defaults": dict(shape.sources),
            **data_parallel_json(setup)}


def data_parallel_json(setup: PipelineSetup) -> dict[str, object]:
    """`num_nodes`, `replicas_per_node` and `dp_sharding` of the setup (1, 1 and none for
    one replica)."""
    dp = setup.data_parallel
    return {"num_nodes": dp.nodes if dp is not None else 1,
            "replicas_per_node": dp.per_node if dp is not None else 1,
            "dp_sharding": str(dp.sharding) if dp is not None else None}
