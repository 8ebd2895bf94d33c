"""``PipelineStrategy`` on several ranks, launched by torchrun as a user launches them, under a
hard time limit: a ``DistributedPipe`` of 2 gloo ranks, and 2 pipeline x 2 data ranks, each
equal to Lightning's own single-process run of the same module and data (every logged training
loss and validation metric within 1e-5, the final weights within 1e-5), a run resumed from the
first epoch's checkpoint equal to the uninterrupted one, and that checkpoint (a
``fastpipe.checkpoint`` directory) loading into the plain model."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning", reason="needs Lightning (pip install 'fastpipe[lightning]')")
pytest.importorskip("transformers", reason="needs transformers (the Llama)")
pytest.importorskip("peft", reason="needs peft (the LoRA adapters)")

import fastpipe  # noqa: E402
from dist_launch import torchrun  # noqa: E402
from lightning_cases import MODELS, MODULES, checkpoint_path, fit  # noqa: E402
from lightning_compare import (after_epoch, assert_rows_close, assert_weights_close,  # noqa: E402
                               assert_weights_equal)

HERE = os.path.dirname(os.path.abspath(__file__))
_REFERENCE: dict = {}


def reference(name: str, tmp_path_factory: pytest.TempPathFactory):
    """Lightning's own single-process run of module ``name`` (once per session)."""
    if name not in _REFERENCE:
        _REFERENCE[name] = fit(name, str(tmp_path_factory.mktemp(f"{name}-plain")))
    return _REFERENCE[name]


@pytest.mark.parametrize("world, replicas", [(2, 1), (4, 2)], ids=["pipeline-2", "2x2"])
def test_ranks_under_lightning_equal_lightnings_own_run(world, replicas, tmp_path,
                                                        tmp_path_factory):
    torchrun(os.path.join(HERE, "lightning_cases.py"), [str(tmp_path), str(replicas)],
             cwd=str(tmp_path), nproc=world, limit=480.0)
    for name in MODELS:
        plain = reference(name, tmp_path_factory)
        where = f"{name} on {world} ranks, {replicas} replicas"
        merged_whole, merged_resumed = {}, {}
        for rank in range(world):
            result = torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=False)
            whole, resumed = result["whole"], result["resumed"]
            assert_rows_close(whole["rows"], plain.rows, f"{where}, rank {rank}")
            assert_weights_close(whole["weights"], plain.weights, f"{where}, rank {rank}")
            assert_rows_close(resumed["rows"], after_epoch(whole["rows"], 1),
                              f"{where}, rank {rank} resumed", tol=0.0)
            assert_weights_equal(resumed["weights"], whole["weights"],
                                 f"{where}, rank {rank} resumed")
            merged_whole.update(whole["weights"])
            merged_resumed.update(resumed["weights"])
        assert sorted(merged_whole) == sorted(plain.weights), f"{where}: weights missing"
        check_the_checkpoint_loads_into_the_plain_model(name, tmp_path, merged_whole)
    check_a_failed_metric_stops_every_rank(tmp_path, world, replicas)


def check_a_failed_metric_stops_every_rank(tmp_path, world, replicas):
    """A metric that raises on the last stage's ranks: those raise it, every other rank
    raises an error naming that rank, none waits (the launch's time limit)."""
    errors = [(tmp_path / f"failure-rank{r}.txt").read_text() for r in range(world)]
    last = range(world - replicas, world)  # rank r is stage r // replicas
    for rank, error in enumerate(errors):
        if rank in last:
            assert error == "ValueError: a metric that fails", f"rank {rank}: {error}"
        else:
            assert error.startswith("RuntimeError: rank ") and "last stage" in error, \
                f"rank {rank}: {error}"


def check_the_checkpoint_loads_into_the_plain_model(name, tmp_path, final):
    """The last epoch's checkpoint (every rank's share) is the plain model at the end."""
    folder = str(tmp_path / f"{name}-whole")
    assert fastpipe.checkpoint.is_complete(os.path.join(folder, "last.ckpt"))
    plain = MODULES[name]().model
    with pytest.warns(fastpipe.checkpoint.RngNotRestoredWarning):  # another layout
        extra = fastpipe.checkpoint.load(checkpoint_path(folder, 1), plain)
    assert extra["epoch"] == 1 and "loops" in extra, "Lightning's state is the checkpoint's extra"
    assert_weights_equal({k: v for k, v in plain.state_dict().items() if k in final}, final,
                         f"{name}'s last checkpoint in the plain model")
