"""What the optimizer steps: the parameters themselves, or fp32 master copies of them.

Mixed precision here is "half model" style: the stage's parameters are fp16/bf16 and
forward/backward run on them, while Adam steps fp32 *master weights* (a half-precision
parameter cannot take updates smaller than half an ulp of its value; the fp32 master
accumulates them). `MasterWeights` holds, per parameter, the tensor the optimizer steps:

    parameter                        optimizer steps           kind
    fp32, step on its device         the parameter itself      Kind.PARAM (no copy)
    fp16/bf16, step on its device    an fp32 copy there        Kind.DEVICE_MASTER
    any dtype, step on the host      an fp32 copy on the host  Kind.HOST_COPY

and `step()` is one optimizer step over them:

    1. gradients in: each copy's `.grad` = its parameter's gradient, upcast to fp32
       (host copies: copied device -> host first, through a pinned staging buffer in the
       parameter's dtype, so PCIe carries half the bytes under mixed precision; a stage's
       staging buffers are views of one slab, pinned once to its alignment: `slabs`);
    2. `optimizer.step()` on the copies (on the CPU for host copies);
    3. parameters out: each parameter = its copy, rounded to the parameter's dtype
       (host copies: rounded on the host, then copied host -> device);
    4. every gradient is cleared (set to None), parameters' and copies'.

Upcasting is exact and rounding (round to nearest even) is the same on every device, so
a run stepping host copies or offloaded masters equals one stepping device masters bit
for bit, as long as the optimizer's arithmetic is the same (true on the CPU; on CUDA the
host step runs the CPU's Adam, the device step CUDA's).

fp16 runs without loss scaling: gradients that underflow fp16 are lost. bf16 (fp32's
exponent range) is the supported mixed precision; use fp16 only where its gradients are
known to stay in range.

The optimizer is built by the caller's factory over `tensors()` (one tensor per parameter,
in the parameters' order), so each stepped tensor stands for one named parameter:
checkpoints key its states and master by that name (`mpress.runtime.job_state`) and do
not depend on where the step runs. Between
steps the masters may leave the device (`release`/`restore`, used by the optimizer
offload); they must be back before `step`, `state_dict` or `load_state_dict`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpress.errors import SwapError, UserError
from mpress.runtime.memory.host_pool import PinnedHostPool

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the optimizer over the tensors it steps (e.g. `lambda ts: torch.optim.Adam(ts)`)."""

MASTER_DTYPE = torch.float32


class Kind(enum.Enum):
    """Which tensor the optimizer steps for one parameter (see the module docstring)."""

    PARAM = "param"
    DEVICE_MASTER = "device-master"
    HOST_COPY = "host-copy"


@dataclass
class _Entry:
    """One parameter and the tensor the optimizer steps for it."""

    name: str
    param: nn.Parameter
    kind: Kind
    target: torch.Tensor
    """What the optimizer steps: `param` (PARAM) or an fp32 copy (leaf, no autograd)."""
    staging: torch.Tensor | None = None
    """HOST_COPY of a parameter on an accelerator: host buffer in the parameter's dtype
    that gradients come into and rounded parameters go out from (a view of a pinned slab)."""
    released: bool = False
    """DEVICE_MASTER only: its storage is away (`release`) until `restore`."""
    unmade: bool = False
    """DEVICE_MASTER made away (`MasterWeights(away=...)`): released, its value not yet
    handed out (`make_away`)."""
    home: torch.Tensor | None = None
    """HOST_COPY whose working parameter lives on the host (a `param:` host rule): the host
    tensor in the parameter's dtype that holds it between uses, which the step writes
    (a view of a pinned slab on an accelerator); the device copy exists only while the
    program has it fetched (`mpress.runtime.layer_data`)."""
    grad_on_host: bool = False
    """HOST_COPY whose gradients are drained to the host after each backward (a `grad:`
    host rule): `staging` holds their sum over the step's microbatches."""
    grad_ready: bool = False
    """`grad_on_host`: `staging` holds this step's sum (at least one microbatch drained)."""

    @property
    def is_copy(self) -> bool:
        return self.kind is not Kind.PARAM


class MasterWeights:
    """The tensors one optimizer steps for a set of parameters, and the copies between them.

    params: the model's parameters by name (their order is the optimizer's order).
    make_optimizer: builds the optimizer over `tensors()`.
    host: names of parameters whose step runs on the host (`optimizer_step: host`).
    A host copy of a parameter on CUDA gets a pinned staging buffer in the parameter's
    dtype (what crosses PCIe); its fp32 master is pageable host memory.
    slabs: `host` grouped by the pinned slab their staging buffers share (the trainer: one
    per stage, as the static half counts them); host parameters in no group share one
    more. A slab is a `PinnedHostPool`, pinned in place to its alignment, not through
    torch's pinned allocator, which rounds each allocation up to a power of two. `close()`
    unpins them.
    away: names of parameters whose device master starts off the device (the optimizer
    offload's planned layers): it is made released, with no storage, and `make_away`
    hands out its value when the caller sends it away -- one at a time, so a stage's
    start-up never holds every master on the device at once.
    homes: per stage, host parameters whose working parameter lives on the host (`param:`
    host rules): each group's home copies are views of one more pinned slab (plain host
    tensors without an accelerator), filled with the parameters' values now.
    host_grads: host parameters whose gradients are summed on the host (`grad:` host
    rules) in their staging buffers (plain host tensors without an accelerator)."""

    def __init__(self, params: dict[str, nn.Parameter], make_optimizer: OptimizerFactory, *,
                 host: Collection[str] = (), slabs: Sequence[Collection[str]] = (),
                 away: Collection[str] = (), homes: Sequence[Collection[str]] = (),
                 host_grads: Collection[str] = ()) -> None:
        unknown = sorted((set(host) | set(host_grads) | {n for g in homes for n in g}) - set(params))
        if unknown:
            raise UserError(f"host optimizer step for unknown parameters: {', '.join(unknown[:3])}")
        self._entries: dict[str, _Entry] = {}
        with torch.no_grad():
            for name, p in params.items():
                self._entries[name] = _make_entry(name, p, on_host=name in host, away=name in away)
        self.slabs: list[PinnedHostPool] = [slab for group in _slab_groups(host, slabs)
                                            if (slab := self._stage_through_slab(group)) is not None]
        """The pinned slabs the staging buffers and home copies are views of (none
        without an accelerator)."""
        not_host = sorted((set(host_grads) | {n for g in homes for n in g}) - set(host))
        if not_host:
            raise UserError(f"parameters kept on the host need the host optimizer step: {', '.join(not_host[:3])}")
        with torch.no_grad():
            for name in host_grads:
                e = self._entries[name]
                e.grad_on_host = True
                if e.staging is None:  # no accelerator: the sum is host memory as it is
                    e.staging = torch.empty(e.param.shape, dtype=e.param.dtype)
            for group in homes:
                slab = self._home_slab(list(group))
                if slab is not None:
                    self.slabs.append(slab)
        self.optimizer = make_optimizer([e.target for e in self._entries.values()])

    def _stage_through_slab(self, names: list[str]) -> PinnedHostPool | None:
        """Give the host copies of accelerator parameters among `names` staging buffers
        carved from one new pinned slab (`_carve_slab`); None when none needs one."""
        entries = [e for n in names if _on_accelerator((e := self._entries[n]).param)]
        if not entries:
            return None
        slab, views = _carve_slab(entries, "host-step staging buffers")
        for e, view in views:
            e.staging = view
        return slab

    def _home_slab(self, names: list[str]) -> PinnedHostPool | None:
        """Give `names` home copies with their parameters' values: views of one new
        pinned slab for accelerator parameters (`_carve_slab`),
        host tensors otherwise; the slab, or None."""
        entries = [self._entries[n] for n in names]
        for e in entries:
            if not _on_accelerator(e.param):
                e.home = e.param.detach().to("cpu", copy=True)
        on_device = [e for e in entries if _on_accelerator(e.param)]
        if not on_device:
            return None
        slab, views = _carve_slab(on_device, "host parameters")
        for e, view in views:
            e.home = view
            view.copy_(e.param.detach())
        return slab

    def close(self) -> None:
        """Unpin the staging slabs (idempotent); no copy may still use them."""
        for slab in self.slabs:
            slab.close()

    # ---- queries ---------------------------------------------------------------------

    def tensors(self) -> list[torch.Tensor]:
        """What the optimizer steps, one per parameter, in the parameters' order."""
        return [e.target for e in self._entries.values()]

    def target(self, name: str) -> torch.Tensor:
        """The tensor the optimizer steps for parameter `name` (its key in `optimizer.state`)."""
        return self._entry(name).target

    def kind(self, name: str) -> Kind:
        return self._entry(name).kind

    def unmade(self, name: str) -> bool:
        """Whether `name`'s master was made away and its value not yet handed out."""
        return self._entry(name).unmade

    def names(self, kind: Kind | None = None) -> list[str]:
        """Parameter names (of one kind), in order."""
        return [n for n, e in self._entries.items() if kind is None or e.kind is kind]

    def home(self, name: str) -> torch.Tensor | None:
        """The host tensor holding `name`'s working parameter between uses, or None (it
        stays on its device)."""
        return self._entry(name).home

    def homes(self) -> dict[str, torch.Tensor]:
        """Every parameter kept on the host: name -> its home copy."""
        return {n: e.home for n, e in self._entries.items() if e.home is not None}

    def host_grad(self, name: str) -> tuple[torch.Tensor, bool]:
        """(`name`'s host gradient buffer, whether it holds this step's sum already) for a
        parameter whose gradients are summed on the host; `mark_host_grad` once drained."""
        e = self._entry(name)
        if not e.grad_on_host:
            raise UserError(f"parameter {name}: its gradients stay on its device")
        return e.staging, e.grad_ready  # type: ignore[return-value]

    def mark_host_grad(self, name: str) -> None:
        """`name`'s host gradient buffer holds this step's sum (a microbatch was drained)."""
        self._entry(name).grad_ready = True

    def discard_host_grads(self) -> None:
        """Forget the gradient sums on the host (the next drain copies again), as zeroing
        the gradients on the device forgets theirs."""
        for e in self._entries.values():
            e.grad_ready = False

    def host_buffers(self) -> list[torch.Tensor]:
        """The host tensors made here beside the masters (staging buffers, home copies)."""
        return [t for e in self._entries.values() for t in (e.staging, e.home) if t is not None]

    def nbytes(self, name: str) -> int:
        """Bytes of the stepped tensor of `name` (a master's fp32 bytes; 0 for PARAM)."""
        e = self._entry(name)
        return e.param.numel() * MASTER_DTYPE.itemsize if e.is_copy else 0

    # ---- the step --------------------------------------------------------------------

    def step(self, names: Collection[str] | None = None) -> None:
        """Gradients in, `optimizer.step()`, parameters out, gradients cleared (see the
        module docstring), for the parameters `names` (default: all). Stepping a model's
        parameters in several calls (one layer at a time, so the step's temporaries are
        one layer's) gives the same values as one call: Adam's update of a parameter reads
        only that parameter's gradient and states. Released masters must have been
        restored."""
        entries = self._chosen(names)
        self._check_home("step", entries)
        chosen = {id(e) for e in entries}
        # the optimizer skips tensors without a gradient: hide those of the others
        hidden = [(e.target, e.target.grad) for e in self._entries.values()
                  if id(e) not in chosen and e.target.grad is not None]
        with torch.no_grad():
            try:
                for target, _grad in hidden:
                    target.grad = None
                self._grads_in(entries)
                self.optimizer.step()
            finally:
                for target, grad in hidden:
                    target.grad = grad
            for e in entries:
                e.target.grad = None
                e.param.grad = None
                e.grad_ready = False
            self._params_out(entries)

    def discard_grads(self, names: Collection[str] | None = None) -> None:
        """Drop the gradients of the parameters `names` (default: all) without stepping:
        a skipped step (a non-finite gradient norm) changes no parameter, master or
        optimizer state."""
        for e in self._chosen(names):
            e.param.grad = None
            e.target.grad = None
            e.grad_ready = False

    def _grads_in(self, entries: list[_Entry]) -> None:
        devices: set[torch.device] = set()
        for e in entries:
            if e.staging is not None and e.param.grad is not None and not e.grad_on_host:
                e.staging.copy_(e.param.grad, non_blocking=True)  # device -> pinned host
                devices.add(e.param.device)
        for device in devices:
            # the CPU reads the staging buffers next: wait for these copies (an event on the
            # stream that ran them), not for the whole device; blocking: the thread sleeps
            # in cudaEventSynchronize instead of spinning on a core the host Adam needs
            done = torch.cuda.Event(blocking=True)
            done.record(torch.cuda.current_stream(device))
            done.synchronize()
        for e in entries:
            grad = e.param.grad
            if not e.is_copy:
                continue
            if e.grad_on_host:  # already summed in its staging buffer, drained by the program
                e.target.grad = e.staging.to(MASTER_DTYPE, copy=True) if e.grad_ready else None
                continue
            if grad is None:
                e.target.grad = None  # an unused parameter: the optimizer skips it, as it would the param
                continue
            source = e.staging if e.staging is not None else grad
            # always a new fp32 tensor when the source is the parameter's own gradient
            e.target.grad = source.to(MASTER_DTYPE, copy=source is grad)

    def _params_out(self, entries: list[_Entry]) -> None:
        for e in entries:
            if e.home is not None:
                e.home.copy_(e.target)  # round on the host, where the parameter lives
            elif e.staging is not None:
                e.staging.copy_(e.target)                   # round on the host
                e.param.copy_(e.staging, non_blocking=True)  # pinned host -> device
                # The staging buffer is written again only by the next step's gradient
                # copy, which the same stream runs after this one.
            elif e.is_copy:
                e.param.copy_(e.target)  # round (device master) or copy back (host copy, CPU params)

    # ---- masters off the device (optimizer offload) ------------------------------------

    def release(self, name: str) -> torch.Tensor:
        """Detach the storage of `name`'s device master and return a tensor over it (for the
        caller to move away); the master keeps its identity (the optimizer's key) with no
        storage until `restore`. Only DEVICE_MASTER entries can be released."""
        e = self._entry(name)
        if e.kind is not Kind.DEVICE_MASTER or e.released:
            raise UserError(f"parameter {name}: only a device master on the device can be released "
                            f"({e.kind.value}{', released' if e.released else ''})")
        data = e.target.detach()  # a new tensor over the same storage
        with torch.no_grad():
            e.target.set_(torch.empty(0, dtype=MASTER_DTYPE, device=e.param.device))
        e.released = True
        return data

    def make_away(self, name: str) -> torch.Tensor:
        """The value of `name`'s device master, made now for the caller to move away: a
        master made released (`away`) that was never on the device. Once only."""
        e = self._entry(name)
        if not e.unmade:
            raise UserError(f"parameter {name}: its master was made already ({e.kind.value})")
        e.unmade = False
        return e.param.detach().to(MASTER_DTYPE, copy=True)

    def restore(self, name: str, data: torch.Tensor) -> None:
        """Give `name`'s master the storage of `data` (the value `release` handed out)."""
        e = self._entry(name)
        if not e.released or e.unmade or tuple(data.shape) != tuple(e.param.shape) or data.dtype != MASTER_DTYPE:
            raise UserError(f"parameter {name}: cannot restore a {data.dtype} {tuple(data.shape)} master "
                            f"for a {tuple(e.param.shape)} parameter ({e.kind.value}"
                            f"{', released' if e.released else ', not released'})")
        with torch.no_grad():
            e.target.set_(data)
        e.released = False

    # ---- checkpoints -----------------------------------------------------------------

    def state_dict(self, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """fp32 masters of the parameters that are not fp32 (their values are not in the
        model's state dict), by parameter name; empty for an fp32 model. Host copies, made
        one tensor at a time. `names`: only these parameters (default: all); their
        masters must be home."""
        entries = self._chosen(names)
        self._check_home("state_dict", entries)
        return {e.name: e.target.detach().to("cpu", copy=True) for e in entries
                if e.is_copy and e.param.dtype != MASTER_DTYPE}

    def load_state_dict(self, masters: dict[str, torch.Tensor], names: Collection[str] | None = None) -> None:
        """Set every copy, in place: from `masters` where it has the parameter, else from
        the parameter (upcast; call after loading the model). `names`: only these
        parameters (default: all); their masters must be home. Names in `masters` that are
        not parameters, or (with `names`) not among `names`, are an error."""
        entries = self._chosen(names)
        self._check_home("load_state_dict", entries)
        unknown = sorted(set(masters) - {e.name for e in entries})
        if unknown:
            raise UserError(f"checkpoint has master weights for unknown parameters: {', '.join(unknown[:3])}")
        with torch.no_grad():
            for e in entries:
                if e.is_copy:  # (a parameter kept on the host: its home copy has its value)
                    e.target.copy_(masters.get(e.name, e.home if e.home is not None else e.param))

    def _chosen(self, names: Collection[str] | None) -> list[_Entry]:
        return list(self._entries.values()) if names is None else [self._entry(n) for n in names]

    def _check_home(self, action: str, entries: list[_Entry] | None = None) -> None:
        away = [e.name for e in (self._entries.values() if entries is None else entries) if e.released]
        if away:
            raise SwapError(f"cannot {action}: the master weights of {', '.join(away[:3])} are off the device "
                            "(restore them first)")

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise UserError(f"no parameter named {name!r}") from None


def _on_accelerator(p: torch.Tensor) -> bool:
    """Whether `p` lives across PCIe from the host (its host copy needs pinned staging)."""
    return p.device.type == "cuda"


def _make_entry(name: str, p: nn.Parameter, *, on_host: bool, away: bool = False) -> _Entry:
    if not p.is_floating_point():
        raise UserError(f"parameter {name} is {p.dtype}; the optimizer steps floating-point parameters")
    if on_host:
        # Only the staging buffer crosses PCIe (gradients in, rounded parameters out); the
        # fp32 master stays on the host, where the CPU's optimizer steps it: pageable.
        target = torch.empty(p.shape, dtype=MASTER_DTYPE)
        target.copy_(p.detach())
        # an accelerator parameter's staging buffer: a view of its slab (`_stage_through_slab`)
        return _Entry(name=name, param=p, kind=Kind.HOST_COPY, target=target)
    if p.dtype == MASTER_DTYPE:
        return _Entry(name=name, param=p, kind=Kind.PARAM, target=p)
    if away:  # the optimizer's key, with no storage until the offload restores it
        target = torch.empty(0, dtype=MASTER_DTYPE, device=p.device)
        return _Entry(name=name, param=p, kind=Kind.DEVICE_MASTER, target=target, released=True, unmade=True)
    target = p.detach().to(MASTER_DTYPE, copy=True)
    return _Entry(name=name, param=p, kind=Kind.DEVICE_MASTER, target=target)


def _slab_groups(host: Collection[str], slabs: Sequence[Collection[str]]) -> list[list[str]]:
    """`host` by slab: the groups of `slabs`, then the host parameters in none of them."""
    seen: set[str] = set()
    groups = []
    for group in slabs:
        names = list(group)
        for name in names:
            if name not in host or name in seen:
                raise UserError(f"staging slabs: {name} is not stepped on the host, or is in two slabs")
            seen.add(name)
        groups.append(names)
    rest = [n for n in host if n not in seen]
    return groups + [rest] if rest else groups


def _carve_slab(entries: list[_Entry], owner: str) -> tuple[PinnedHostPool, list[tuple[_Entry, torch.Tensor]]]:
    """One new pinned slab (on the entries' device) holding a contiguous buffer shaped
    as each entry's parameter, packed by element size, largest first (every buffer then
    starts on a multiple of its own, so the slab holds exactly their bytes); the slab and
    each entry with its buffer."""
    entries = sorted(entries, key=lambda e: -e.param.element_size())
    slab = PinnedHostPool(sum(e.param.numel() * e.param.element_size() for e in entries), pin_memory=True,
                          device=entries[0].param.device)
    block = slab.allocate(slab.capacity_bytes, owner=owner)
    views, offset = [], 0
    for e in entries:
        nbytes = e.param.numel() * e.param.element_size()
        views.append((e, block.strided(e.param.dtype, tuple(e.param.shape), _contiguous_stride(e.param.shape),
                                       offset, nbytes)))
        offset += nbytes
    return slab, views


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for d in reversed(shape):
        out.append(stride)
        stride *= max(int(d), 1)
    return tuple(reversed(out))
