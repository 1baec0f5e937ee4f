"""A user's own model as pipeline stages: any `nn.Module` a factory returns, split at its
layer boundaries by torch.distributed.pipelining's own `pipeline()`.

The factory (`package.module:factory`, the contract of `mpress.models.user_module`, the
same the profiler calls) returns the module, an example input of ONE microbatch and
optionally a loss (output -> scalar). Its layers (the units stages are made of,
`mpress.contract.identity`) are the ones the module names itself (`layer_names()`,
`nn.Sequential`, a chain of children) or the ones the user names by pattern (`layers:
["embed", "blocks.*", "head"]`, `mpress.models.user_module.select_layers`).

Why `pipeline()`: a forward that is not a chain (a skip connection around several
layers, glue code between them, a CPU scalar) cannot be cut by running children in a
loop; `pipeline()` traces the forward (torch.export) and splits its graph at the first
call of each stage's first layer, passing whatever crosses a boundary. Its stage modules
keep the whole model's module paths (`blocks.2.l1`), so the tensors they save are named
exactly as in the eager model the profiler ran (`mpress.contract.identity.SavedTensorNamer`), and
a plan made from that profile matches them. Plain pipelining and mpress run the same
split modules, so `torch.equal` between them is meaningful.

Every rank calls the factory under the job's seed, so every rank holds the same
parameters before it keeps only its stages'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from mpress.errors import ConfigError, UserError
from mpress.contract.identity import layer_paths, side_effect_free
from mpress.models.transformer import lm_loss
from mpress.models.user_module import (
    UserModule,
    import_factory,
    as_args,
    default_loss,
    load_user_factory,
    module_fingerprint,
    select_layers,
)

LossFn = Callable[[Any], torch.Tensor]


def _refuse_shared_parameters(stages: Sequence[nn.Module], spec: str) -> None:
    """A parameter two stages use (tied input and output embeddings) would be two copies
    that drift apart, each stage training its own (torch's pipeline() copies it; summing
    their gradients across ranks is not done here): refuse it in one line."""
    seen: dict[str, int] = {}
    for s, module in enumerate(stages):
        for name, _p in module.named_parameters():
            if name in seen:
                raise UserError(f"{spec}: parameter {name} is held by stages {seen[name]} and {s} (a weight shared "
                                "across stages, e.g. tied embeddings); mpress does not train shared weights across "
                                "stages yet: untie it or keep its users in one stage")
            seen[name] = s


def _constants_not_state(module: nn.Module, own: set[str]) -> None:
    """Tensors the trace lifted out of the forward (a `torch.tensor(0.5)` the user wrote
    there becomes a buffer `lifted_tensor_0`) are constants of the code, not state of the
    model: left out of the stage's state dict, so checkpoints hold the model's own
    parameters and buffers only, under the names the user's module gives them (and the
    constants of two stages, each `lifted_tensor_0`, never meet under one key)."""
    for name, buffer in list(module.named_buffers()):
        if name not in own:
            path, _, attr = name.rpartition(".")
            module.get_submodule(path).register_buffer(attr, buffer, persistent=False)


def _as_chain(top: fx.Graph, stages: list[fx.GraphModule]) -> list[fx.GraphModule]:
    """Rewrite the stage modules of a `pipeline()` split so that stage s takes exactly what
    stage s-1 returns: torch's manual `PipelineStage` (which mpress's stages are) receives
    from the previous stage only, while the split may hand a value from stage 0 straight
    to stage 3 (a skip connection). A value that later stages need and a stage does not
    make is passed through it: a placeholder returned as an output, so its gradient flows
    back unchanged. `top`: the split's top-level graph (model inputs, one call per stage)."""
    calls = [n for n in top.nodes if n.op == "call_module"]
    output = next(n for n in top.nodes if n.op == "output")
    if any(v is not calls[-1] and not (v.op == "call_function" and v.args[0] is calls[-1])
           for v in output.all_input_nodes):
        raise UserError("the model returns a value an earlier stage computes (not only the last stage's): "
                        "torch's pipeline schedules take the output from the last stage; return only what the "
                        "last layers compute")
    made_at: dict[fx.Node, int] = {n: -1 for n in top.nodes if n.op == "placeholder"}
    for s, call in enumerate(calls):
        parts = [u for u in call.users if u.op == "call_function"]  # getitems of a tuple result
        made_at.update({v: s for v in (parts or [call])})
    used_at = {call: s for s, call in enumerate(calls)} | {n: len(calls) for n in top.nodes if n.op == "output"}
    last_use = {v: max((used_at[u] for u in v.users), default=-1) for v in made_at}
    into = [[v for v in made_at if made_at[v] < s <= last_use[v]] for s in range(len(calls))]
    into[0] = [v for v in made_at if made_at[v] == -1]  # every model input, used or not: the caller passes all
    for s, (module, call) in enumerate(zip(stages, calls)):
        graph = module.graph
        old = [n for n in graph.nodes if n.op == "placeholder"]
        with graph.inserting_before(old[0]):
            new = {v: graph.placeholder(f"in_{i}") for i, v in enumerate(into[s])}
        for placeholder, arg in zip(old, call.args):
            placeholder.replace_all_uses_with(new[arg])
            graph.erase_node(placeholder)
        if s + 1 < len(calls):
            output = next(n for n in graph.nodes if n.op == "output")
            made = output.args[0]
            parts = [u for u in call.users if u.op == "call_function"]
            mine = {u: made[u.args[1]] for u in parts} if parts else {call: made}
            output.args = (tuple(mine.get(v, new.get(v)) for v in into[s + 1]),)
        graph.lint()
        module.recompile()
    return stages


def check_ranges(ranges: Sequence[tuple[int, int]], num_layers: int, spec: str) -> None:
    """Stage ranges `[start, end)` must tile the `num_layers` layers of `spec`, in order."""
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != num_layers or any(
            a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise UserError(f"stage ranges {list(ranges)} do not tile the {num_layers} layers of {spec}")


@dataclass
class UserModel:
    """A user's model, its example microbatch, its loss and its layer list."""

    spec: str
    """Where it came from: `package.module:factory`."""
    module: nn.Module
    example_input: tuple[torch.Tensor, ...]
    """One microbatch, positional."""
    loss_fn: LossFn
    layers: list[str]
    text: bool = False
    """Trains on text (`data.kind: text`): the example input is one (B, T) tensor of token
    ids, the output (B, T, V) logits, and the loss the next-token cross-entropy against
    the step's targets (`lm_loss`) instead of the factory's loss."""
    _identity: tuple[str, str] = field(init=False, repr=False)
    """(precision, fingerprint), taken at construction: `split` lets the whole module go."""

    def __post_init__(self) -> None:
        dtypes = {p.dtype for p in self.module.parameters()}
        words = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        self._identity = ("+".join(sorted(words.get(d, str(d)) for d in dtypes)), module_fingerprint(self.module))

    @property
    def name(self) -> str:
        return self.spec

    @property
    def precision(self) -> str:
        """The parameters' dtype as a precision word (fp32, bf16, fp16): a checkpoint's identity."""
        return self._identity[0]

    def fingerprint(self) -> str:
        """The module's structure (`module_fingerprint`): what a profile and a plan name the model by."""
        return self._identity[1]

    @property
    def microbatch_size(self) -> int:
        """Samples per microbatch: the example input's leading dimension."""
        return int(self.example_input[0].shape[0])

    def factory(self) -> Callable[[], Any]:
        """The factory the profilers call (`mpress.models.user_module`)."""
        return import_factory(self.spec)

    def split(self, ranges: Sequence[tuple[int, int]]) -> list[nn.Module]:
        """One module per stage: layers `[start, end)` of `ranges` (which must tile the
        layer list), each with a `layer_names()` listing its layers."""
        if self.module is None:
            raise UserError(f"{self.spec}: split once per model (the whole module is let go after a split)")
        check_ranges(ranges, len(self.layers), self.spec)
        self.module.train()
        if len(ranges) == 1:
            stages = [self.module]
        else:
            # here, not at the top: the launcher checks configs through this module, and
            # the splitter's imports (torch's compiler among them) cost it a second of CPU
            from torch.distributed.pipelining import SplitPoint, pipeline

            spec = {self.layers[start]: SplitPoint.BEGINNING for start, _ in ranges[1:]}
            try:
                pipe = pipeline(self.module, mb_args=self.example_input, split_spec=spec)
            except Exception as exc:  # tracing the user's forward failed: their model's problem
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise UserError(f"{self.spec}: torch.distributed.pipelining could not split the model at "
                                f"{', '.join(spec)}: {type(exc).__name__}: {first}") from None
            if pipe.num_stages != len(ranges):
                raise UserError(f"{self.spec}: splitting at {', '.join(spec)} gave {pipe.num_stages} stages, not "
                                f"{len(ranges)} (is every split layer called at the top level of the forward?)")
            stages = _as_chain(pipe.split_gm.graph, [pipe.get_stage_module(s) for s in range(len(ranges))])
        _refuse_shared_parameters(stages, self.spec)
        own = set(self.module.state_dict())
        for module, (start, end) in zip(stages, ranges):
            _constants_not_state(module, own)
            names = list(self.layers[start:end])
            module.layer_names = lambda names=names: names  # type: ignore[method-assign]
            module.train()
        # the stages hold what they need; keeping the whole module would keep every
        # stage's parameters alive on every rank for the whole run
        self.module = None  # type: ignore[assignment]
        return stages

    def stage_io(self, stages: Sequence[nn.Module]) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
        """Example (inputs, outputs) of each stage for one microbatch: the static shapes a
        `PipelineStage` is given (gloo's shape inference can deadlock). Inputs of stages
        after the first carry gradients where they are floating point."""
        io = []
        args = self.example_input
        with torch.no_grad():
            for s, module in enumerate(stages):
                with side_effect_free(module):
                    out = as_args(module(*args))
                inputs = args if s == 0 else tuple(
                    a.detach().requires_grad_(a.is_floating_point()) for a in args)
                io.append((inputs, tuple(o.detach() for o in out)))
                args = out
        return io

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The user's loss in the schedule's `(output, target)` form (the target is unused);
        on text, the cross-entropy of the logits against the next tokens `target`."""
        return lm_loss(output, target) if self.text else self.loss_fn(output)

    def text_shape(self) -> tuple[int, int]:
        """(seq_len, vocab_size) of the model as a language model on text: the example's
        positions and the last dimension of its output (one forward of the example, with
        no trace). Raises `UserError` for a model that does not take token ids."""
        if self.module is None:
            raise UserError(f"{self.spec}: text_shape before the split (the whole module is let go after it)")
        ids = self.example_input[0]
        if len(self.example_input) != 1 or ids.dim() != 2 or ids.is_floating_point():
            raise UserError(f"data.kind: text: {self.spec}'s example input must be one (batch, seq_len) tensor of "
                            f"token ids, got {[(tuple(t.shape), str(t.dtype)) for t in self.example_input]}")
        with torch.no_grad(), side_effect_free(self.module):
            out = self.module(ids)
        if not isinstance(out, torch.Tensor) or out.shape[:2] != ids.shape or out.dim() != 3:
            raise UserError(f"data.kind: text: {self.spec} must return (batch, seq_len, vocab) logits for its ids "
                            f"{tuple(ids.shape)}, got {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out)}")
        return int(ids.shape[1]), int(out.shape[2])

    def text_batch(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """A batch of text windows (ids, next tokens) as the trainer passes it: positional
        inputs and targets."""
        return (ids,), targets

    def batch(self, *, step: int, num_microbatches: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Synthetic inputs of step `step` (num_microbatches microbatches along dim 0) shaped
        like the example input, deterministic in (seed, step): floating tensors standard
        normal, integer tensors uniform over the example's value range; and a dummy target
        per sample."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        inputs = []
        for ex in self.example_input:
            shape = (ex.shape[0] * num_microbatches, *ex.shape[1:])
            if ex.is_floating_point():
                inputs.append(torch.randn(shape, generator=g, dtype=ex.dtype))
            else:
                low, high = int(ex.min()), int(ex.max())
                inputs.append(torch.randint(low, high + 1, shape, generator=g, dtype=ex.dtype))
        return tuple(inputs), torch.zeros(shape[0])


def load_user_model(spec: str, *, layers: Sequence[str] | None = None, seed: int = 0) -> UserModel:
    """Call the factory `spec` under `seed` and find its layers (`layers` patterns, else
    the module's own: `mpress.contract.identity.layer_paths`). One line (`UserError`) on any problem."""
    torch.manual_seed(seed)
    user = load_user_factory(spec)
    module = user.module
    example = as_args(user.example_input)
    found = select_layers(module, layers) if layers else layer_paths(module, example)
    if found == [""]:
        raise UserError(f"{spec}: the forward of {type(module).__name__} does not chain its children, so it is "
                        f"one layer; name its layers (train config `layers:`, e.g. [\"embed\", \"blocks.*\", \"head\"], "
                        f"or a layer_names() method)")
    return UserModel(spec=spec, module=module, example_input=example, loss_fn=user.loss_fn or default_loss,
                     layers=found)


def check_user_module(spec: str, layers: Sequence[str] | None, source: str) -> tuple[int, int]:
    """(number of layers, microbatch size) of the factory `spec`, built on the meta device
    (nothing allocated, no forward of real data: a launcher checks this before any rank
    starts). A problem is a one-line `ConfigError` naming `source` and the key."""
    try:
        with torch.device("meta"):
            user = load_user_factory(spec)
    except UserError as exc:
        raise ConfigError(source, "module", str(exc)) from None
    try:
        with torch.device("meta"):
            args = as_args(user.example_input)
            found = select_layers(user.module, layers) if layers else layer_paths(user.module, args)
    except UserError as exc:
        raise ConfigError(source, "layers", str(exc)) from None
    if found == [""]:
        raise ConfigError(source, "layers", f"the forward of {type(user.module).__name__} does not chain its "
                                            "children, so it is one layer: name its layers (e.g. [embed, \"blocks.*\", head])")
    return len(found), UserModule(module=user.module, example_input=user.example_input).microbatch_size
