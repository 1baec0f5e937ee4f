"""`mpress export CHECKPOINT_DIR --out DIR` (`mpress.launcher.checkpoints.export`): a tiny GPT-2 (its
tied embedding split over 2 ranks) and a tiny Llama trained by `mpress train` come back
through `transformers.AutoModelForCausalLM.from_pretrained` with no missing or unexpected
key, and their logits on a fixed batch are `torch.equal` (fp32) to mpress's chain loaded
from the same checkpoint; a preset's export is its full state dict by module path; a
missing or incomplete checkpoint is one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from mpress.cli import main
from mpress.launcher.checkpoints.export import read_model_state
from tests.support.documented import run_documented

pytestmark = pytest.mark.slow


def _train(tmp_path: Path, config: dict, ranks: int) -> Path:
    """A short `mpress train` of `config` with a checkpoint after its last step."""
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    code, out, err = run_documented(["train", "--config", "train.yaml", "--nproc-per-node", str(ranks),
                                     "--checkpoint.dir", "ckpt", "--run-dir", "run"], cwd=tmp_path)
    assert code == 0, out[-2000:] + err[-2000:]
    return tmp_path / "ckpt"


def _hf_job(name: str) -> dict:
    return {"hf_config": name, "microbatch_size": 2, "num_microbatches": 2, "steps": 2, "log_every": 1,
            "optimizer": {"lr": 0.01}, "plan": "none", "hardware": "cpu-local"}


@pytest.mark.parametrize("name,ranks", [("gpt2-tiny", 2), ("llama-tiny", 1)])
def test_hf_export_loads_in_transformers_with_equal_logits(tmp_path, capsys, name, ranks):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from mpress.models.hf_config import resolve_hf

    ckpt = _train(tmp_path, _hf_job(name), ranks)
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    assert "under transformers' names" in capsys.readouterr().out
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # mpress's model: the chain, with the checkpoint's weights (the whole model's names)
    source = resolve_hf(name)
    chain = source.build_chain()
    state = read_model_state(next(ckpt.glob("step*")))
    own = chain.state_dict()
    assert set(own) <= set(state), set(own) - set(state)
    chain.load_state_dict({k: state[k] for k in own})
    ids = torch.randint(0, source.vocab_size(), (2, source.seq_len), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = chain.eval()(ids)
        theirs = model.eval()(ids).logits
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)
    if name == "gpt2-tiny":  # trained: the tie held, and the exported weight is the trained one
        assert torch.equal(state["embed.tokens.weight"], state["head.lm_head.weight"])
        assert torch.equal(model.lm_head.weight, state["head.lm_head.weight"])
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_preset_export_is_the_state_dict_by_module_path(tmp_path, capsys):
    from safetensors.torch import load_file

    from mpress.config.model_config import load_model_config
    from mpress.models.transformer import build_stage

    job = {"model": "gpt-tiny", "microbatch_size": 2, "num_microbatches": 1, "steps": 1, "plan": "none",
           "seed": 3}
    ckpt = _train(tmp_path, job, 1)
    assert main(["export", str(ckpt / "step000000"), "--out", str(tmp_path / "out")]) == 0
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    saved = read_model_state(ckpt / "step000000")
    assert set(tensors) == set(saved) and all(torch.equal(tensors[k], saved[k]) for k in saved)
    described = json.loads((tmp_path / "out" / "mpress_model.json").read_text())
    assert described["kind"] == "preset" and described["model"] == "gpt-tiny" and described["step"] == 0
    cfg = load_model_config("gpt-tiny")
    assert described["config"]["num_layers"] == cfg.num_layers
    model = build_stage(cfg, 0, cfg.num_layers + 2, seed=0)
    model.load_state_dict(tensors, strict=True)  # every key of the whole model, no other
    next((ckpt / "step000000").glob("*.distcp")).unlink()  # a data file lost: the step is incomplete
    assert main(["export", str(ckpt), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "listed in manifest.json is missing" in err, err


def test_missing_and_incomplete_checkpoints_are_one_line(tmp_path, capsys):
    def error(path: Path) -> str:
        assert main(["export", str(path), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mpress export: error:"), err
        return err

    assert "no such checkpoint directory" in error(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "no complete checkpoint step" in error(tmp_path / "empty")
    step = tmp_path / "ckpt" / "step000003"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"x")
    assert "no manifest.json" in error(step)
    assert "incomplete: step000003" in error(tmp_path / "ckpt")
