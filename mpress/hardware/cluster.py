"""Several identical servers: `num_nodes` x one `Hardware`, and the inter-node network.

A `Cluster` is a separate concept from the single-server `Hardware`: the server model
stays as it is (devices, host, PCIe, NVLink), and what joins servers, the compute NICs
of each node, comes from `configs/clusters/<hardware name>.yaml` (a `NetworkSpec`, with
its sources) or any YAML path. Data parallelism runs across the nodes: the pipeline of
one node is replicated on every node, and GPU i of each node reaches GPU i of the others
through its NIC (`nic_of_device`), as on a rail-optimised fabric; GPUs that share a NIC
share its bandwidth.

Several replicas may also share one node (`replica_devices`, `NodeReplicas`: their
gradients meet over the node's links before the NICs, `mpress.static.emulate.dp_reduction`).
A plan lays one replica's pipeline out over devices 0..N-1 of its hardware: on a GPU node
those are the node's first N GPUs (in the CUDA order rank 0 planned in), and the plan's
stage-to-device map is replica 0's. Several replicas on one node each need N GPUs of
their own, linked as the plan's are -- the plan's D2D stripes, transfer times and
collectives' rings were costed over those links -- so replica k > 0 gets an embedding of
the plan's devices into GPUs no other replica holds that keeps every NVLink link count
between two of the plan's devices, and which pairs share a PCIe uplink (the host swaps'
shared bandwidth). On a DGX-1 (hybrid cube-mesh) the second replica of a four-GPU plan on
GPUs 0-3 gets GPUs 4-7, the only other four-GPU set linked alike; under NVSwitch any four
GPUs are.

`replica_devices` is the one place this is decided: the launcher's start-up check, the
device each rank binds and the tests all read its answer; nothing re-derives it.

Shared by the static half (the emulator's inter-node channels, the planner's sharded
states) and, later, the runtime's launcher, so it lives outside both.

Units: seconds, GB/s with GB = 1e9 bytes, per direction.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mpress.config.limits import MAX_DEVICES, MAX_LATENCY_S, MIN_BANDWIDTH_GBPS
from mpress.config.loader import from_dict, load_yaml
from mpress.config.presets import CONFIG_DIR
from mpress.config.vocabulary import Word
from mpress.errors import ConfigError, UserError
from mpress.hardware.server import Hardware

CLUSTER_DIR = CONFIG_DIR / "clusters"
MAX_NODES = 4096
"""Most nodes a cluster may have (a bound on input, not a scaling claim)."""


DDP_GRADIENT_AS_BUCKET_VIEW = False
"""`gradient_as_bucket_view` of the DDP that replicates a stage (shared by both halves:
the runtime passes it, the emulator counts from it). False, torch's default: DDP's
buckets hold a copy of every gradient, the stage's gradient bytes again for the wrapped
module's lifetime; True would make the gradients views into the buckets (no copy)."""


class Sharding(Word):
    """How data-parallel replicas hold a stage's model states (shared by both halves).

    ddp: every replica holds all of them; gradients are all-reduced (torch DDP).
    fsdp: optimizer states and fp32 master weights (or, without mixed precision, a copy
        of the parameters) are sharded over the replicas; gradients are reduce-scattered
        and the updated parameters all-gathered (torch FSDP2 `fully_shard`, ZeRO-2 like).
    """

    DDP = "ddp"
    FSDP = "fsdp"


@dataclass(kw_only=True, frozen=True)
class NetworkSpec:
    """The compute NICs of one node, as a cluster YAML gives them."""

    hardware: str
    """The server preset these NICs belong to (`configs/hardware/<name>.yaml`)."""
    num_nics: int = field(metadata={"min": 1, "max": MAX_DEVICES})
    """Compute NICs per node (storage NICs are not modelled)."""
    nic_gbps: float = field(metadata={"min": MIN_BANDWIDTH_GBPS})
    """Nominal bandwidth of one NIC per direction, GB/s (200 Gb/s HDR = 25)."""
    nic_of_device: list[int] = field(default_factory=list)
    """The NIC each GPU's inter-node traffic leaves by (index = device); empty: device d
    uses NIC d x num_nics // num_devices."""
    efficiency: float = field(default=0.9, metadata={"gt": 0, "max": 1})
    """Achieved fraction of the nominal NIC bandwidth."""
    hop_latency_s: float = field(default=5e-6, metadata={"min": 0, "max": MAX_LATENCY_S})
    """Fixed cost of one step of a ring collective between two nodes."""
    source: str = ""
    """Where the nominal figures come from (datasheet citation)."""

    def __post_init__(self) -> None:
        for d, nic in enumerate(self.nic_of_device):
            if not 0 <= nic < self.num_nics:
                raise ConfigError("", f"nic_of_device[{d}]", f"NIC {nic} out of range 0..{self.num_nics - 1}")


@dataclass(kw_only=True, frozen=True)
class Cluster:
    """`num_nodes` identical servers joined by their compute NICs."""

    num_nodes: int = field(metadata={"min": 1, "max": MAX_NODES})
    """Servers; each runs one replica of the pipeline."""
    hardware: Hardware
    """One server, or the first N GPUs of one that a pipeline uses (device d is the node's
    GPU d: its NIC is `nic_of_device[d]`)."""
    network: NetworkSpec
    """Its compute NICs."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_nodes <= MAX_NODES:
            raise UserError(f"--nodes must be in 1..{MAX_NODES}, got {self.num_nodes}")
        mapped = len(self.network.nic_of_device)
        if mapped and mapped < self.hardware.num_devices:  # more: a pipeline on the node's first N GPUs
            raise UserError(f"network of {self.network.hardware}: nic_of_device names {mapped} devices, hardware "
                            f"{self.hardware.name} has {self.hardware.num_devices} (give one NIC per device)")

    @property
    def name(self) -> str:
        return f"{self.num_nodes} x {self.hardware.name}"

    def nic(self, device: int) -> int:
        """The NIC `device` sends and receives inter-node traffic by."""
        if self.network.nic_of_device:
            return self.network.nic_of_device[device]
        return device * self.network.num_nics // self.hardware.num_devices

    @property
    def nic_gbps(self) -> float:
        """Effective bandwidth of one NIC per direction, GB/s."""
        return self.network.nic_gbps * self.network.efficiency


def cluster_presets() -> list[str]:
    """Hardware presets that have a network preset (and so can run on several nodes)."""
    return sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))


def load_network(name_or_path: str | Path) -> NetworkSpec:
    """A network preset (`configs/clusters/<hardware name>.yaml`) or YAML path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise UserError(f"{p}: no such file")
        path = p
    else:
        path = CLUSTER_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise UserError(f"hardware {name_or_path!r} has no network preset for several nodes (presets: "
                            f"{', '.join(cluster_presets())}; or give a network YAML in {CLUSTER_DIR.name}/'s format)")
    return from_dict(NetworkSpec, load_yaml(path), str(path))


def make_cluster(hardware: Hardware, num_nodes: int, network: str | Path | None = None) -> Cluster:
    """`num_nodes` x `hardware`, joined by `network` (default: the preset named as the
    hardware). A network written for another server is refused."""
    spec = load_network(network if network is not None else hardware.name)
    if spec.hardware != hardware.name:
        raise UserError(f"network {network or hardware.name}: its NICs belong to hardware {spec.hardware!r}, "
                        f"not {hardware.name!r}")
    return Cluster(num_nodes=num_nodes, hardware=hardware, network=spec)


@dataclass(frozen=True)
class NodeReplicas:
    """Several replicas of one pipeline sharing a node: the node and, per replica slot,
    the node GPU of each of the plan's devices (`replica_devices`; slot 0 is the plan's
    own). The replicas' twin GPUs reduce gradients over the node's own links."""

    node: Hardware
    """The whole node."""
    devices: tuple[tuple[int, ...], ...]
    """`replica_devices(node, plan devices, replicas)`."""

    @property
    def per_node(self) -> int:
        return len(self.devices)

    def twins(self, device: int) -> list[int]:
        """The node GPUs of the plan's `device` in every replica slot, in slot order (the
        ring its gradient reduction runs over)."""
        return [m[device] for m in self.devices]


def replica_devices(node: Hardware, plan_devices: int, replicas: int) -> tuple[tuple[int, ...], ...]:
    """Per replica slot k on the node (0 <= k < `replicas`), the node device of each of
    the plan's `plan_devices` devices: slot 0 is the plan's own (0..N-1), every other slot
    N devices of their own linked as the plan's (see the module docstring); of the ways
    to place them all, the first in device order, so every rank that asks gets the same
    answer. A one-line `UserError` (key `dp`) when the node cannot hold that many replicas."""
    n = plan_devices
    if not 1 <= n <= node.num_devices or replicas < 1:
        raise ValueError(f"{replicas} replicas of {n} devices on a {node.num_devices}-device node")
    if replicas * n > node.num_devices:
        raise UserError(f"dp: {replicas} replicas per node of a plan over {n} GPUs need {replicas * n} GPUs; "
                        f"{node.name} has {node.num_devices}: run fewer ranks per node, or plan over fewer GPUs")
    maps = [tuple(range(n))]

    def place(k: int) -> bool:  # slots k.. on the GPUs maps[:k] leave free
        if k == replicas:
            return True
        taken = {a for m in maps for a in m}
        for found in _embeddings(node, n, taken):
            maps.append(found)
            if place(k + 1):
                return True
            maps.pop()
        return False

    if not place(1):
        raise UserError(f"dp: {node.name} has no {replicas} disjoint sets of {n} GPUs linked as the plan's GPUs "
                        f"0-{n - 1} are (NVLink links and shared PCIe uplinks): run fewer replicas per node, "
                        "or plan for GPUs the node can repeat")
    return tuple(maps)


def _alike(node: Hardware, d: int, e: int, a: int, b: int) -> bool:
    """Whether node devices a, b are linked as the plan's devices d, e are."""
    return node.links(a, b) == node.links(d, e) and \
        (node.pcie_group(a) == node.pcie_group(b)) == (node.pcie_group(d) == node.pcie_group(e))


def _embeddings(node: Hardware, n: int, taken: set[int]) -> Iterator[tuple[int, ...]]:
    """Every map of devices 0..n-1 into devices not `taken` that keeps each pair's links
    and shared uplink, in device order: a depth-first search extending a partial map one
    device at a time, each new device checked against those already placed (a node has
    at most 16 GPUs: the search is small)."""
    free = [a for a in range(node.num_devices) if a not in taken]
    placed: list[int] = []

    def extend() -> Iterator[tuple[int, ...]]:
        d = len(placed)
        if d == n:
            yield tuple(placed)
            return
        for a in free:
            if a not in placed and all(_alike(node, d, e, a, placed[e]) for e in range(d)):
                placed.append(a)
                yield from extend()
                placed.pop()

    return extend()
