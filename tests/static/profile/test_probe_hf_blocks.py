"""An HF model's blocks are one kind of layer to the memory probe: the built-in tiny
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

from mpress.hardware.server import load_hardware
from mpress.models.hf_config import HF_CONFIG_DIR
from mpress.static.profile import memory_probe
from mpress.static.profile.fake_profile import profile_hf_model

pytest.importorskip("transformers")


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
