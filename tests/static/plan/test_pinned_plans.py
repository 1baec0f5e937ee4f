"""The plans the README's `mpress plan` commands choose stay the ones they chose.

`data/pinned_plans.json` holds, per command, the written plan's YAML (its rules, split,
program, predicted peaks and iteration) and every strategy's row of the comparison
(fits, iteration, pinned host, why not), as the planner made them before its speed work
(commit 286b511). A change that makes planning faster must not change what it chooses.

Regenerate (only when a plan is meant to change), from the repository root:

    PYTHONPATH=. python tests/static/plan/test_pinned_plans.py --write
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "data" / "pinned_plans.json"

COMMANDS: dict[str, list[str]] = {
    "gpt-20.4b": ["plan", "--model", "gpt-20.4b", "--hardware", "dgx1-v100"],
    "gpt-20.4b-1f1b-8x16": ["plan", "--model", "gpt-20.4b", "--hardware", "dgx1-v100", "--schedule", "1f1b",
                            "--num-stages", "8", "--microbatch-size", "2", "--num-microbatches", "16",
                            "--strategy", "mpress"],
    "llama-3-70b": ["plan", "--model", "llama-3-70b", "--hardware", "hgx-h100"],
}
"""The README's plan commands on presets (`### mpress plan`, and the GPT-20.4B line)."""

SLOW = {"llama-3-70b"}
"""Commands that take more than a few seconds (marked slow)."""


def chosen(argv: list[str]) -> dict[str, object]:
    """What `mpress plan argv` chooses: the plan file it writes and its strategies' rows
    (planning times left out: they vary)."""
    from mpress.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.yaml"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            status = main([*argv, "--json", "--out", str(out)])
        figures = json.loads(buf.getvalue())
        plan = out.read_text() if out.exists() else None
    rows = [{k: v for k, v in row.items() if k != "plan_s"} for row in figures["strategies"]]
    return {"status": status, "settings": figures["settings"], "strategies": rows, "stages": figures["stages"],
            "plan_yaml": plan}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in COMMANDS])
def test_plan_is_pinned(name: str) -> None:
    want = json.loads(GOLDEN.read_text())[name]
    got = json.loads(json.dumps(chosen(COMMANDS[name])))  # tuples as lists, as stored
    assert got["status"] == want["status"]
    assert got["settings"] == want["settings"]
    assert got["strategies"] == want["strategies"]
    assert got["stages"] == want["stages"]
    assert got["plan_yaml"] == want["plan_yaml"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({n: chosen(argv) for n, argv in COMMANDS.items()}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
