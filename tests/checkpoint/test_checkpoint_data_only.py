"""A checkpoint loads as data: its RNG states, ``extra`` and the optimizer's hyperparameters
round-trip through ``weights_only=True``; an entry or a metadata file that would need
arbitrary unpickling (here: one that would run code) is refused with the reason before
anything changes, and loads only when the caller passes ``trust_pickled=True``."""
from __future__ import annotations

import math
import os
import pickle
import warnings
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import checkpoint as ckpt
from fastpipe.checkpoint import contents

RAN: List[str] = []


def _ran(what: str) -> str:
    RAN.append(what)
    return what


class Exploit:
    """Unpickling it calls ``_ran``: what a forged checkpoint would make a load run."""

    def __reduce__(self) -> Any:
        return _ran, ("code from a checkpoint",)


class OddScheduler(torch.optim.lr_scheduler.StepLR):
    """A scheduler whose state holds an object that is not data."""

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "odd": Exploit()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "odd"})


def setup(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    pipe = fastpipe.Pipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), chunks=2,
                         balance=[2, 1], devices=["cpu"] * 2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    return pipe, opt


def trained(seed: int = 0) -> Any:
    pipe, opt = setup(seed)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    opt.zero_grad()
    pipe.train_step(x, y, nn.functional.mse_loss)
    opt.step()
    return pipe, opt


def snapshot(pipe: nn.Module, opt: torch.optim.Optimizer) -> Any:
    params = [p for g in opt.param_groups for p in g["params"]]
    return ({k: v.clone() for k, v in pipe.state_dict().items()},
            {i: {k: v.clone() for k, v in opt.state[p].items()}
             for i, p in enumerate(params) if p in opt.state})


def unchanged(pipe: nn.Module, opt: torch.optim.Optimizer, before: Any) -> None:
    model, state = snapshot(pipe, opt)
    for k, v in before[0].items():
        assert torch.equal(model[k], v), k
    assert state.keys() == before[1].keys()
    for p, entries in before[1].items():
        for k, v in entries.items():
            assert torch.equal(state[p][k], v), k


def test_extra_and_the_rng_states_round_trip_as_data(tmp_path):
    pipe, opt = trained()
    extra = {"step": 3, "losses": [1.5, math.inf], "nested": {"a": (1, None, "x")},
             2: torch.arange(3), "dtype": torch.bfloat16, "flag": False}
    torch.manual_seed(11)
    expected_draw = torch.rand(3)
    torch.manual_seed(11)
    path = ckpt.save(tmp_path / "c", pipe, opt, extra=extra)
    torch.manual_seed(99)
    back = ckpt.load(path, *setup(1))
    assert back.keys() == extra.keys() and torch.equal(back[2], extra[2])
    assert {k: v for k, v in back.items() if k != 2} == {k: v for k, v in extra.items() if k != 2}
    assert torch.equal(torch.rand(3), expected_draw)  # the saved RNG state, restored


def test_extra_that_is_not_data_is_refused_at_save(tmp_path):
    pipe, opt = trained()
    with pytest.raises(TypeError, match=r"extra\['odd'\]\[0\] is a Exploit: extra holds "):
        ckpt.save(tmp_path / "c", pipe, opt, extra={"odd": [Exploit()]})
    assert not os.path.exists(tmp_path / "c") and RAN == []


def test_an_entry_that_would_run_code_is_refused_unless_trusted(tmp_path, monkeypatch):
    """A forged ``extra`` (fastpipe's own entry) and a scheduler whose state is not data."""
    pipe, opt = trained()
    sched = OddScheduler(opt, step_size=2)
    monkeypatch.setattr(contents, "check_extra", lambda extra: None)  # forge what save refuses
    path = ckpt.save(tmp_path / "c", pipe, opt, sched, extra={"odd": Exploit()})
    monkeypatch.undo()
    RAN.clear()
    target, target_opt = trained(seed=5)
    target_sched = OddScheduler(target_opt, step_size=2)
    before = snapshot(target, target_opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
        with pytest.raises(ckpt.UnsafeCheckpointError, match="needs arbitrary unpickling.*"
                                                            "trust_pickled=True"):
            ckpt.load(path, target, target_opt, target_sched)
    assert RAN == []
    unchanged(target, target_opt, before)
    back = ckpt.load(path, target, target_opt, target_sched, trust_pickled=True)
    assert back == {"odd": "code from a checkpoint"} and RAN  # the opt-in unpickles
    with pytest.raises(TypeError, match="trust_pickled must be True or False"):
        ckpt.load(path, target, target_opt, trust_pickled="yes")


def test_a_hyperparameter_that_would_run_code_is_refused_by_the_checkpoint_reader(tmp_path):
    """torch.distributed.checkpoint's own loader unpickles non-tensor entries without
    restriction; a load reads them with weights_only=True."""
    pipe, opt = trained()
    opt.param_groups[0]["odd"] = Exploit()
    path = ckpt.save(tmp_path / "c", pipe, opt)
    del opt.param_groups[0]["odd"]
    RAN.clear()
    target, target_opt = trained(seed=5)
    target_opt.param_groups[0]["odd"] = None
    before = snapshot(target, target_opt)
    with pytest.raises(ckpt.UnsafeCheckpointError, match="checkpoint entry 'optim.param_groups.0"
                                                        ".weight.odd' needs arbitrary"):
        ckpt.load(path, target, target_opt)
    assert RAN == []
    unchanged(target, target_opt, before)


def test_forged_metadata_is_refused_before_it_runs(tmp_path):
    """torch.distributed.checkpoint reads its .metadata file with pickle.load; a load reads
    it with an unpickler that builds only checkpoint records."""
    pipe, opt = trained()
    path = ckpt.save(tmp_path / "c", pipe, opt)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        genuine = f.read()
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Exploit(), f)
    RAN.clear()
    target, target_opt = trained(seed=5)
    before = snapshot(target, target_opt)
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"names tests?.*_ran, which is not "
                                                        r"one of torch.distributed.checkpoint"):
        ckpt.load(path, target, target_opt)
    assert RAN == []
    unchanged(target, target_opt, before)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(genuine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
        ckpt.load(path, target, target_opt)  # the genuine metadata reads as data
    unchanged(target, target_opt, snapshot(*trained()))
