"""Plans for the own-loop example (`examples/own_loop`), made as `mpress train` makes a
plan file written by hand: rules and optimizer steps chosen here, the program, pinned
pools and peaks from the static half (`mpress.launcher.startup.plan_for`)."""

from __future__ import annotations

from pathlib import Path

from mpress.contract.plan import Plan, StagePlan, TensorRule, hardware_fingerprint
from mpress.hardware.server import load_hardware
from mpress.launcher.startup import plan_for
from mpress.runtime.train_config import load_train_config, model_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop"
SPEC = "examples.own_loop.model:make"
"""The example's factory, importable from the repository root."""
NUM_LAYERS = 8
"""embed, blocks.0-5, head."""


def example_plan(out: Path, world: int, rules: dict[int, list[TensorRule]], *, host_step: tuple[int, ...] = (),
                 peer_pools: dict[int, int] | None = None, num_stages: int | None = None) -> Plan:
    """A complete plan for the example on `world` CPU ranks (1F1B, 4 microbatches of 2):
    stage s holds an even share of the layers, with `rules[s]`, its optimizer stepped on
    the host when s is in `host_step`, a peer pool of `peer_pools[s]` bytes lent by its
    device. `num_stages` (a multiple of `world`): interleaved 1F1B, stage s on rank
    s % world. Written to `out` and returned."""
    n = num_stages or world
    schedule = "interleaved" if n != world else "1f1b"
    model = model_config(load_train_config(EXAMPLE / "train.yaml", [("module", SPEC), ("plan", "none")]))
    per = -(-NUM_LAYERS // n)
    stages = [StagePlan(stage=s, device=s % world, first_layer=s * per, end_layer=min(NUM_LAYERS, (s + 1) * per),
                        rules=rules.get(s, []), optimizer_step="host" if s in host_step else "device",
                        peer_pool_bytes=(peer_pools or {}).get(s, 0))
              for s in range(n)]
    hardware = load_hardware("cpu-local", num_devices=world, memory_bytes=1 << 30)
    hand = Plan(strategy="hand", model=SPEC, model_fingerprint=model.fingerprint(), dtype="fp32",
                profile_fingerprint="hand", hardware="cpu-local", num_devices=world, device_memory_bytes=1 << 30,
                hardware_fingerprint=hardware_fingerprint(hardware), schedule=schedule, num_stages=n,
                num_ranks=world, num_microbatches=4, microbatch_size=2, stage_to_device=[s % world for s in range(n)],
                stages=stages, fits=True)
    hand_path = out.with_suffix(".hand.yaml")
    hand.save(hand_path)
    cfg = load_train_config(EXAMPLE / "train.yaml", [("module", SPEC), ("plan", str(hand_path)),
                                                      ("schedule", schedule)])
    plan = plan_for(cfg, model, n, world).plan
    plan.save(out)
    return plan
