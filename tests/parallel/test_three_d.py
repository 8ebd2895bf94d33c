"""3-D parallelism (fastpipe.parallel) on gloo: processes started by the tests, each launch with a
hard time limit. Every rank checks its loss, its gathered gradients and its parameters after
SGD steps against the plain model on the global batch (fp32, rtol 1e-5), so a launch passes
only if every rank is exact."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from dist_launch import assert_all_ok, launch, torchrun

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.mark.parametrize("p2p", ["tagged", "grouped"])
def test_pipeline_2_x_tensor_2_every_kind_of_stage(p2p):
    """Column/row-parallel pairs inside the stages: replicated activations at the boundaries
    (sent once per tensor-parallel group, in slices) and sharded ones (sent per rank), skip
    connections across ranks, a weight tied across ranks (kept replicated)."""
    results = assert_all_ok(launch("several", 4, limit=240, p2p=p2p, args={"cases": [
        ["three_d_runs", {"runs": [
            {"pipeline": 2, "tensor": 2, "chunks": 4, "schedules": [
                ["gpipe", 1, "except_last"], ["1f1b", 1, "always"], ["zb-h1", 1, "never"],
                ["dualpipev", 2, "except_last"], ["looped-bfs", 2, "never"]]},
            {"pipeline": 2, "tensor": 2, "balance": [3, 5],
             "schedules": [["1f1b", 1, "never"]]},
            {"pipeline": 2, "tensor": 2, "kind": "skip", "chunks": 4,
             "schedules": [["1f1b", 1, "except_last"], ["zbv", 2, "never"]]},
            {"pipeline": 2, "tensor": 2, "kind": "tied",
             "schedules": [["1f1b", 1, "except_last"]]}]}],
        ["three_d_pipedream", {}],
        ["three_d_token_mean", {"tensor": 2}],
    ]}))
    for rank, r in enumerate(r["three_d_runs"] for r in results):
        even, sharded, skips, tied = r["runs"]
        assert all(run["worst"] < 1e-5 for run in r["runs"])
        if rank < 2:  # the first stage's ranks send activations
            # after a row-parallel layer the output is replicated: half of it leaves each rank
            for name in ("gpipe", "1f1b", "zb-h1"):
                sent = even["boundaries"][name]["0"]
                assert sent["replicated"] is True, (name, sent)
                assert 2 * sent["elements_sent"] == sent["elements_whole"] > 0, (name, sent)
            # balance [3, 5] cuts after a column-parallel layer: local shards, sent whole
            assert sharded["boundaries"]["1f1b"]["0"]["replicated"] is False
        assert "(4, 8)" in tied["local_shapes"]["1f1b"] or rank < 2
        assert "(8, 8)" in tied["local_shapes"]["1f1b"]  # the tied weight, replicated


@pytest.mark.parametrize("p2p", ["tagged", "grouped"])
def test_pipeline_2_x_fsdp_2_reduces_once_per_step(p2p):
    fsdp = {"pipeline": 2, "shard": 2, "data_parallel": "fsdp", "chunks": 4}
    results = assert_all_ok(launch("several", 4, limit=240, p2p=p2p, args={"cases": [
        ["three_d_runs", {"runs": [
            dict(fsdp, schedules=[["gpipe", 1, "never"], ["1f1b", 1, "except_last"],
                                  ["interleaved", 2, "always"], ["zbv", 2, "never"],
                                  ["zb-h1", 1, "except_last"]]),
            dict(fsdp, keep_gathered=False, schedules=[["1f1b", 1, "except_last"]])]}],
        ["three_d_token_mean", {"shard": 2}]]}))
    for r in results:  # FSDP2's own policy (for comparison): a reduction per micro-batch
        seen = r["three_d_runs"]["runs"][1]["fsdp"]["1f1b"]
        assert seen["reductions"] == [seen["units"] * 4] * 2, seen
    for r in (r["three_d_runs"]["runs"][0] for r in results):
        assert r["coordinates"]["shard"] in (0, 1)
        for name, seen in r["fsdp"].items():
            # one reduction per FSDP unit per step, not one per micro-batch (4 here)
            assert seen["units"] > 0 and seen["reductions"] == [seen["units"]] * 2, (name, seen)
        assert all(shape.startswith("(4,") or shape.startswith("(2,")
                   for shape in r["local_shapes"]["1f1b"])  # half of each 8-row weight


@pytest.mark.parametrize("p2p", ["tagged", "grouped"])
def test_pipeline_2_x_data_2_x_tensor_2_and_hybrid_sharding(p2p):
    """8 processes: replicated data parallelism over tensor-parallel stages, then FSDP over
    tensor-parallel stages (2-D parameters), then hybrid sharding (replicate x shard)."""
    assert_all_ok(launch("several", 8, limit=300, p2p=p2p, args={"cases": [
        ["three_d", {"pipeline": 2, "data": 2, "tensor": 2, "chunks": 4, "steps": 2,
                     "schedules": [["interleaved", 2, "except_last"]]}],
        ["three_d", {"pipeline": 2, "shard": 2, "tensor": 2, "data_parallel": "fsdp",
                     "chunks": 4, "schedules": [["zbv", 2, "always"]]}],
        ["three_d", {"pipeline": 2, "data": 2, "shard": 2, "data_parallel": "fsdp",
                     "schedules": [["1f1b", 1, "except_last"]]}],
    ]}))


def test_checkpoints_move_between_3d_layouts_and_the_plain_model(tmp_path):
    results = assert_all_ok(launch("three_d_checkpoint", 4, limit=240,
                                   args={"path": str(tmp_path / "ckpt")}))
    assert all(r["moved"] for r in results)
    assert len(set().union(*(r["keys"] for r in results))) == 16  # plain names, every layer


def test_bad_3d_arguments_are_typed_errors_before_any_work():
    results = assert_all_ok(launch("three_d_errors", 4, limit=180))
    expected = {"mesh_size": ("ValueError", "world"),
                "not_a_mesh": ("TypeError", "init_mesh"),
                "missing_submodule": ("ValueError", "'9.0'"),
                "width": ("ValueError", "out_features=6"),
                "pipedream_fsdp": ("NotImplementedError", "pipedream"),
                "mesh_and_group": ("ValueError", "process_group"),
                "no_plan": ("ValueError", "tensor_parallel"),
                "shard_without_fsdp": ("ValueError", "data_parallel='fsdp'"),
                "fsdp_tied": ("NotImplementedError", "tied"),
                "tp_tied": ("NotImplementedError", "tied"),
                "plan_without_mesh": ("ValueError", "mesh="),
                "bad_mode": ("ValueError", "'replicate'")}
    for r in results:
        assert set(r) == set(expected)
        for label, (error, words) in expected.items():
            assert r[label]["error"] == error, (label, r[label])
            assert words in r[label]["message"], (label, r[label])
            assert r[label].get("untouched", True), (label, r[label])


@pytest.mark.parametrize("argv", [["--tensor", "2"], ["--tensor", "1", "--schedule", "zb-h1"]])
def test_torchrun_runs_the_3d_example(argv):
    """examples/train_gpt_3d.py on 4 ranks: pipeline 2 x tensor 2, and pipeline 2 x FSDP 2."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = torchrun(os.path.join(root, "examples", "train_gpt_3d.py"),
                   ["--steps", "3", "--batch", "8", "--timeout", "60", *argv], cwd=root,
                   nproc=4, limit=180)
    assert "median step" in out and "loss nan" not in out
    shard = "shard=2" if argv[1] == "1" else "shard=1"
    assert shard in out and f"tensor={argv[1]}" in out
