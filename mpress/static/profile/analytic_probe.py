"""The analytic profiler's memory probe of one layer kind, kept on disk between runs.

`analytic_profile` needs, per kind of layer (the embedding, a block: all alike, the head),
what the memory probe (`memory_probe.probe`) finds when the reference layer runs on the
meta device: its memory with and without recompute, the producers of what it saves and
its op-level recompute choices. Running the probe costs about a second and a half of CPU
on a cold process, most of it loading torch and the machinery of its meta kernels; what
it finds depends only on the layer's shape, so the summary (`recompute_options.ProbeSummary`,
plain data) is stored as JSON under the cache directory and read back by later runs,
which then plan without loading torch at all.

The key (`probe_key`) is a SHA-256 of the model's fields (all of them but its name),
the layer kind, the microbatch size, mpress's version, torch's version (read from its
`version.py`, without importing it) and the text of the modules that run the probe or
derive the model's shapes (`PROBE_SOURCES`): a checkout whose model or probe code
changed never reads an older summary. The directory is `$MPRESS_CACHE_DIR` when set,
else `$XDG_CACHE_HOME/mpress/probes` (default `~/.cache/mpress/probes`);
`MPRESS_CACHE_DIR=off` turns the disk cache off. A cache that cannot be read or written
is passed over: the probe runs, as without it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import mpress
from mpress.config.loader import to_dict
from mpress.config.model_config import ModelConfig
from mpress.static.profile.recompute_options import ProbeSummary

PROBE_SOURCES = ("models", "contract", "static/profile", "config")
"""Folders of mpress whose modules the probe runs, or which derive the model's shapes
from its config (`ModelConfig.ffn`, `head_dim`): their text is part of the key."""

CACHE_ENV = "MPRESS_CACHE_DIR"


def cache_dir() -> Path | None:
    """Where summaries are kept; None when `$MPRESS_CACHE_DIR` is `off`."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return None if env == "off" else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mpress" / "probes"


@functools.cache
def _code_fingerprint() -> str:
    """mpress's version, torch's version file and the probe's sources, hashed."""
    h = hashlib.sha256(mpress.__version__.encode())
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is not None and spec.origin is not None:
        version = Path(spec.origin).with_name("version.py")
        h.update(version.read_bytes() if version.exists() else spec.origin.encode())
    root = Path(mpress.__file__).parent
    for folder in PROBE_SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def probe_key(cfg: ModelConfig, kind: int, microbatch_size: int, cc: tuple[int, int] | None = None) -> str:
    """The cache key of layer kind `kind`'s probe for `cfg`, the microbatch size and the
    GPU kernels it runs (`cc`, see `probed_kind`)."""
    fields = {k: v for k, v in to_dict(cfg).items() if k != "name"}
    data = json.dumps({"model": fields, "kind": kind, "microbatch_size": microbatch_size,
                       "cuda": list(cc) if cc is not None else None, "code": _code_fingerprint()}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()


@functools.cache
def probed_kind(cfg: ModelConfig, kind: int, microbatch_size: int,
                cc: tuple[int, int] | None = None) -> tuple[ProbeSummary, int]:
    """(probe summary, parameter tensors) of layer `kind` (0 embed, 1 a block, L+1 the
    head) for one microbatch: from the disk cache, else probed now and stored. `cc`: the
    layer runs the kernels of a GPU of that compute capability (`cuda_kernels.CudaKernels`,
    on the meta device too); None: the CPU's."""
    directory = cache_dir()
    path = directory / f"{probe_key(cfg, kind, microbatch_size, cc)}.json" if directory is not None else None
    if path is not None:
        try:
            data = json.loads(path.read_text())
            return ProbeSummary.from_dict(data["summary"]), int(data["param_tensors"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent, or unreadable: probe again (and overwrite it)
    summary, params = _probe(cfg, kind, microbatch_size, cc)
    if path is not None:
        _store(path, {"model": cfg.name, "kind": kind, "microbatch_size": microbatch_size,
                      "summary": summary.to_dict(), "param_tensors": params})
    return summary, params


def _probe(cfg: ModelConfig, kind: int, microbatch_size: int, cc: tuple[int, int] | None) -> tuple[ProbeSummary, int]:
    """Probe layer `kind` on the meta device (nothing is computed or allocated), the head
    with the model's loss, with its op-level recompute choices; with a GPU's kernels
    where `cc` is given."""
    import torch

    from mpress.models.transformer import TORCH_DTYPES, build_stage, lm_loss
    from mpress.static.profile.cuda_kernels import CudaKernels
    from mpress.static.profile.memory_probe import probe
    from mpress.static.profile.recompute_options import summarize

    layer = build_stage(cfg, kind, kind + 1, device="meta").train()
    b, t = microbatch_size, cfg.seq_len
    if kind == 0:
        x = torch.zeros(b, t, dtype=torch.long, device="meta")
    else:
        x = torch.zeros(b, t, cfg.hidden_size, dtype=TORCH_DTYPES[cfg.precision], device="meta", requires_grad=True)
    targets = torch.zeros(b, t, dtype=torch.long, device="meta")
    loss = (lambda out: lm_loss(out, targets)) if kind == cfg.num_layers + 1 else None
    params = len(list(layer.parameters()))
    with CudaKernels(cc) if cc is not None else contextlib.nullcontext():
        return summarize(probe(layer, (x,), loss_fn=loss)), params


def _store(path: Path, data: dict[str, object]) -> None:
    """Write `data` to `path` whole (a private file renamed into place, so processes that
    probe at once never read half a file); a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
