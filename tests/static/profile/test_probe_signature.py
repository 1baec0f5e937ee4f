"""The memory probe probes each kind of layer once: layers of one signature
(`memory_probe.layer_signature`) share a probe, and what `probe_layers` returns is what
probing every layer on its own returns, also where layers differ only in what their
attributes make them compute.

An HF model's blocks are one kind of layer to the memory probe: the built-in tiny
GPT-2, Llama and BERT configs are probed once per kind -- embed, one block, head -- and
their fake profiles equal, layer for layer, the profiles made with every layer probed on
its own (no signature shared). A GPT-2 whose attention is scaled by the inverse layer
index (each block's `scaling` attribute made from its `layer_idx`) still tells its blocks
apart, with the same profile. Before, each block's `layer_idx` and its own
copy of the model config made every block a kind of its own (a 7B Llama probed 34 layers
in 70 s)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mpress.hardware.server import load_hardware
from mpress.models.hf_config import HF_CONFIG_DIR
from mpress.static.profile import memory_probe
from mpress.static.profile.fake_profile import profile_hf_model
from mpress.static.profile.memory_probe import layer_signature, probe, probe_layers


class Gate(nn.Module):
    """Squares its input (saving it) or adds to it (saving nothing): what it keeps depends
    on an attribute, not on its parameters."""

    def __init__(self, square: bool, width: int = 16) -> None:
        super().__init__()
        self.square = square
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * y if self.square else y + 1


class Stack(nn.Module):
    def __init__(self, gates: list[Gate]) -> None:
        super().__init__()
        self.gates = nn.ModuleList(gates)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for g in self.gates:
            x = g(x)
        return self.head(x)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def test_probing_each_kind_once_finds_what_probing_every_layer_finds():
    torch.manual_seed(0)
    model = Stack([Gate(True), Gate(True), Gate(False), Gate(True), Gate(False)])
    x = torch.randn(3, 16, requires_grad=True)
    paths = [f"gates.{i}" for i in range(5)] + ["head"]
    shared = probe_layers(model, (x,), paths, loss_fn=_loss)
    # each layer alone, on the input the model hands it
    alone, h = [], x
    for i, path in enumerate(paths):
        layer = model.get_submodule(path)
        arg = h.detach().clone().requires_grad_(True)
        alone.append(probe(layer, (arg,), loss_fn=_loss if i == len(paths) - 1 else None))
        with torch.no_grad():
            h = layer(h)
    assert [p.plain for p in shared] == [p.plain for p in alone]
    assert [p.recomputed for p in shared] == [p.recomputed for p in alone]
    assert [p.options for p in shared] == [p.options for p in alone]
    assert [p.param_grad_bytes for p in shared] == [p.param_grad_bytes for p in alone]
    # the squaring gates keep more than the adding ones: a probe shared across the two
    # kinds would have made these equal
    assert shared[0].plain.kept_bytes > shared[2].plain.kept_bytes
    # two kinds of gate over five gates, and the head: three probes
    assert len({id(p) for p in shared}) == 3


def test_a_signature_tells_apart_what_a_probe_depends_on():
    x = torch.randn(3, 16, requires_grad=True)
    a, b = Gate(True), Gate(True)
    assert layer_signature(a, (x,)) == layer_signature(b, (x,))
    assert layer_signature(a, (x,)) != layer_signature(Gate(False), (x,))  # an attribute
    assert layer_signature(a, (x,)) != layer_signature(a, (x.detach(),))  # the input's gradient
    assert layer_signature(a, (x,)) != layer_signature(a, (torch.randn(4, 16, requires_grad=True),))  # its shape
    tied, untied = Gate(True), Gate(True)
    tied.extra = tied.lin.bias  # a second path to the same parameter
    untied.extra = nn.Parameter(torch.zeros(16))  # the same names and shapes, a storage of its own
    assert layer_signature(tied, (x,)) != layer_signature(untied, (x,))
    c = Gate(True)
    c.register_forward_hook(lambda *_: None)  # a hook may change what runs
    assert layer_signature(c, (x,)) != layer_signature(b, (x,))
    assert layer_signature(a, (x, object())) is None  # an argument it cannot describe: probe it
    d = Gate(True)
    d.cache = {}  # an object of its own: not known to match another layer's
    assert layer_signature(d, (x,)) != layer_signature(Gate(True), (x,))


def _profile(name: str, monkeypatch: pytest.MonkeyPatch, *, shared: bool) -> tuple[list, int]:
    """(the profile's layers, how many layers the probe ran on)."""
    probes = []
    real_probe = memory_probe.probe
    with monkeypatch.context() as m:
        m.setattr(memory_probe, "probe", lambda *a, **k: probes.append(1) or real_probe(*a, **k))
        if not shared:
            m.setattr(memory_probe, "layer_signature", lambda *_a: None)
        profile = profile_hf_model(name, microbatch_size=2, hardware=load_hardware("cpu-local"), fake=True)
    return profile.layers, len(probes)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny", "gpt2-scaled"])
def test_hf_blocks_are_probed_once_with_the_profile_of_every_layer_probed(name, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    if name == "gpt2-scaled":
        config = json.loads((HF_CONFIG_DIR / "gpt2-tiny.json").read_text())
        name = str(tmp_path / "gpt2-scaled.json")
        (tmp_path / "gpt2-scaled.json").write_text(json.dumps({**config, "scale_attn_by_inverse_layer_idx": True,
                                                               "reorder_and_upcast_attn": True}))
    shared, probed = _profile(name, monkeypatch, shared=True)
    alone, every = _profile(name, monkeypatch, shared=False)
    assert len(shared) >= 4 and every == len(shared)  # embed, two blocks or more, head
    scaled = name.endswith("gpt2-scaled.json")
    assert probed == (len(shared) if scaled else 3), (probed, [x.name for x in shared])
    assert shared == alone
