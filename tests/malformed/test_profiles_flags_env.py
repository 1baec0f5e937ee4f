"""Malformed profiles (`mpress emulate --profile`), command-line flags of every command,
and the environment variables training reads."""

from __future__ import annotations

import pytest

from tests.malformed.cases import Case, check, laughs, mutated, params, put

_BASE: dict[str, str] = {}
EMULATE_PROFILE = ("emulate", "--model", "gpt-tiny", "--hardware", "cpu-local", "--stages", "2",
                   "--microbatches", "4", "--microbatch-size", "1", "--profile", "{d}/profile.yaml")


def prof(case_id: str, change, *words: str, subprocess: bool = False) -> Case:
    return Case(case_id, EMULATE_PROFILE, {"profile.yaml": lambda d: mutated(_BASE["profile"], change)},
                ("profile.yaml", *words), subprocess=subprocess)


PROFILES = [
    prof("forward-time-nan", put("layers.1.forward_time_s", float("nan")), "forward_time_s", "finite",
         subprocess=True),
    prof("flops-inf", put("layers.1.forward_flops", float("inf")), "forward_flops"),
    prof("param-bytes-beyond-int64", put("layers.1.param_bytes", 10**30), "param_bytes"),
    prof("unknown-key", put("layerz", []), "layerz", "unknown key"),
    prof("layers-not-a-list", put("layers", 3), "layers"),
    Case("other-model", EMULATE_PROFILE, {"profile.yaml": lambda d: mutated(_BASE["profile"],
                                                                             put("model_fingerprint", "0123456789abcdef"))},
         ("profile.yaml", "fingerprint")),
    Case("other-microbatch-size", tuple("3" if a == "1" else a for a in EMULATE_PROFILE), {"profile.yaml": lambda d: _BASE["profile"]},
         ("profile.yaml", "microbatch size")),
    Case("duplicate-key", EMULATE_PROFILE, {"profile.yaml": lambda d: _BASE["profile"] + "model: gpt-tiny\n"},
         ("profile.yaml", "duplicate key 'model'")),
    Case("alias-bomb", EMULATE_PROFILE, {"profile.yaml": laughs()}, ("profile.yaml", "aliases expand")),
    Case("json-duplicate-key", EMULATE_PROFILE[:-1] + ("{d}/profile.json",),
         {"profile.json": '{"version": 2, "version": 2}'}, ("profile.json", "duplicate key")),
    Case("json-syntax", EMULATE_PROFILE[:-1] + ("{d}/profile.json",), {"profile.json": "{not json"},
         ("profile.json", "not valid JSON")),
    Case("missing-file", EMULATE_PROFILE, {}, ("profile.yaml",)),
]


def flag(case_id: str, *argv: str, words: tuple[str, ...] = (), subprocess: bool = False,
         files: dict | None = None) -> Case:
    return Case(case_id, argv, files or {}, words, subprocess=subprocess)


FLAGS = [
    flag("emulate-stages-zero", "emulate", "--stages", "0", words=("--stages",), subprocess=True),
    flag("emulate-stages-word", "emulate", "--stages", "two", words=("--stages",)),
    flag("emulate-microbatches-1e9", "emulate", "--microbatches", "1e9", words=("--microbatches",), subprocess=True),
    flag("emulate-microbatches-billion", "emulate", "--microbatches", "1000000000", words=("--microbatches",)),
    flag("emulate-microbatch-size-negative", "emulate", "--microbatch-size", "-2", words=("--microbatch-size",)),
    flag("emulate-devices-huge", "emulate", "--devices", "100000", words=("--devices",)),
    flag("emulate-device-memory-1e400", "emulate", "--device-memory", "1e400", words=("--device-memory",),
         subprocess=True),
    flag("emulate-device-memory-word", "emulate", "--device-memory", "lots", words=("--device-memory",)),
    flag("emulate-device-memory-no-unit", "emulate", "--device-memory", "8", words=("--device-memory", "reserve",
                                                                                    "takes its unit")),
    flag("emulate-trace-under-a-file", "emulate", "--trace", "{d}/afile/t.json", words=("--trace", "afile"),
         files={"afile": "x"}, subprocess=True),
    flag("emulate-trace-is-a-directory", "emulate", "--trace", "{d}", words=("--trace",)),
    flag("emulate-plot-under-a-file", "emulate", "--plot", "{d}/afile/m.png", words=("--plot",),
         files={"afile": "x"}),
    flag("emulate-schedule-unknown", "emulate", "--schedule", "zigzag", words=("--schedule",)),
    flag("emulate-unknown-flag", "emulate", "--stagez", "2", words=("--stagez",)),
    flag("plan-out-under-a-file", "plan", "--out", "{d}/afile/plan.yaml", words=("--out",), files={"afile": "x"}),
    flag("plan-out-is-a-directory", "plan", "--out", "{d}", words=("--out",)),
    flag("plan-strategy-unknown", "plan", "--strategy", "magic", words=("--strategy",)),
    flag("profile-out-under-a-file", "profile", "--model", "gpt-tiny", "--out", "{d}/afile/p.yaml",
         words=("--out",), files={"afile": "x"}),
    flag("profile-out-suffix", "profile", "--model", "gpt-tiny", "--out", "{d}/p.txt", words=("--out",)),
    flag("profile-iters-zero", "profile", "--model", "gpt-tiny", "--iters", "0", words=("--iters",)),
    flag("profile-warmup-negative", "profile", "--model", "gpt-tiny", "--warmup", "-1", words=("--warmup",)),
    flag("profile-analytic-without-hardware", "profile", "--model", "gpt-tiny", "--analytic", words=("--hardware",)),
    flag("maxsize-devices-zero", "maxsize", "--devices", "0", words=("--devices",)),
    flag("maxsize-strategies-unknown", "maxsize", "--strategies", "magic", words=("--strategies",)),
    flag("maxsize-stages-1e9", "maxsize", "--stages", "1e9", words=("--stages",)),
    flag("tile-image-size-zero", "tile", "--image-size", "0", words=("--image-size",), subprocess=True),
    flag("tile-image-size-billion", "tile", "--image-size", "1000000000", words=("--image-size",)),
    flag("tile-budget-1e400", "tile", "--budget", "1e400", words=("--budget",)),
    flag("tile-tiles-zero", "tile", "--tiles", "0", words=("--tiles",)),
    flag("tile-network-unknown", "tile", "--network", "resnet50", words=("--network",)),
    flag("topo-unknown-preset", "topo", "--hardware", "dgx-9000", words=("dgx-9000",)),
    flag("unknown-command", "frobnicate", words=("frobnicate",)),
    flag("train-nproc-zero", "train", "--config", "gpt-tiny-plain", "--nproc-per-node", "0",
         words=("--nproc-per-node",)),
    flag("train-nproc-word", "train", "--config", "gpt-tiny-plain", "--nproc-per-node", "four",
         words=("--nproc-per-node",)),
    flag("train-override-unknown-key", "train", "--config", "gpt-tiny-plain", "--stpes", "3", words=("stpes",)),
    flag("train-override-lr-nan", "train", "--config", "gpt-tiny-plain", "--optimizer.lr", "nan",
         words=("optimizer.lr",), subprocess=True),
    flag("train-override-microbatches-1e9", "train", "--config", "gpt-tiny-plain", "--num_microbatches", "1e9",
         words=("num_microbatches",)),
    flag("train-config-missing", "train", words=("--config",)),
]

TRAIN_OK = {"train.yaml": "model: gpt-tiny\nnum_stages: 1\nsteps: 1\n"}
TRAIN_ARGV = ("train", "--config", "{d}/train.yaml", "--nproc-per-node", "1")



def env(case_id: str, variable: str, value: str, *words: str, subprocess: bool = False,
        xfail: str | None = None) -> Case:
    return Case(case_id, TRAIN_ARGV, TRAIN_OK, (variable, *words), env={variable: value}, subprocess=subprocess,
                xfail=xfail)


ENV = [
    env("host-pool-word", "MPRESS_HOST_POOL_BYTES", "abc", subprocess=True),
    env("host-pool-negative", "MPRESS_HOST_POOL_BYTES", "-1"),
    env("host-pool-1e400", "MPRESS_HOST_POOL_BYTES", "1e400", subprocess=True),
    env("host-pool-fraction", "MPRESS_HOST_POOL_BYTES", "1.5"),
    env("peer-pool-negative", "MPRESS_PEER_POOL_BYTES", "-1", subprocess=True),
    env("peer-pool-word", "MPRESS_PEER_POOL_BYTES", "lots"),
    env("peer-pool-beyond-int64", "MPRESS_PEER_POOL_BYTES", "1" + "0" * 30),
]


@pytest.fixture(autouse=True)
def _base(base_files) -> None:
    _BASE.update(base_files)


@pytest.mark.parametrize("case", params(PROFILES))
def test_malformed_profile(case: Case, tmp_path) -> None:
    check(case, tmp_path)


@pytest.mark.parametrize("case", params(FLAGS))
def test_malformed_flag(case: Case, tmp_path) -> None:
    check(case, tmp_path)


@pytest.mark.parametrize("case", params(ENV))
def test_malformed_environment(case: Case, tmp_path) -> None:
    check(case, tmp_path)
