"""DistributedPipe on gloo: processes started by the tests, each launch with a hard time limit.

Every rank compares its loss and its parameters' gradients with the plain model's (computed in
the same process), so a launch passes only if every rank is exact.
"""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from torch import nn

import fastpipe

from dist_launch import assert_all_ok, describe, launch, torchrun

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

# every launch below runs on both transports: messages sent when produced (tagged, gloo only)
# and the NCCL program of the schedule (grouped), which CUDA devices run
P2P = pytest.mark.parametrize("p2p", ["tagged", "grouped"])

EVERY_SCHEDULE_2 = [["gpipe", 1, "except_last"], ["1f1b", 1, "never"], ["1f1b", 1, "always"],
                    ["1f1b", 1, "except_last"], ["interleaved", 2, "except_last"],
                    ["looped-bfs", 2, "never"], ["zb-h1", 1, "except_last"],
                    ["zbv", 2, "always"], ["dualpipev", 2, "never"],
                    ["1f1b", 1, "selective"], ["zb-h1", 1, "selective"],
                    ["1f1b", 1, "offload"], ["interleaved", 2, "offload"]]
EVERY_SCHEDULE_4 = [["gpipe", 1, "never"], ["1f1b", 1, "except_last"],
                    ["interleaved", 2, "never"], ["looped-bfs", 2, "always"],
                    ["zb-h1", 1, "never"], ["zbv", 2, "except_last"],
                    ["dualpipev", 2, "except_last"]]


@P2P
def test_two_ranks_every_schedule_variable_shapes_meta_models_and_skips(p2p):
    results = assert_all_ok(launch("several", 2, limit=240, args={"cases": [
        ["transparency", {"schedules": EVERY_SCHEDULE_2, "batches": [8, 13]}],
        ["variable_shapes", {"schedule": "1f1b"}],
        ["variable_shapes", {"schedule": "zb-h1"}],
        ["meta_and_factories", {}],
        ["checkpoint_across_layouts", {}],
        ["skip_connections", {"schedules": [["1f1b", 1, "except_last"], ["zb-h1", 1, "never"],
                                            ["zbv", 2, "always"]]}],
        ["compat", {}],
        ["loss_checks", {}],
        ["token_mean", {"schedules": [["1f1b", 1, "except_last"], ["zbv", 2, "never"]]}],
    ]}, p2p=p2p))
    compat = [r["compat"] for r in results]
    assert "layer0.0.weight" in compat[0]["names"]["1f1b"]  # named children, tied across ranks
    assert "layer7.weight" in compat[1]["names"]["1f1b"]
    assert compat[0]["virtual"] == 2  # zbv inferred it
    assert all(r["loss_checks"]["dtype"] == "torch.float64" for r in results)
    keys = [r["meta_and_factories"] for r in results]
    assert keys[0]["meta"] == keys[0]["factories"]
    assert keys[0]["meta"][0] == "0.0.bias" and keys[1]["meta"][-1] == "7.weight"


@P2P
def test_training_features_across_processes(p2p):
    """Tied weights, deferred batch norm, a GradScaler skipping an inf step everywhere, bf16
    autocast on every rank, chunks='auto', trace(), asynchronous PipeDream, schedule='auto'."""
    results = assert_all_ok(launch("several", 2, limit=180, args={"cases": [
        ["tied_weights", {"schedule": "1f1b"}], ["tied_weights", {"schedule": "zb-h1"}],
        ["deferred_batch_norm", {}], ["grad_scaler", {}], ["autocast_bf16", {}],
        ["auto_chunks", {}], ["traced", {"schedule": "zbv", "v": 2}], ["pipedream", {}],
        ["auto_schedule", {}]]}, p2p=p2p))
    assert "0.0.weight" in results[0]["tied_weights"]["names"]
    assert "7.weight" in results[1]["tied_weights"]["names"]  # the last rank's copy
    assert results[1]["deferred_batch_norm"]["buffers"] == [
        "3.running_mean", "3.running_var", "3.num_batches_tracked"]
    for r in results:  # the inf gradient was on the last rank only; both ranks skipped
        assert r["grad_scaler"] == {"unchanged": True, "scale": 128.0}
    # chunks='auto': the first rank searched and settled; the other followed every step's count
    auto = [r["auto_chunks"] for r in results]
    assert auto[0]["chosen"] is not None and auto[1]["chosen"] is None
    assert auto[0]["counts"] == auto[1]["counts"] and len(set(auto[0]["counts"])) > 1
    # trace(): every rank holds the whole pipeline's timeline (zbv: 2 chunks x 4 x F, B, W)
    assert results[0]["traced"] == results[1]["traced"]
    assert results[0]["traced"]["per_stage"] == [24, 24]
    assert 0.0 <= results[0]["traced"]["bubble"] < 1.0
    # pipedream: equal to the one-process Pipe after every call (checked on the ranks), and
    # every parameter moved
    assert all(r["pipedream"]["moved"] for r in results)
    # schedule='auto': both ranks ranked the same gathered timeline and kept the same schedule
    assert results[0]["auto_schedule"] == results[1]["auto_schedule"]
    assert "auto" not in results[0]["auto_schedule"]["names"]


@P2P
def test_evaluate_across_processes(p2p):
    """evaluate(): the shared front-door lifecycle gives DistributedPipe Pipe's inference."""
    results = assert_all_ok(launch("evaluate", 2, limit=120, p2p=p2p))
    assert [r["has_output"] for r in results] == [False, True]
    assert all(r["training"] for r in results)


@P2P
def test_four_ranks_every_schedule_and_skips_across_ranks(p2p):
    assert_all_ok(launch("several", 4, limit=300, args={"cases": [
        ["transparency", {"schedules": EVERY_SCHEDULE_4, "batches": [13]}],
        ["skip_connections", {"schedules": [["1f1b", 1, "never"],
                                            ["dualpipev", 2, "except_last"]]}]]}, p2p=p2p))


@P2P
def test_pipeline_times_data_parallel(p2p):
    results = assert_all_ok(launch("data_parallel", 4, limit=180, p2p=p2p))
    assert len({tuple(r["losses"]) for r in results}) == 1  # every rank reports the same loss


@pytest.mark.parametrize("world, failing, linger", [(2, 1, 0.0), (4, 2, 0.0), (4, 0, 12.0)])
@P2P
def test_a_raising_rank_stops_every_other_rank_fast(world, failing, linger, p2p):
    """The other ranks stop within seconds (not the 30 s timeout), naming the failed rank, also
    when the failed process stays alive (``linger``) and so closes no connection."""
    results = launch("failure", world, limit=120, args={
        "kind": "raise", "failing_rank": failing, "timeout": 30.0, "linger": linger}, p2p=p2p)
    assert all(r.returncode is not None for r in results), describe(results)  # nobody hung
    for r in results:
        assert r.result is not None, describe(results)
        assert r.result["error"] is not None
        assert r.result["seconds"] < 10.0, describe(results)  # well within the 30 s timeout
        told = r.result["message"] + " ".join(r.result["notes"])
        assert f"rank {failing}" in told, describe(results)
        assert "boom in a user layer" in r.result["message"]
    # the user's own exception type reaches the caller, located by a note
    assert results[failing].result["error"] == "UserBoom"
    assert results[failing].result["notes"] == [
        f"raised in the pipeline at rank {failing}, stage {failing}, action {failing}F3 "
        f"(micro-batch 3)"]
    assert all(r.result["error"] == "PipelineAborted" for i, r in enumerate(results)
               if i != failing)


@P2P
def test_a_killed_rank_never_leaves_the_others_hanging(p2p):
    results = launch("failure", 2, limit=120,
                     args={"kind": "die", "failing_rank": 1, "timeout": 30.0}, p2p=p2p)
    assert results[1].returncode == 17, describe(results)
    survivor = results[0].result
    assert survivor is not None and survivor["error"] is not None, describe(results)
    assert survivor["seconds"] < 10.0 and "rank 1" in survivor["message"]


@pytest.mark.parametrize("kind", ["never", "never_exit"])
def test_a_rank_that_never_builds_its_pipe_is_named_by_every_other_rank(kind):
    results = launch("blame", 3, limit=120, args={"kind": kind, "failing_rank": 2})
    for r in results[:2]:
        assert r.result is not None and r.result["error"] is not None, describe(results)
        assert "rank 2 never built its pipe" in r.result["message"], describe(results)
        assert r.result["seconds"] < 10.0 and r.result["untouched"], describe(results)


@pytest.mark.parametrize("world,failing,schedule", [(2, 0, "zb-h1"), (3, 1, "1f1b")])
@P2P
def test_a_rank_exiting_mid_step_fails_that_step_on_every_rank(world, failing, schedule, p2p):
    """The dying rank's last backward comes after its peers ran all their actions: they must
    still fail in this step (not return a loss, not step the optimizer), naming it."""
    results = launch("blame", world, limit=120, args={
        "kind": "die_in_backward", "failing_rank": failing, "schedule": schedule}, p2p=p2p)
    assert results[failing].returncode == 19, describe(results)
    for r in results:
        if r.rank == failing:
            continue
        assert r.result is not None and r.result["error"] is not None, describe(results)
        message = r.result["message"]
        assert f"rank {failing} stopped responding" in message or \
            f"rank {failing} exited" in message, describe(results)
        assert "during step 1" in message and r.result["untouched"], describe(results)
        assert r.result["seconds"] < 10.0, describe(results)


def test_a_hugging_face_gpt2_untouched_across_ranks():
    pytest.importorskip("transformers")
    results = assert_all_ok(launch("traced_gpt2", 2, limit=240, args={
        "schedules": [["1f1b", 1, "except_last"], ["interleaved", 2, "never"]]}))
    first, last = (r["names"] for r in results)
    assert "transformer.wte.weight" in first and "transformer.wte.weight" in last  # tied
    assert "transformer.h.0.attn.c_attn.weight" in first and "lm_head.weight" not in last
    assert all(r["meta_left"] > 0 for r in results)  # the other rank's layers stayed on meta


def test_distributed_checkpoint_moves_between_layouts_and_the_plain_model(tmp_path):
    results = assert_all_ok(launch("dcp_round_trip", 2, limit=180,
                                   args={"path": str(tmp_path / "ckpt")}))
    assert len(results[0]["loaded"]) + len(results[1]["loaded"]) == 16  # every parameter


@P2P
def test_a_detached_loss_fails_every_rank_before_any_gradient(p2p):
    results = launch("detached_loss", 2, limit=120, p2p=p2p)
    assert all(r.result is not None for r in results), describe(results)
    assert [r.result["detached"] for r in results] == ["PipelineAborted", "LossFunctionError"]
    assert all(r.result["untouched"] for r in results), describe(results)


def test_without_a_process_group_the_error_is_typed_and_says_what_to_do():
    if dist.is_initialized():
        pytest.skip("this test process has a process group")
    with pytest.raises(fastpipe.ProcessGroupError, match="init_process_group"):
        fastpipe.DistributedPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))


@P2P
def test_mismatched_targets_fail_before_any_backward_on_every_rank(p2p):
    results = launch("bad_targets", 2, limit=120, p2p=p2p)
    assert all(r.result is not None for r in results), describe(results)
    assert results[1].result["error"] == "ValueError"
    assert "batch size 6" in results[1].result["message"]
    assert results[0].result["error"] == "PipelineAborted"
    assert not any(any(r.result["grads"]) for r in results)  # no gradient was touched


def test_torchrun_runs_the_example_end_to_end():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = torchrun(os.path.join(root, "examples", "train_gpt.py"),
                   ["--steps", "4", "--batch", "8", "--timeout", "60"], cwd=root)
    assert "median step" in out and "loss nan" not in out


@P2P
def test_a_boundary_shape_mismatch_is_a_clear_error_at_the_first_step(p2p):
    results = launch("boundary_mismatch", 2, limit=120, p2p=p2p)
    assert all(r.result is not None for r in results), describe(results)
    failed = results[1].result
    assert failed["error"] == "RuntimeError"  # torch's own error, as the plain model raises it
    assert failed["notes"] == ["raised in the pipeline at rank 1, stage 1, action 1F0 "
                               "(micro-batch 0)"]
    assert "rank 1 (stage 1) failed" in results[0].result["message"]


@P2P
def test_a_stalled_rank_makes_the_others_time_out_with_a_clear_error(p2p):
    """Rank 1 stalls inside a layer for longer than the 3 s timeout: rank 0 stops after about
    the timeout with PipelineTimeout naming itself, the action and the micro-batch it waited
    for; the stalled rank's own step also ends with a timeout instead of hanging."""
    results = launch("failure", 2, limit=120,
                     args={"kind": "hang", "failing_rank": 1, "timeout": 3.0}, p2p=p2p)
    assert all(r.result is not None for r in results), describe(results)
    waiting = results[0].result
    assert waiting["error"] in ("PipelineTimeout", "PipelineAborted"), describe(results)
    assert waiting["seconds"] < 7.0, describe(results)
    assert "rank 0" in waiting["message"] and "micro-batch" in waiting["message"]
    assert results[1].result["error"] == "PipelineTimeout", describe(results)


def test_process_groups_as_users_make_them():
    """A DeviceMesh dimension as the pipeline's group (exact), a 2-D mesh refused, and ranks
    built with different transports refused at the first step, before any gradient."""
    results = launch("process_groups", 2, limit=120)
    assert all(r.result is not None for r in results), describe(results)
    for r in results:
        assert r.result["mesh"] == "tagged"  # 'auto' on CPU tensors over gloo
        assert "pass one dimension of it" in r.result["two_d"]
        assert "disagree on p2p" in r.result["mixed"][1], describe(results)
        assert r.result["untouched"]


def test_the_readme_snippet_style_bare_init_runs_under_torchrun(tmp_path):
    """init_process_group() with no backend: torch reports 'undefined' (gloo for CPU tensors,
    NCCL for CUDA ones where it exists); the pipe runs on the CPU, both transports."""
    script = tmp_path / "bare.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from fastpipe.distributed import DistributedPipe\n"
        "dist.init_process_group()\n"
        "for p2p in ('auto', 'grouped'):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])\n"
        "    pipe = DistributedPipe(model, chunks=2, p2p=p2p, timeout=60)\n"
        "    loss = pipe.train_step(torch.ones(4, 4), torch.zeros(4, 4), torch.nn.functional.mse_loss)\n"
        "    losses = [None, None]\n"
        "    dist.all_gather_object(losses, round(loss.item(), 6))\n"
        "    if dist.get_rank() == 0:\n"
        "        print('RESULT', dist.get_backend(), pipe.device, pipe.p2p, *losses, flush=True)\n"
        "dist.destroy_process_group()\n")
    out = torchrun(str(script), [], cwd=str(tmp_path))
    lines = [line.split()[1:] for line in out.splitlines() if line.startswith("RESULT")]
    assert [line[:3] for line in lines] == [["undefined", "cpu", "tagged"],
                                            ["undefined", "cpu", "grouped"]], out
    assert len({value for line in lines for value in line[3:]}) == 1  # every rank, transport


@pytest.mark.parametrize("world, seed", [(2, 11), (3, 12)])
def test_randomized_transparency_across_processes(world, seed, tmp_path):
    """Seeded random schedules, checkpoint modes, chunk counts, transports, global clipping,
    accumulation and resumes from a checkpoint, each over three steps of changing batch sizes,
    against the plain model on every rank."""
    results = assert_all_ok(launch("randomized", world, limit=240,
                                   args={"seed": seed, "count": 8, "path": str(tmp_path)}))
    drawn = results[0]["drawn"]
    assert all(r["drawn"] == drawn for r in results)  # every rank drew the same configurations
    assert {d[3] for d in drawn} == {"tagged", "grouped"}
    assert any(d[5] is not None for d in drawn) and any(d[6] for d in drawn)  # clip, accumulate
    assert any(d[7] for d in drawn)  # a resume
