"""A trained model out of a checkpoint, in a form other tools load.

A checkpoint (`mpress.launcher.checkpoints.checkpoint`) is one torch.distributed.checkpoint (DCP)
folder per step, keyed by the whole model's module paths (`model.<name>`), with the
job's config in its manifest. `export_checkpoint` reads the model's keys offline -- DCP's
own loader in this one process (`dcp.load(..., no_dist=True)`), no process group -- and
writes

* for a Hugging Face job (`hf_config`): `config.json` and `model.safetensors` with the
  original transformers parameter names, so `AutoModelForCausalLM.from_pretrained(DIR)`
  (or `AutoModelForMaskedLM` for BERT) loads it. mpress's chain (`mpress.models.hf_layers`)
  holds the HF model's own modules, so each chain name maps to the HF name of the same
  tensor: the HF model is built on the meta device (no memory, no init) and the chain from
  it, and tensor identity gives the map. A tied weight (GPT-2's and BERT's output
  projection is the token embedding; a pipeline keeps a copy on the last stage) is
  written once, under the name `named_parameters()` keeps -- the one transformers saves
  -- and the copies must be equal (they are: the trainer sums their gradients).
* for a preset or a user's module: `model.safetensors`, the full state dict keyed by
  module path as the checkpoint names it (every key, tied copies included), and
  `mpress_model.json`: what the model is (the preset's config, or the module's factory).

Every problem -- no such folder, no complete step, a file the manifest lists missing, a
parameter the model has and the checkpoint lacks -- is a one-line `UserError`.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mpress.config.loader import to_dict
from mpress.config.model_config import load_model_config
from mpress.errors import UserError
from mpress.launcher.checkpoints.manifest import MANIFEST, Manifest, newest_complete, read_complete

STEP_NAME = re.compile(r"step\d+")
"""A step folder's name (`stepNNNNNN`, `mpress.launcher.checkpoints.manifest.step_folder`)."""
MODEL_PREFIX = "model."
"""The checkpoint's keys of the model's parameters and buffers."""
WEIGHTS_FILE = "model.safetensors"
MPRESS_MODEL_FILE = "mpress_model.json"


def find_step(path: Path) -> tuple[Path, Manifest]:
    """The complete step folder `path` names: a step folder itself (`stepNNNNNN`, with its
    manifest) or a checkpoint directory (its newest complete step)."""
    if not path.is_dir():
        raise UserError(f"no such checkpoint directory {path}")
    if (path / MANIFEST).exists() or STEP_NAME.fullmatch(path.name):
        manifest, why = read_complete(path)
        if manifest is None:
            raise UserError(f"{path}: an incomplete checkpoint: {why}")
        return path, manifest
    folder, manifest, skipped = newest_complete(path)
    if folder is None or manifest is None:
        more = f" (incomplete: {'; '.join(skipped)})" if skipped else ""
        raise UserError(f"{path}: no complete checkpoint step in it{more}; checkpoint.dir of mpress train holds "
                        "stepNNNNNN folders")
    return folder, manifest


def read_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The model's tensors saved in step folder `folder`, keyed by module path (the
    checkpoint's `model.` keys without the prefix), on the host; optimizer state, master
    weights and generators are not read."""
    try:
        reader = dcp.FileSystemReader(folder)
        saved = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # a missing or unreadable .metadata file
        raise UserError(f"{folder}: not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    flat = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in saved.items()
            if key.startswith(MODEL_PREFIX) and not isinstance(md, BytesStorageMetadata)}
    if not flat:
        raise UserError(f"{folder}: the checkpoint holds no model parameters (no {MODEL_PREFIX}* keys)")
    try:
        with warnings.catch_warnings():  # DCP warns that it runs in one process: it is asked to
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=reader, no_dist=True,
                     planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    except Exception as exc:  # a data file missing or cut short
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"{folder}: cannot read the checkpoint's data ({type(exc).__name__}: {first[:200]})") from None
    return {key[len(MODEL_PREFIX):]: t for key, t in flat.items()}


def hf_state(chain_state: dict[str, torch.Tensor], config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """The HF model's state dict (its own names, a tied weight once) from the chain's
    `chain_state`, and the model's transformers config; `config` is the job's train config."""
    from mpress.models.hf_config import resolve_hf
    from mpress.models.hf_layers import build_chain
    from mpress.models.hf_layout import find_layout, layout_from_patterns

    source = resolve_hf(config["hf_config"], seq_len=config.get("seq_len"), layers=config.get("layers"))
    with torch.device("meta"):  # shapes and names only: nothing allocated, nothing initialised
        model = source.build_model()
        layout = layout_from_patterns(model, source.layers) if source.layers else find_layout(model)
        chain = build_chain(model, layout)
    kept = {id(p): name for name, p in model.named_parameters()}  # a tied weight: the name transformers keeps
    hf_names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        hf_names.setdefault(id(t), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for name, t in chain.state_dict(keep_vars=True).items():
        target = kept.get(id(t)) or next(iter(hf_names.get(id(t), [])), None)
        if target is None:
            continue  # the chain's own buffers (a block's copy of the rotary tables)
        if name not in chain_state:
            raise UserError(f"the checkpoint lacks {name} ({target} of {source.label}): an incomplete checkpoint")
        value = chain_state[name]
        if target in out and not torch.equal(out[target], value):
            raise UserError(f"the tied copies of {target} differ in the checkpoint ({name}): not one weight")
        out.setdefault(target, value)
    missing = [n for n, t in model.state_dict(keep_vars=True).items() if kept.get(id(t), n) not in out]
    if missing:
        raise UserError(f"{source.label}: the chain does not hold {', '.join(missing[:3])}: cannot export it")
    return out, model.config


def export_checkpoint(path: Path, out: Path) -> tuple[Path, str]:
    """Write the model of the checkpoint at `path` (a step folder or a checkpoint
    directory: its newest complete step) to the folder `out`; returns the step folder
    read and what was written (one line)."""
    folder, manifest = find_step(path)
    state = read_model_state(folder)
    config = manifest.config
    out.mkdir(parents=True, exist_ok=True)
    if config.get("hf_config") is not None:
        tensors, hf_config = hf_state(state, config)
        hf_config.save_pretrained(str(out))
        _save(tensors, out / WEIGHTS_FILE)
        return folder, (f"{len(tensors)} tensors of {config['hf_config']} under transformers' names, "
                        f"config.json + {WEIGHTS_FILE}")
    _save(state, out / WEIGHTS_FILE)
    described: dict[str, Any] = {"step": manifest.step, "dtype": manifest.dtype, "seed": manifest.seed,
                                 "model_fingerprint": manifest.model_fingerprint}
    if config.get("model") is not None:
        model = load_model_config(config["model"])
        described.update(kind="preset", model=config["model"], config=to_dict(model),
                         dropout=config.get("dropout"))
    else:
        described.update(kind="module", module=config.get("module"), layers=config.get("layers"))
    (out / MPRESS_MODEL_FILE).write_text(json.dumps(described, indent=1) + "\n")
    return folder, f"{len(state)} tensors keyed by module path, {WEIGHTS_FILE} + {MPRESS_MODEL_FILE}"


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file (contiguous tensors, each its own storage)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("export needs the safetensors package: pip install safetensors "
                        "(or pip install 'mpress[hf]')") from None
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


__all__ = ["MPRESS_MODEL_FILE", "WEIGHTS_FILE", "export_checkpoint", "find_step", "hf_state", "read_model_state"]
