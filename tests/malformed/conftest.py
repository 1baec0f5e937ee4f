"""Valid base files the malformed cases are made from, written once per session by the
documented commands themselves (a plan from `mpress plan`, a profile from `mpress profile`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.documented import run_documented

PLAN_ARGS = ["--model", "gpt-tiny", "--hardware", "cpu-local", "--stages", "2", "--microbatches", "4",
             "--microbatch-size", "2", "--device-memory", "3MB"]


@pytest.fixture(scope="session")
def base_files(tmp_path_factory) -> dict[str, str]:
    """{"plan": plan YAML text, "profile": analytic profile YAML text} of gpt-tiny on cpu-local."""
    d: Path = tmp_path_factory.mktemp("base")
    code, _, err = run_documented(["plan", *PLAN_ARGS, "--out", str(d / "plan.yaml")], in_process=True)
    assert code == 0, err
    code, _, err = run_documented(["profile", "--model", "gpt-tiny", "--analytic", "--hardware", "cpu-local",
                                   "--out", str(d / "profile.yaml")], in_process=True)
    assert code == 0, err
    return {"plan": (d / "plan.yaml").read_text(), "profile": (d / "profile.yaml").read_text()}
