"""`mpress plan` and `mpress emulate` across nodes (`--nodes N`), and their bad input."""

import json

import pytest

from mpress.cli import main
from mpress.config.presets import HARDWARE_DIR


def test_plan_on_four_dgx_a100_plans_and_prints_the_cluster_throughput(capsys):
    assert main(["plan", "--nodes", "4", "--hardware", "dgx-a100"]) == 0
    out = capsys.readouterr().out
    assert "4 nodes (ddp)" in out
    line = next(x for x in out.splitlines() if "cluster 4 x dgx-a100" in x)
    assert "(32 GPUs, ddp)" in line and "samples/s for the cluster (4 x" in line and "exposed" in line


def emulate_json(capsys, *extra):
    assert main(["emulate", "--model", "gpt-medium", "--hardware", "dgx-a100", "--num-stages", "4",
                 "--num-microbatches", "8", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_emulate_counts_every_replica_in_the_throughput(capsys, sharding):
    one = emulate_json(capsys)
    four = emulate_json(capsys, "--nodes", "4", "--dp-sharding", sharding)
    assert (one["settings"]["num_nodes"], four["settings"]["num_nodes"]) == (1, 4)
    assert four["settings"]["dp_sharding"] == sharding
    assert four["iteration_s"] > one["iteration_s"]  # the reduction cannot all hide behind the last backward
    per_replica = four["samples_per_s"] * four["iteration_s"] / 4
    assert per_replica == pytest.approx(one["samples_per_s"] * one["iteration_s"])
    if sharding == "fsdp":
        used = [stage["device"] for stage in one["stages"]]
        assert all(four["peak_bytes_by_device"][d] < one["peak_bytes_by_device"][d] for d in used)


def one_line_error(capsys, words):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in err, err


@pytest.mark.parametrize("argv, words", [
    (["--hardware", "{own}", "--nodes", "2"], "no network preset"),
    (["--dp-sharding", "fsdp"], "--nodes"),
    (["--nodes", "0"], "--nodes"),
])
def test_bad_node_input_is_one_line_and_exit_2(capsys, tmp_path, argv, words):
    own = tmp_path / "my-server.yaml"  # a server of the user's, with no network preset
    own.write_text((HARDWARE_DIR / "dgx-a100.yaml").read_text().replace("name: dgx-a100", "name: my-server"))
    argv = [a.replace("{own}", str(own)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(["emulate", "--model", "gpt-tiny", *argv]))
    assert exc.value.code == 2
    one_line_error(capsys, words)
