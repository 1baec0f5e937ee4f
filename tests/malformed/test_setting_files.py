"""Malformed setting YAML (`configs/settings/`) through `mpress emulate --setting` and
`mpress maxsize --setting`: one line naming the file and the key, exit 2."""

from __future__ import annotations

import pytest

from mpress.config.settings import SETTINGS_DIR
from tests.malformed.cases import Case, check, laughs, mutated, params, put

PAPER = (SETTINGS_DIR / "paper-gpt.yaml").read_text()
EMULATE = ("emulate", "--setting", "{d}/setting.yaml")


def setting(case_id: str, change, *words: str, argv: tuple[str, ...] = EMULATE) -> Case:
    return Case(case_id, argv, {"setting.yaml": mutated(PAPER, change)}, ("setting.yaml", *words))


CASES = [
    setting("unknown-key", put("num_stage", 8), "num_stage", "unknown key"),
    setting("missing-key", lambda d: d.pop("precision"), "precision", "missing"),
    setting("precision-fp8", put("precision", "fp8"), "precision"),
    setting("schedule-unknown", put("schedule", "zigzag"), "schedule"),
    setting("stages-zero", put("num_stages", 0), "num_stages"),
    setting("stages-nan", put("num_stages", float("nan")), "num_stages"),
    setting("microbatch-size-fraction", put("microbatch_size", 1.5), "microbatch_size"),
    setting("microbatches-huge", put("num_microbatches", 10**9), "num_microbatches"),
    setting("models-not-a-list", put("models", "gpt-5.3b"), "models"),
    setting("models-empty", put("models", []), "models"),
    setting("model-of-another-family", put("models", ["bert-4b"]), "models[0]", "bert model"),
    setting("model-unknown", put("models", ["gpt-99b"]), "models[0]", "gpt-99b"),
    setting("hardware-unknown", put("hardware", ["dgx-z"]), "hardware[0]", "dgx-z"),
    setting("family-unknown", put("family", "mamba"), "family"),
    setting("maxsize-unknown-key", put("num_stage", 8), "num_stage", argv=("maxsize", "--setting", "{d}/setting.yaml")),
    Case("duplicate-key", EMULATE, {"setting.yaml": PAPER + "num_stages: 4\n"}, ("setting.yaml", "duplicate key")),
    Case("not-a-mapping", EMULATE, {"setting.yaml": "paper\n"}, ("setting.yaml", "mapping")),
    Case("alias-bomb", EMULATE, {"setting.yaml": laughs()}, ("setting.yaml", "aliases")),
    Case("no-such-file", EMULATE, {}, ("setting.yaml", "no such file")),
]


@pytest.mark.parametrize("case", params(CASES))
def test_malformed_setting(case: Case, tmp_path) -> None:
    check(case, tmp_path)
