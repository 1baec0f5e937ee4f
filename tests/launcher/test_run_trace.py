"""The trace of an executed step: the emulator's track layout, every executed action on
its rank, swap copies on their channels, and each CPU device's live bytes."""

from __future__ import annotations

import json

import pytest
import torch

from mpress.launcher import run_trace
from mpress.model_config import load_model_config
from mpress.plan import Plan, TensorRule
from mpress.runtime.trainer import JobSpec, PipelineJob
from tests.support.plans import pipeline_plan
from tests.support.spawn import spawn
from tests.support.tiny_pipeline import MICROBATCH_SIZE, MODEL, RANGES, batch


def test_records_become_one_trace_in_the_emulators_layout(tmp_path):
    ranks = [
        {"rank": 0, "device": 0, "capacity": 1000,
         "spans": [("0F0", 10.0, 10.5, True), ("0SO0:0:a.**@r0", 10.5, 10.5, False), ("0B0", 11.0, 11.25, True)],
         "copies": [("host out", "r0 s0 m0 a#0", 10.5, 10.625), ("host wait", "r0 s0 m0 a#0", 11.0, 11.01)],
         "memory": [(10.0, 100), (10.5, 600)]},
        {"rank": 1, "device": 1, "capacity": 1000, "spans": [("1F0", 10.75, 11.0, True)], "copies": [], "memory": []},
    ]
    path = run_trace.write(tmp_path / "trace.json", ranks, step=4)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0 (device 0)"), (1, "rank 1 (device 1)"), (2, "device 0 memory")}
    compute = [(e["pid"], e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["cat"] == "compute"]
    assert compute == [(0, "0F0", 0.0, 500_000.0), (0, "0B0", 1_000_000.0, 250_000.0), (1, "1F0", 750_000.0, 250_000.0)]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["0SO0:0:a.**@r0"]
    threads = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {"compute": 0, "host out": 1}  # a wait is on the compute stream it holds up
    waits = [e for e in events if e["ph"] == "X" and e["cat"] == "wait"]
    assert [(w["tid"], w["name"]) for w in waits] == [(0, "host wait r0 s0 m0 a#0")]
    counters = [(e["ts"], e["args"]["used_bytes"]) for e in events if e["ph"] == "C"]
    assert counters == [(0.0, 100), (500_000.0, 600)]
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
    for r, result in enumerate(results):
        executed = [e["name"] for e in events if e["pid"] == r and e["ph"] in ("X", "i") and e["cat"] in
                    ("compute", "issue")]
        assert executed == plan.actions[r].split()  # every action of the program, in order
        peak = max(e["args"]["used_bytes"] for e in events if e["ph"] == "C" and e["pid"] == 2 + r)
        assert peak == result["peak"]  # the counter is the live bytes the step measured
    copies = {e["name"].split(" ")[1] for e in events if e["ph"] == "X" and e["cat"] == "copy" and e["pid"] == 0}
    assert copies == {"out", "in"}
