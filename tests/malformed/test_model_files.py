"""Malformed model YAML through `mpress profile --analytic` and `mpress emulate --model`."""

from __future__ import annotations

import pytest

from mpress.config.model_config import MODELS_DIR
from tests.malformed.cases import Case, check, mutated, params, put

TINY = (MODELS_DIR / "gpt-tiny.yaml").read_text()
PROFILE = ("profile", "--model", "{d}/model.yaml", "--analytic", "--hardware", "cpu-local")


def model(case_id: str, change, *words: str, argv: tuple[str, ...] = PROFILE, subprocess: bool = False) -> Case:
    return Case(case_id, argv, {"model.yaml": mutated(TINY, change)}, ("model.yaml", *words), subprocess=subprocess)


CASES = [
    model("layers-1e9", put("num_layers", 1e9), "num_layers", subprocess=True),
    model("layers-zero", put("num_layers", 0), "num_layers"),
    model("hidden-nan", put("hidden_size", float("nan")), "hidden_size"),
    model("hidden-fraction", put("hidden_size", 64.5), "hidden_size"),
    model("heads-do-not-divide", put("num_heads", 7), "num_heads"),
    model("seq-len-huge", put("seq_len", 10**12), "seq_len"),
    model("vocab-one", put("vocab_size", 1), "vocab_size"),
    model("vocab-2-to-40", put("vocab_size", 2**40), "vocab_size"),
    model("ffn-zero", put("ffn_hidden_size", 0), "ffn_hidden_size"),
    model("family-unknown", put("family", "mamba"), "family"),
    model("precision-fp8", put("precision", "fp8"), "precision"),
    model("dropout-nan", put("dropout", float("nan")), "dropout"),
    model("unknown-key", put("hiden_size", 3), "hiden_size", "unknown key"),
    model("missing-key", lambda d: d.pop("seq_len"), "seq_len", "missing"),
    Case("duplicate-key", PROFILE, {"model.yaml": TINY + "num_layers: 9\n"}, ("model.yaml", "duplicate key")),
    Case("not-a-mapping", PROFILE, {"model.yaml": "gpt\n"}, ("model.yaml", "mapping")),
    model("emulate-layers-huge", put("num_layers", 10**7), "num_layers",
          argv=("emulate", "--model", "{d}/model.yaml", "--hardware", "cpu-local"), subprocess=True),
]


@pytest.mark.parametrize("case", params(CASES))
def test_malformed_model(case: Case, tmp_path) -> None:
    check(case, tmp_path)
