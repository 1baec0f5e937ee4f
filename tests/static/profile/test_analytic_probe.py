"""The analytic profiler's probe cache (`mpress/static/profile/analytic_probe.py`): a
profile made from the disk cache equals the one the probe makes, a later run reads the
cache instead of probing, the key separates what shapes the probe, a damaged entry is
probed again, and `mpress plan` on a warm cache plans without loading torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mpress.config.model_config import load_model_config
from mpress.hardware.server import load_hardware
from mpress.static.profile import analytic_probe
from mpress.static.profile.analytic import analytic_profile

ROOT = Path(__file__).resolve().parents[3]
V100 = load_hardware("dgx1-v100")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty probe cache of this test's own; the in-process memo cleared around it."""
    monkeypatch.setenv(analytic_probe.CACHE_ENV, str(tmp_path / "probes"))
    analytic_probe.probed_kind.cache_clear()
    yield tmp_path / "probes"
    analytic_probe.probed_kind.cache_clear()


def _no_probe(*_args):
    raise AssertionError("the probe ran although the cache holds its summary")


@pytest.mark.parametrize("model", ["gpt-tiny", "bert-tiny", "llama-tiny"])
def test_profile_from_the_cache_equals_the_probed_one(cache, monkeypatch, model):
    cfg = load_model_config(model)
    monkeypatch.setenv(analytic_probe.CACHE_ENV, "off")
    probed = analytic_profile(cfg, V100, 2)
    assert not cache.exists()
    monkeypatch.setenv(analytic_probe.CACHE_ENV, str(cache))
    analytic_probe.probed_kind.cache_clear()
    assert analytic_profile(cfg, V100, 2) == probed  # probed now and stored
    assert len(list(cache.glob("*.json"))) == 3  # embed, a block, head
    analytic_probe.probed_kind.cache_clear()
    monkeypatch.setattr(analytic_probe, "_probe", _no_probe)
    assert analytic_profile(cfg, V100, 2) == probed  # read back, exactly


def test_the_key_separates_what_shapes_the_probe(cache):
    cfg = load_model_config("gpt-tiny")
    key = analytic_probe.probe_key(cfg, 1, 1)
    assert analytic_probe.probe_key(replace(cfg, name="renamed"), 1, 1) == key  # the name shapes nothing
    others = {analytic_probe.probe_key(cfg, 1, 2), analytic_probe.probe_key(cfg, 0, 1),
              analytic_probe.probe_key(replace(cfg, dropout=0.0 if cfg.dropout else 0.1), 1, 1),
              analytic_probe.probe_key(replace(cfg, precision="fp32" if cfg.precision != "fp32" else "bf16"), 1, 1)}
    assert key not in others and len(others) == 4


def test_the_key_follows_the_probes_code(monkeypatch):
    """The sources' text is part of the key: other sources (here fewer of them), another key."""
    cfg = load_model_config("gpt-tiny")
    key = analytic_probe.probe_key(cfg, 1, 1)
    monkeypatch.setattr(analytic_probe, "PROBE_SOURCES", analytic_probe.PROBE_SOURCES[:-1])
    analytic_probe._code_fingerprint.cache_clear()
    try:
        assert analytic_probe.probe_key(cfg, 1, 1) != key
    finally:
        analytic_probe._code_fingerprint.cache_clear()


def test_a_damaged_entry_is_probed_again(cache, monkeypatch):
    cfg = load_model_config("gpt-tiny")
    want = analytic_profile(cfg, V100, 1)
    entries = sorted(cache.glob("*.json"))
    entries[0].write_text('{"summary": {"plain": ')  # a write cut short
    entries[1].write_text(json.dumps({"summary": {}, "param_tensors": 3}))  # another layout
    analytic_probe.probed_kind.cache_clear()
    assert analytic_profile(cfg, V100, 1) == want
    for e in entries[:2]:
        json.loads(e.read_text())["summary"]["plain"]  # rewritten whole


def test_an_unwritable_cache_is_passed_over(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(analytic_probe.CACHE_ENV, str(blocker / "probes"))  # under a file: cannot be made
    analytic_probe.probed_kind.cache_clear()
    try:
        assert analytic_profile(load_model_config("gpt-tiny"), V100, 1).layers
    finally:
        analytic_probe.probed_kind.cache_clear()


def test_plan_on_a_warm_cache_loads_no_torch(tmp_path):
    """`mpress plan` twice in fresh processes: the second reads the probes and never
    imports torch (the CLI and the planner import it only where a probe runs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), analytic_probe.CACHE_ENV: str(tmp_path)}
    script = ("import sys; from mpress.cli import main; "
              "status = main(['plan', '--model', 'gpt-tiny', '--hardware', 'cpu-local', '--json']); "
              "print('torch' in sys.modules, status, file=sys.stderr)")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=False,
                           timeout=300) for _ in range(2)]
    cold, warm = (r.stderr.strip().splitlines()[-1] for r in runs)
    assert cold == "True 0", runs[0].stderr[-2000:]
    assert warm == "False 0", runs[1].stderr[-2000:]
    a, b = (json.loads(r.stdout) for r in runs)
    for figures in (a, b):
        for row in figures["strategies"]:
            row.pop("plan_s")  # the one figure that varies
    assert a == b
