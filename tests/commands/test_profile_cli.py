"""A user's own model from `mpress profile --module` to `mpress plan --profile`, run as the
`mpress` console script runs (a fresh process whose sys.path does not hold the current
directory) from a directory holding the user's module file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpress.contract.plan import Plan
from mpress.static.profile.profile import Profile
from tests.support import user_model

REPO = Path(__file__).resolve().parents[2]

# The console script `mpress` is `sys.exit(mpress.cli.main())` in a file under bin/; `-P`
# keeps the current directory off sys.path, as it is for that script.
SCRIPT = [sys.executable, "-P", "-c", "import sys; from mpress.cli import main; sys.exit(main())"]


def mpress(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([*SCRIPT, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "usermodel.py").write_text(user_model.SOURCE)
    return d


@pytest.fixture(scope="module")
def profile_file(user_dir):
    r = mpress(user_dir, "profile", "--module", "usermodel:make", "--layers", user_model.LAYERS,
               "--warmup", "0", "--iters", "2", "--out", "my.yaml")
    assert r.returncode == 0, r.stderr
    return user_dir / "my.yaml"


def test_profile_a_module_from_the_current_directory(profile_file):
    prof = Profile.load(profile_file)
    assert prof.model == "usermodel:make" and prof.source == "measured" and prof.time_samples == 2
    assert prof.layer_names() == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert all(x.forward_time_s > 0 and x.forward_time_iqr_s >= 0 for x in prof.layers)


def test_plan_from_the_profile_alone(user_dir, profile_file):
    r = mpress(user_dir, "plan", "--profile", "my.yaml", "--hardware", "cpu-local", "--stages", "2",
               "--microbatch-size", "2", "--microbatches", "4", "--out", "plan.yaml")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(user_dir / "plan.yaml")
    assert plan.model == "usermodel:make"
    assert plan.model_fingerprint == Profile.load(profile_file).model_fingerprint


def test_plan_refuses_a_model_that_is_not_the_profiles(user_dir, profile_file):
    r = mpress(user_dir, "plan", "--profile", "my.yaml", "--model", "gpt-tiny", "--hardware", "cpu-local",
               "--stages", "2", "--microbatch-size", "2", "--microbatches", "4")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "usermodel:make" in r.stderr and "gpt-tiny" in r.stderr


def test_plan_a_module_profiles_it_first(user_dir):
    r = mpress(user_dir, "plan", "--module", "usermodel:make", "--layers", user_model.LAYERS,
               "--hardware", "cpu-local", "--stages", "2", "--microbatches", "4", "--out", "plan2.yaml")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(user_dir / "plan2.yaml")
    assert plan.model == "usermodel:make" and plan.microbatch_size == 2


def test_fake_profile_on_request(user_dir, profile_file):
    r = mpress(user_dir, "profile", "--module", "usermodel:make", "--layers", user_model.LAYERS, "--fake",
               "--hardware", "cpu-local", "--out", "fake.yaml")
    assert r.returncode == 0, r.stderr
    prof = Profile.load(user_dir / "fake.yaml")
    assert prof.source == "fake" and prof.device == "cpu-local"
    def saved(p):  # (`held` of the host scalar differs: see tests/static/profile/test_fake_profile.py)
        return [[(t.id, t.bytes, t.shape, t.dtype, t.input) for t in x.saved] for x in p.layers]
    assert saved(prof) == saved(Profile.load(profile_file))


@pytest.mark.parametrize("spec,words", [("nosuchmodule:make", "current directory"),
                                        ("usermodel:nosuch", "no callable")])
def test_a_module_that_does_not_import_is_one_line_with_a_hint(user_dir, spec, words):
    r = mpress(user_dir, "profile", "--module", spec)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr
