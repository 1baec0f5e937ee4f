"""HF configs mpress cannot train, refused through the commands in one line (exit 2) before
anything is built (issue 28): encoder-decoders (T5, BART), models without a language-model
head (ViT, CLIP's vision tower), blocks that take an ALiBi bias (Falcon with `alibi:
true`), nonsense sizes (`n_layer: -1`, `num_hidden_layers: 0`); and the families whose
positions start late (RoBERTa at pad_token_id + 1; OPT's offset of 2 is in its table)
default to a sequence length they can run, and the masked LM masks with the mask token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mpress.models.hf_config import batch, mask_token_id, resolve_hf
from tests.support.documented import one_line_error, run_documented

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _save(folder: Path, config: Any, **edits: Any) -> str:
    """`config` saved as folder/config.json with `edits` written over its keys (values
    transformers itself would refuse to build a config from)."""
    config.save_pretrained(folder)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(edits)
    path.write_text(json.dumps(data))
    return str(folder)


def _configs(tmp: Path) -> dict[str, str]:
    t = transformers
    return {
        "t5": _save(tmp / "t5", t.T5Config(vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)),
        "bart": _save(tmp / "bart", t.BartConfig(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1,
                                                 encoder_attention_heads=4, decoder_attention_heads=4,
                                                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16)),
        "vit": _save(tmp / "vit", t.ViTConfig(**SMALL, image_size=32, patch_size=8)),
        "clip-vision": _save(tmp / "clipv", t.CLIPVisionConfig(**SMALL, image_size=32, patch_size=8)),
        "falcon-alibi": _save(tmp / "falcon", t.FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                                             num_attention_heads=4, alibi=True,
                                                             new_decoder_architecture=False,
                                                             max_position_embeddings=16)),
        "n_layer": _save(tmp / "gpt2", t.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                                    bos_token_id=0, eos_token_id=0), n_layer=-1),
        "num_hidden_layers": _save(tmp / "llama", t.LlamaConfig(vocab_size=128, **SMALL, max_position_embeddings=16),
                                   num_hidden_layers=0),
        "hidden_size": _save(tmp / "llama-neg", t.LlamaConfig(vocab_size=128, **SMALL, max_position_embeddings=16),
                             hidden_size=-32),
        "attn_pdrop": _save(tmp / "gpt2-drop", t.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                                            n_positions=16, bos_token_id=0, eos_token_id=0),
                            attn_pdrop=1.5),
    }


REFUSED = {
    "t5": ("encoder-decoder models are not supported",),
    "bart": ("encoder-decoder models are not supported",),
    "vit": ("model_type vit", "no causal language-model head"),
    "clip-vision": ("model_type clip_vision_model", "no causal language-model head"),
    "falcon-alibi": ("alibi", "not supported"),
    "n_layer": ("n_layer must be a positive integer, got -1",),
    "num_hidden_layers": ("num_hidden_layers must be a positive integer, got 0",),
    "hidden_size": ("hidden_size must be a positive integer, got -32",),
    "attn_pdrop": ("attn_pdrop is a probability in [0, 1], got 1.5",),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _configs(tmp_path_factory.mktemp("hf-configs"))


@pytest.mark.parametrize("label", list(REFUSED))
def test_profile_refuses_in_one_line(configs, label, tmp_path):
    code, _out, err = run_documented(["profile", "--hf-config", configs[label], "--seq-len", "8", "--fake",
                                      "--hardware", "cpu-local"], cwd=tmp_path, in_process=True)
    one_line_error(code, err, f"hf_config {configs[label]}", *REFUSED[label])


def test_plan_and_train_refuse_in_one_line(configs, tmp_path):
    code, _out, err = run_documented(["plan", "--hf-config", configs["t5"], "--hardware", "cpu-local"],
                                     cwd=tmp_path, in_process=True)
    one_line_error(code, err, "encoder-decoder models are not supported")
    train = tmp_path / "train.yaml"
    train.write_text(f"hf_config: {configs['n_layer']}\nsteps: 1\nplan: none\nhardware: cpu-local\n")
    code, _out, err = run_documented(["train", "--config", str(train), "--nproc-per-node", "2"], cwd=tmp_path)
    one_line_error(code, err, "hf_config", "n_layer must be a positive integer, got -1")


def test_offset_positions_default_to_what_runs(tmp_path):
    t = transformers
    roberta = _save(tmp_path / "roberta", t.RobertaConfig(vocab_size=128, **SMALL, max_position_embeddings=18,
                                                          pad_token_id=1, architectures=["RobertaForMaskedLM"]))
    opt = _save(tmp_path / "opt", t.OPTConfig(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                              num_attention_heads=4, max_position_embeddings=16))
    assert resolve_hf(roberta).seq_len == 16  # positions 2 .. 17 of a table of 18
    assert resolve_hf(opt).seq_len == 16  # OPT's table has 16 + 2 rows
    for name in (roberta, opt):  # measured: the real forward and backward at the default length
        code, out, err = run_documented(["profile", "--hf-config", name, "--microbatch-size", "2", "--warmup", "0",
                                         "--iters", "1"], cwd=tmp_path, in_process=True)
        assert code == 0 and "measured profile" in out, err
    code, _out, err = run_documented(["profile", "--hf-config", roberta, "--seq-len", "17", "--fake"],
                                     cwd=tmp_path, in_process=True)
    one_line_error(code, err, "seq_len 17", "16 positions at most")


def test_the_masked_lm_masks_with_the_mask_token(tmp_path):
    t = transformers
    cfg = t.BertConfig(vocab_size=128, **SMALL, max_position_embeddings=16, pad_token_id=0,
                       architectures=["BertForMaskedLM"])
    plain = resolve_hf(_save(tmp_path / "plain", cfg))
    assert mask_token_id(plain, 128) == 127  # no mask token anywhere: the last id, never the pad token
    given = resolve_hf(_save(tmp_path / "given", cfg, mask_token_id=103))
    assert mask_token_id(given, 128) == 103
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(123)]
    _save(tmp_path / "vocab", cfg)
    (tmp_path / "vocab" / "vocab.txt").write_text("\n".join(words) + "\n")
    tokenizer = resolve_hf(str(tmp_path / "vocab"))
    assert mask_token_id(tokenizer, 128) == 4
    ids, targets = batch(given, 4, seed=0)
    masked = targets != -100
    assert masked.any() and (ids[masked] == 103).all()


@pytest.mark.parametrize("argv", [["profile", "--model", "gpt-tiny", "--dtype", "bf16"],
                                  ["plan", "--model", "gpt-tiny", "--dtype", "bf16"]])
def test_dtype_is_an_hf_configs_only(argv, tmp_path):
    code, _out, err = run_documented(argv, cwd=tmp_path, in_process=True)
    one_line_error(code, err, "--dtype is the precision of an --hf-config")


def test_plan_of_an_hf_config_records_its_dtype(tmp_path):
    import yaml

    code, _out, err = run_documented(["plan", "--hf-config", "llama-tiny", "--dtype", "bf16", "--hardware",
                                     "cpu-local", "--num-stages", "2", "--device-memory", "420KB", "--out",
                                     "plan.yaml"], cwd=tmp_path, in_process=True)
    assert code == 0, err
    assert yaml.safe_load((tmp_path / "plan.yaml").read_text())["dtype"] == "bf16"


@pytest.mark.parametrize("text,words", [
    ("hf_config: llama-tiny\ndtype: fp8\n", ("dtype: expected one of 'fp32', 'bf16', 'fp16', got 'fp8'",)),
    ("model: gpt-tiny\ndtype: bf16\n", ("dtype: only with hf_config:",)),
])
def test_train_config_dtype_is_checked(text, words, tmp_path):
    (tmp_path / "train.yaml").write_text(text + "steps: 1\nplan: none\nhardware: cpu-local\n")
    code, _out, err = run_documented(["train", "--config", "train.yaml", "--nproc-per-node", "2"], cwd=tmp_path,
                                     in_process=True)
    one_line_error(code, err, "train.yaml", *words)
