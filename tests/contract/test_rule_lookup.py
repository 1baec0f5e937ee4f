"""`StageRules.candidates` looks rules up by module path and by name (plan speed): it
must find exactly the rules `pattern_matches` finds, in rule order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mpress.contract.identity import StageRules
from mpress.contract.plan import pattern_matches
from tests.support.plans import contract_plan as make_plan
from tests.support.plans import rule

MODULES = ["layers", "layers.3", "layers.3.mlp", "layers.3.mlp.fc1", "layers.30", "embed", "head", "layers.3*",
           "layers.?", "l[a]yers", "*"]
PATTERNS = st.builds(lambda m, tail: m + tail, st.sampled_from(MODULES), st.sampled_from([".**", ".*", "#0", ""])) | \
    st.sampled_from(["optim:layers.3", "optim:*", "stash:layers.3", "layers.3.mlp.fc1#0"])
TENSORS = ["layers.3.mlp.fc1#0", "layers.3#1", "layers.30.x#0", "embed#0", "optim:layers.3", "stash:layers.3",
           "head.norm#2", "layers#0", "layers.3"]


@settings(max_examples=200, deadline=None)
@given(st.lists(PATTERNS, max_size=6), st.sampled_from(TENSORS))
def test_candidates_are_the_matching_rules_in_order(patterns: list[str], tensor: str) -> None:
    technique = {"optim": "host", "stash": "host"}
    rules = [rule(p, technique.get(p.split(":")[0], "host")) for p in patterns]
    stage_rules = StageRules(make_plan({0: rules}).stage(0), [])
    assert stage_rules.candidates(tensor) == tuple(i for i, p in enumerate(patterns) if pattern_matches(p, tensor))
