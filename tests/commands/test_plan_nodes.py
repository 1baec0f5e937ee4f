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
    assert "(32 GPUs, 4 replicas, ddp)" in line and "samples/s for the cluster (4 x" in line and "exposed" in line


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


def test_replicas_sharing_a_node_reduce_over_its_links(capsys):
    """Two replicas of a 4-stage pipeline on one DGX A100 (`--replicas-per-node 2`): each
    plans over half the node, and their reduction runs over the twin GPUs' NVLink, which
    costs less of the iteration than the same two replicas on two nodes over the NICs."""
    one = emulate_json(capsys)
    twins = emulate_json(capsys, "--replicas-per-node", "2")
    nodes = emulate_json(capsys, "--nodes", "2")
    assert (twins["settings"]["num_devices"], twins["settings"]["replicas_per_node"]) == (4, 2)
    assert (twins["settings"]["num_nodes"], nodes["settings"]["num_nodes"]) == (1, 2)
    assert nodes["settings"]["replicas_per_node"] == 1
    assert one["iteration_s"] < twins["iteration_s"] < nodes["iteration_s"]
    per_replica = twins["samples_per_s"] * twins["iteration_s"] / 2
    assert per_replica == pytest.approx(one["samples_per_s"] * one["iteration_s"])
    assert main(["emulate", "--model", "gpt-medium", "--hardware", "dgx-a100", "--num-stages", "4",
                 "--replicas-per-node", "2", "--nodes", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cluster"))
    assert line.startswith("cluster 2 x dgx-a100 (16 GPUs, 4 replicas, ddp)")
    assert "over the 2 replicas' twin GPUs on each node, then 8 x 22.5 GB/s NICs" in line


def one_line_error(capsys, words):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in err, err


@pytest.mark.parametrize("argv, words", [
    (["--hardware", "{own}", "--nodes", "2"], "no network preset"),
    (["--dp-sharding", "fsdp"], "--nodes"),
    (["--nodes", "0"], "--nodes"),
    (["--hardware", "dgx-a100", "--devices", "4", "--replicas-per-node", "3"], "need 12; dgx-a100 has 8: give --num-devices 2"),
    (["--hardware", "dgx-a100", "--replicas-per-node", "9"], "at most 8"),
    (["--hardware", "dgx1-v100", "--replicas-per-node", "2"], "fixed 8-device link matrix"),
    (["--replicas-per-node", "0"], "--replicas-per-node"),
])
def test_bad_node_input_is_one_line_and_exit_2(capsys, tmp_path, argv, words):
    own = tmp_path / "my-server.yaml"  # a server of the user's, with no network preset
    own.write_text((HARDWARE_DIR / "dgx-a100.yaml").read_text().replace("name: dgx-a100", "name: my-server"))
    argv = [a.replace("{own}", str(own)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(["emulate", "--model", "gpt-tiny", *argv]))
    assert exc.value.code == 2
    one_line_error(capsys, words)


def test_replicas_per_node_on_a_server_of_ones_own(capsys, tmp_path):
    """A hardware YAML of the user's (named unlike any preset) splits among replicas too:
    the whole node is read from the file given, not looked up by its display name."""
    own = tmp_path / "my-server.yaml"
    own.write_text((HARDWARE_DIR / "dgx-a100.yaml").read_text().replace("name: dgx-a100", "name: my-server"))
    assert main(["emulate", "--model", "gpt-tiny", "--hardware", str(own), "--replicas-per-node", "2"]) == 0
    assert "cluster 1 x my-server (8 GPUs, 2 replicas, ddp)" in capsys.readouterr().out
