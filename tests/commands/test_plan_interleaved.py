"""`mpress plan --schedule interleaved` end to end (issue 17): every strategy is planned
(the D2D strategy used to stop the command with "d2d rule for 'optim:*' needs at least
one stripe"), the written plan passes the plan check and emulates."""

from __future__ import annotations

from mpress.cli import main
from mpress.contract.plan import Plan


def test_plan_interleaved_writes_a_plan_that_checks_and_emulates(tmp_path, capsys):
    path = tmp_path / "interleaved.yaml"
    code = main(["plan", "--model", "gpt-tiny", "--hardware", "cpu-local", "--devices", "2", "--device-memory", "3MB",
                 "--schedule", "interleaved", "--stages", "4", "--ranks", "2", "--microbatch-size", "2",
                 "--microbatches", "4", "--out", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    # the d2d row says why it places nothing: the mapper maps one stage per device
    assert "cannot go to peers" in out
    plan = Plan.load(path)
    assert (plan.schedule, plan.num_stages, plan.num_ranks, plan.fits) == ("interleaved", 4, 2, True)
    assert main(["emulate", str(path)]) == 0, capsys.readouterr().err
    assert "fits: every device is within its memory" in capsys.readouterr().out
