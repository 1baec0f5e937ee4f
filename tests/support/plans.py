"""Plans built in code for tests: rules, a two-stage plan for the contract's own tests, a
plan for the tiny pipeline that the runtime tests train, D2D plans over pipeline
stages on given devices, and plans for the own-loop example."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from mpress.config.presets import HARDWARE_DIR, resolve_config
from mpress.hardware.server import load_hardware
from mpress.config.model_config import ModelConfig, load_model_config
from mpress.contract.actions import stage_to_rank
from mpress.contract.plan import PeerQuota, Plan, StagePlan, Stripe, TensorRule, hardware_fingerprint
from mpress.static.profile.analytic import analytic_profile
from mpress.static.plan.evaluate import PipelineSetup, setup_pipeline
from mpress.static.plan.plan_eval import plan_from_rules
from tests.support.tiny_pipeline import (
    MICROBATCH_SIZE,
    MODEL,
    POOL_BYTES,
    RANGES,
    num_stages_of,
)

MiB = 1 << 20
GB = 10**9


def rule(tensor: str, technique: str = "host", microbatches: str = "all", **kw: object) -> TensorRule:
    return TensorRule(tensor=tensor, technique=technique, microbatches=microbatches, **kw)  # type: ignore[arg-type]


def contract_plan(rules: dict[int, list[TensorRule]] | None = None, *, ranges=((0, 2), (2, 4)),
              devices: list[int] | None = None, num_microbatches: int = 4, hardware: str = "dgx1-v100",
              hardware_fp: str = "hw", model_fp: str = "model", **stage_kw: dict) -> Plan:
    """A plan for len(ranges) stages; `stage_kw[s]` overrides StagePlan fields of stage s."""
    devices = list(range(len(ranges))) if devices is None else devices
    rules = rules or {}
    stages = [
        StagePlan(stage=s, device=devices[s], first_layer=a, end_layer=b, rules=list(rules.get(s, [])),
                  **stage_kw.get(f"s{s}", {}))
        for s, (a, b) in enumerate(ranges)
    ]
    return Plan(strategy="test", model="toy", model_fingerprint=model_fp, profile_fingerprint="prof",
                hardware=hardware, hardware_fingerprint=hardware_fp, num_devices=8, device_memory_bytes=32 * GB,
                schedule="1f1b", num_stages=len(ranges), num_ranks=len(ranges), num_microbatches=num_microbatches,
                microbatch_size=2, stage_to_device=devices, stages=stages, fits=True)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, f"error message is not one line: {text!r}"
    return text


def d2d_rule(tensor: str, stripes: dict[int, float], microbatches: str = "all") -> TensorRule:
    """`tensor` D2D-swapped with these (device: fraction) stripes."""
    return TensorRule(tensor=tensor, technique="d2d", microbatches=microbatches,
                      stripes=[Stripe(device=d, fraction=f) for d, f in stripes.items()])


def pipeline_plan(schedule: str, world: int, num_microbatches: int, rules: dict[int, list[TensorRule]], *,
                  model: ModelConfig | None = None, host_step: tuple[int, ...] = (),
                  peer_pools: dict[int, int] | None = None, ranges: list[tuple[int, int]] | None = None,
                  hardware: str = "cpu-local") -> Plan:
    """A plan for the tiny pipeline (`tiny_pipeline`) on `world` CPU ranks: stage s on
    device s % world with `rules[s]`, a pinned host pool each, the optimizer step on the
    host for the stages in `host_step`, a peer pool of `peer_pools[s]` bytes lent by
    stage s's device; `model`: gpt-tiny as configured (e.g. bf16, or more blocks);
    `ranges`: the stages' layer ranges (default `RANGES`); `hardware`: a preset or file
    (`drive_hardware` for `nvme` rules)."""
    cfg = model or load_model_config(MODEL)
    n = num_stages_of(schedule, world)
    ranges = ranges or RANGES[n]
    devices = list(stage_to_rank(schedule, n, world))
    stages = [StagePlan(stage=s, device=devices[s], first_layer=a, end_layer=b, rules=rules.get(s, []),
                        pinned_host_bytes=POOL_BYTES, optimizer_step="host" if s in host_step else "device",
                        peer_pool_bytes=(peer_pools or {}).get(s, 0))
              for s, (a, b) in enumerate(ranges)]
    plan = Plan(strategy="test", model=cfg.name, model_fingerprint=cfg.fingerprint(), dtype=cfg.precision, profile_fingerprint="test",
                hardware=hardware, hardware_fingerprint="test", num_devices=world, device_memory_bytes=1 << 30,
                schedule=schedule, num_stages=n, num_ranks=world, num_microbatches=num_microbatches,
                microbatch_size=MICROBATCH_SIZE, stage_to_device=devices, stages=stages, fits=True)
    return with_program(plan, cfg)


def drive_hardware(directory: Path) -> str:
    """A hardware file: cpu-local with a local drive stated (what `nvme` rules need to be
    emulated), written in `directory`; its path."""
    path = Path(directory) / "cpu-local-drive.yaml"
    preset = resolve_config("cpu-local", HARDWARE_DIR, "hardware").read_text()
    text = preset.replace("name: cpu-local", "name: cpu-local-drive")
    path.write_text(text + "nvme_bytes: 1000000000000\nnvme_read_gbps: 1.0\nnvme_write_gbps: 0.5\n")
    return str(path)


def with_program(plan: Plan, model: ModelConfig) -> Plan:
    """`plan` with the program its rules make for `model` on the plan's hardware (the
    static rewriter's, as `mpress plan` writes it) and each stage's predicted peak: the
    emulated peak of its device, its iteration and whether it fits, all derived from
    its rules (`plan_from_rules`: none kept from a plan it was edited from)."""
    setup = setup_for(plan, model)
    plan = dataclasses.replace(plan, hardware_fingerprint=hardware_fingerprint(setup.hardware))  # as planned
    return plan_from_rules(setup, plan)


def setup_for(plan: Plan, model: ModelConfig) -> PipelineSetup:
    """The pipeline `plan` is for, with `model`: its hardware, shape and layer ranges."""
    hardware = load_hardware(plan.hardware, num_devices=plan.num_devices, memory_bytes=plan.device_memory_bytes)
    ranges = [(sp.first_layer, sp.end_layer) for sp in plan.stages]
    return setup_pipeline(model, hardware, schedule=plan.schedule, num_stages=plan.num_stages,
                          microbatch_size=plan.microbatch_size, num_microbatches=plan.num_microbatches,
                          num_ranks=plan.num_ranks, ranges=ranges)


@functools.cache
def _tiny_layers() -> dict[str, object]:
    """The tiny pipeline's layers as its plans' profile has them (analytic, cpu-local)."""
    profile = analytic_profile(load_model_config(MODEL), load_hardware("cpu-local"), MICROBATCH_SIZE)
    return {layer.name: layer for layer in profile.layers}


def op_level_recompute(layer: str, option: int, microbatches: str = "all") -> list[TensorRule]:
    """Rules recomputing choice `option` of `layer`'s op-level recompute choices (its
    profile's `recompute_options`, taken modulo their number) in `microbatches`, as the
    planner writes them: a keep rule for each tensor it keeps, then the layer's recompute
    rule. A layer without such choices is recomputed whole."""
    profile = _tiny_layers()[layer]
    rules = []
    if profile.recompute_options:  # type: ignore[attr-defined]
        chosen = profile.recompute_options[option % len(profile.recompute_options)]  # type: ignore[attr-defined]
        rules = [rule(t.id, "keep", microbatches) for p, t in enumerate(profile.saved)  # type: ignore[attr-defined]
                 if t.op_index >= 0 and p not in chosen.tensors]
    return rules + [rule(f"{layer}.**", "recompute", microbatches)]


def d2d_plan(devices: list[int], *, stripes: dict[int, dict[int, float]] | None = None,
             pools: dict[int, int] | None = None, quotas: dict[int, dict[int, int]] | None = None,
             num_ranks: int = 1) -> Plan:
    """Stage s on `devices[s]` holding layer s of a toy model; `stripes[s]`: stage s
    D2D-swaps every saved tensor with those (device: fraction) stripes; `pools[s]`: stage
    s's peer_pool_bytes; `quotas[s]`: its explicit (device: bytes) quotas."""
    stripes, pools, quotas = stripes or {}, pools or {}, quotas or {}
    stages = [StagePlan(stage=s, device=d, first_layer=s, end_layer=s + 1,
                        rules=[d2d_rule("*", stripes[s])] if s in stripes else [],
                        peer_pool_bytes=pools.get(s, 0),
                        peer_quotas=[PeerQuota(device=p, quota_bytes=b) for p, b in quotas.get(s, {}).items()])
              for s, d in enumerate(devices)]
    return Plan(strategy="test", model="toy", model_fingerprint="model", profile_fingerprint="prof",
                hardware="test", hardware_fingerprint="hw", num_devices=max(devices) + 1,
                device_memory_bytes=1 << 34, schedule="interleaved" if num_ranks == 1 else "1f1b",
                num_stages=len(devices), num_ranks=num_ranks, num_microbatches=2, microbatch_size=1,
                stage_to_device=list(devices), stages=stages, fits=True)


def three_stage_d2d_plan(pool1: int = 8 * MiB, pool2: int = 8 * MiB) -> Plan:
    """Stage 0 (device 0) stripes 3:1 to devices 1 and 2, whose stages reserve pools."""
    return d2d_plan([0, 1, 2], stripes={0: {1: 0.75, 2: 0.25}}, pools={1: pool1, 2: pool2})


OWN_LOOP = Path(__file__).resolve().parents[2] / "examples" / "own_loop"
OWN_LOOP_SPEC = "examples.own_loop.model:make"
"""The example's factory, importable from the repository root."""
OWN_LOOP_LAYERS = 8
"""The example model's layers: embed, blocks.0-5, head."""


def own_loop_plan(out: Path, world: int, rules: dict[int, list[TensorRule]], *, host_step: tuple[int, ...] = (),
                  peer_pools: dict[int, int] | None = None, num_stages: int | None = None,
                  schedule: str | None = None) -> Plan:
    """A complete plan for the own-loop example (`examples/own_loop`), made as `mpress
    train` makes a plan file written by hand (the program, pinned pools and peaks from
    the static half, `mpress.launcher.startup.plan_for`), on `world` CPU ranks (1F1B,
    4 microbatches of 2): stage s holds an even share of the layers, with `rules[s]`, its optimizer stepped on
    the host when s is in `host_step`, a peer pool of `peer_pools[s]` bytes lent by its
    device. `num_stages` (a multiple of `world`): interleaved 1F1B, stage s on rank
    s % world, or `schedule` (e.g. zbv: stages in a V). Written to `out` and returned."""
    # what mpress train does with a plan written by hand
    from mpress.launcher.startup import plan_for
    from mpress.runtime.train_config import load_train_config, model_config

    n = num_stages or world
    schedule = schedule or ("interleaved" if n != world else "1f1b")
    devices = list(stage_to_rank(schedule, n, world))
    model = model_config(load_train_config(OWN_LOOP / "train.yaml", [("module", OWN_LOOP_SPEC), ("plan", "none")]))
    per = -(-OWN_LOOP_LAYERS // n)
    stages = [StagePlan(stage=s, device=devices[s], first_layer=s * per, end_layer=min(OWN_LOOP_LAYERS, (s + 1) * per),
                        rules=rules.get(s, []), optimizer_step="host" if s in host_step else "device",
                        peer_pool_bytes=(peer_pools or {}).get(s, 0))
              for s in range(n)]
    hardware = load_hardware("cpu-local", num_devices=world, memory_bytes=1 << 30)
    hand = Plan(strategy="hand", model=OWN_LOOP_SPEC, model_fingerprint=model.fingerprint(), dtype="fp32",
                profile_fingerprint="hand", hardware="cpu-local", num_devices=world, device_memory_bytes=1 << 30,
                hardware_fingerprint=hardware_fingerprint(hardware), schedule=schedule, num_stages=n,
                num_ranks=world, num_microbatches=4, microbatch_size=2, stage_to_device=devices,
                stages=stages, fits=True)
    hand_path = out.with_suffix(".hand.yaml")
    hand.save(hand_path)
    cfg = load_train_config(OWN_LOOP / "train.yaml", [("module", OWN_LOOP_SPEC), ("plan", str(hand_path)),
                                                      ("schedule", schedule)])
    plan = plan_for(cfg, model, n, world).plan
    plan.save(out)
    return plan
