"""The trace of an executed step: the emulator's track layout, every executed action on
its rank, swap copies on their channels, and each CPU device's live bytes."""

from __future__ import annotations

import json

import pytest
import torch

from mpress.launcher import run_trace
from mpress.config.model_config import load_model_config
from mpress.contract.plan import Plan, TensorRule
from mpress.runtime.trainer import JobSpec, PipelineJob
from tests.support.plans import pipeline_plan
from tests.support.spawn import spawn
from tests.support.traces import events_without_args, format_errors, overlaps
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, batch


def _copy(what, stage, mb, tensor, nbytes, a, b, kind="host"):
    return {"kind": kind, "what": what, "stage": stage, "microbatch": mb, "tensor": tensor, "bytes": nbytes,
            "start_s": a, "end_s": b}


def test_records_become_one_trace_in_the_emulators_layout(tmp_path):
    unit = "0:layers.1.**@r0"
    ranks = [
        {"rank": 0, "device": 0, "capacity": 1000, "num_stages": 2,
         "spans": [("0F0", 10.0, 10.5, True), (f"0SO0:{unit}", 10.5, 10.5, False), ("0B0", 11.0, 11.25, True)],
         "copies": [_copy("out", 0, 0, unit, 300, 10.5, 10.625), _copy("out", 0, 1, unit, 300, 10.5, 10.7),
                    _copy("wait", 0, 0, unit, 300, 11.0, 11.01)],
         "memory": [(10.0, 100), (10.5, 600)]},
        {"rank": 1, "device": 1, "capacity": 1000, "num_stages": 2, "spans": [("1F0", 10.75, 11.0, True)],
         "copies": [], "memory": []},
    ]
    path = run_trace.write(tmp_path / "trace.json", ranks, step=4)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    assert not overlaps(events) and not events_without_args(events) and not format_errors(events)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0 (device 0)"), (1, "rank 1 (device 1)"), (2, "device 0 memory")}
    compute = [(e["pid"], e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["cat"] == "compute"]
    assert compute == [(0, "forward stage 0 mb0", 0.0, 500_000.0), (1, "forward stage 1 mb0", 750_000.0, 250_000.0),
                       (0, "backward stage 0 mb0", 1_000_000.0, 250_000.0)]
    assert [(e["name"], e["args"]["action"]) for e in events if e["ph"] == "i"] == [
        ("swap-out layers.1 mb0", f"0SO0:{unit}")]
    threads = {(e["pid"], e["args"]["name"]): e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    # two copies at once on one stream: two lanes; a wait is on the compute stream it holds up
    assert threads == {(0, "compute"): 0, (0, "host out"): 1, (0, "host out #2"): 2, (1, "compute"): 0}
    copies = [(e["tid"], e["name"], e["args"]["bytes"], e["args"]["layer"]) for e in events
              if e["ph"] == "X" and e["cat"] in ("copy", "wait")]
    assert copies == [(1, "host swap-out layers.1 mb1", 300, "layers.1"),  # the longer first
                      (2, "host swap-out layers.1 mb0", 300, "layers.1"),
                      (0, "host wait for swap-in layers.1 mb0", 300, "layers.1")]
    counters = [(e["ts"], e["args"]["used_bytes"]) for e in events if e["ph"] == "C"]
    assert counters == [(0.0, 100), (500_000.0, 600)]
    flows = sorted((e["ph"], e["pid"], e["args"]["from"], e["args"]["to"]) for e in events if e["ph"] in "sf")
    assert flows == [("f", 1, "0F0", "1F0"), ("s", 0, "0F0", "1F0")]  # 1B0 is not in the records: no arrow
    assert doc["otherData"]["step"] == 4


def _traced_worker(rank: int, world: int, plan_paths: list[str | None]):
    plan = Plan.load(plan_paths[0])
    spec = JobSpec(model=load_model_config(MODEL), schedule="1f1b", ranges=RANGES[world],
                   microbatch_size=MICROBATCH_SIZE, num_microbatches=4, seed=3)
    job = PipelineJob(spec, plan, torch.device("cpu"))
    job.step(*batch(0, 4))
    run_trace.start(job)
    result = job.step(*batch(1, 4))
    record = run_trace.collect(job)
    yield {"record": record, "peak": result.peak_bytes}
    job.close()


@pytest.mark.slow
def test_a_traced_step_shows_what_each_rank_executed(tmp_path):
    plan = pipeline_plan("1f1b", 2, 4, {0: [TensorRule(tensor="layers.1.**", technique="host"),
                                            TensorRule(tensor="layers.0.**", technique="recompute")]})
    spawned = spawn(_traced_worker, 2, [plan])
    assert not spawned.errors, spawned.errors
    results = spawned.results[0]
    doc = json.loads(run_trace.write(tmp_path / "t.json", [r["record"] for r in results], step=1).read_text())
    events = doc["traceEvents"]
    assert not overlaps(events), overlaps(events)[:3]
    assert not events_without_args(events) and not format_errors(events)
    for r, result in enumerate(results):
        executed = [e["args"]["action"] for e in events if e["pid"] == r and e["ph"] in ("X", "i") and e["cat"] in
                    ("compute", "issue")]
        assert executed == plan.actions[r].split()  # every action of the program, in order
        peak = max(e["args"]["used_bytes"] for e in events if e["ph"] == "C" and e["pid"] == 2 + r)
        assert peak == result["peak"]  # the counter is the live bytes the step measured
    copies = [e for e in events if e["ph"] == "X" and e["cat"] == "copy" and e["pid"] == 0]
    assert {e["args"]["kind"] for e in copies} == {"host out", "host in"}
    assert {e["args"]["layer"] for e in copies} == {"layers.1"} and all(e["args"]["bytes"] > 0 for e in copies)
    assert {e["args"]["microbatch"] for e in copies} == set(range(4))
    sends = {(e["args"]["from"], e["args"]["to"]) for e in events if e["ph"] == "s"}
    assert sends == {(f"0F{m}", f"1F{m}") for m in range(4)} | {(f"1B{m}", f"0B{m}") for m in range(4)}
