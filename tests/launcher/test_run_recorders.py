"""The training options that record the last step beside mpress's own trace: a torch
profiler trace per rank, and on CUDA the caching allocator's history (a memory snapshot,
refused on CPU with one line at start-up)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from mpress.launcher import run_trace
from mpress.contract.plan import TensorRule
from mpress.runtime.train_config import TrainConfig
from tests.launcher.test_train_launcher import base_config, launch
from tests.support.plans import pipeline_plan
from tests.support.traces import events_without_args, format_errors, overlaps


@pytest.fixture
def host_plan(tmp_path):
    plan = pipeline_plan("1f1b", 2, 4, {0: [TensorRule(tensor="layers.1.**", technique="host"),
                                            TensorRule(tensor="layers.0.**", technique="recompute")]})
    path = tmp_path / "plan.yaml"
    plan.save(path)
    return path


@pytest.mark.slow
def test_last_step_is_traced_by_mpress_and_by_the_torch_profiler(host_plan, tmp_path):
    trace, prof = tmp_path / "out" / "trace.json", tmp_path / "out" / "prof"
    res = launch(base_config(host_plan, steps=2, trace=str(trace), profiler_trace=str(prof)), tmp_path,
                 torchrun=False)
    assert res.returncode == 0, res.stderr[-2000:]
    events = json.loads(trace.read_text())["traceEvents"]  # a training trace: what mpress.train wrote
    assert overlaps(events) == [] and events_without_args(events) == [] and format_errors(events) == []
    assert any(e["ph"] == "X" and e["cat"] == "copy" for e in events)
    assert sum(1 for e in events if e["ph"] == "s") == 2 * 4  # activations and gradients of 4 microbatches
    for rank in range(2):
        doc = json.loads((tmp_path / "out" / f"prof.rank{rank}.json").read_text())
        names = {e.get("name") for e in doc["traceEvents"]}
        # the executed actions of this rank's stage, as the runtime names its record_function ranges
        assert {f"mpress:{rank}F0", f"mpress:{rank}B3"} <= names, sorted(n for n in names if "mpress" in str(n))[:20]
    assert "prof.rank<N>.json" in res.stdout


@pytest.mark.slow
def test_memory_snapshot_on_cpu_is_one_line_exit_2(host_plan, tmp_path):
    res = launch(base_config(host_plan, steps=1, memory_snapshot=str(tmp_path / "snap")), tmp_path)
    lines = [x for x in res.stderr.splitlines() if x.startswith("mpress.train:")]
    assert res.returncode != 0 and len(lines) == 1, res.stderr[-2000:]
    assert "memory_snapshot" in lines[0] and "CUDA" in lines[0]
    assert not list(tmp_path.glob("snap*"))


def test_check_options_refuses_a_snapshot_without_cuda():
    cfg = TrainConfig(model="gpt-tiny", memory_snapshot="snap", backend="gloo")
    with pytest.raises(Exception, match="memory_snapshot: records the CUDA caching allocator"):
        run_trace.check_options(cfg, "train.yaml")
    run_trace.check_options(TrainConfig(model="gpt-tiny", profiler_trace="p", backend="gloo"), "train.yaml")


@pytest.mark.cuda
def test_memory_snapshot_records_the_steps_allocations(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = TrainConfig(model="gpt-tiny", memory_snapshot=str(tmp_path / "snap"), profiler_trace=str(tmp_path / "prof"))
    rec = run_trace.start_recorders(cfg, 3, device)
    x = torch.empty(7 << 20, dtype=torch.uint8, device=device)  # the "step": one 7 MiB allocation
    del x
    written = run_trace.stop_recorders(rec)
    assert written == [tmp_path / "snap.rank3.pickle", tmp_path / "prof.rank3.json"]
    with open(written[0], "rb") as f:
        snapshot = pickle.load(f)
    trace = [e for entries in snapshot["device_traces"] for e in entries]
    allocs = [e for e in trace if e["action"] == "alloc" and e["size"] >= 7 << 20]
    assert allocs and any(e["action"] in ("free_requested", "free_completed") and e["addr"] == allocs[-1]["addr"]
                          for e in trace)
    assert json.loads(written[1].read_text())["traceEvents"]
    # recording stopped: a later allocation is not in a new snapshot's history
    torch.empty(5 << 20, dtype=torch.uint8, device=device)
    assert not any(e["size"] == 5 << 20 for entries in torch.cuda.memory._snapshot()["device_traces"]
                   for e in entries)


def test_the_snapshot_records_python_stacks_of_allocations_only(monkeypatch):
    """The recorded step is the timed one: the allocator's history unwinds no C++ stacks
    (torch's default `stacks="all"` does on every allocation and free)."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(k))
    cfg = TrainConfig(model="gpt-tiny", memory_snapshot="snap", backend="nccl")
    rec = run_trace.start_recorders(cfg, 0, torch.device("cuda", 0))
    assert rec is not None and rec.snapshot_path is not None
    assert calls == [{"max_entries": run_trace.SNAPSHOT_MAX_ENTRIES, "device": torch.device("cuda", 0),
                      "context": "alloc", "stacks": "python"}]
