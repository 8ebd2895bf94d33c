"""Comparisons of two ``Trainer`` runs: their logs and their final weights."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

import torch

TOL = 1e-5
# what a run logs that is not a number of the training (times, speeds)
_TIMING = ("runtime", "per_second", "preparation_time")


def logs_after(logs: List[Dict[str, Any]], step: int) -> List[Dict[str, Any]]:
    """The entries logged after optimizer step ``step`` (the final summary excluded)."""
    return [e for e in logs if e.get("step", 0) > step and "train_loss" not in e]


def assert_same_logs(got: List[Dict[str, Any]], expected: List[Dict[str, Any]],
                     ignored: Sequence[str] = ()) -> None:
    """The same entries: every loss, gradient norm and entropy within ``TOL``, every other
    metric (learning rate, accuracy, counts) equal; times and speeds aside, and the metrics
    named in ``ignored`` (with or without their ``eval_`` prefix)."""
    assert len(got) == len(expected), (got, expected)
    skipped = set(ignored) | {f"eval_{name}" for name in ignored}
    for mine, theirs in zip(got, expected):
        keys = {k for k in theirs if not any(t in k for t in _TIMING) and k not in skipped}
        assert keys <= set(mine), (sorted(keys - set(mine)), mine, theirs)
        for key in sorted(keys):
            if "loss" in key or "norm" in key or "entropy" in key or key == "total_flos":
                tolerance = TOL if key != "total_flos" else 1e-6 * abs(theirs[key])
                assert abs(mine[key] - theirs[key]) <= tolerance, (key, mine, theirs)
            else:
                assert mine[key] == theirs[key], (key, mine, theirs)


def assert_same_weights(got: str, expected: str, tolerance: float = TOL) -> None:
    """The models saved in two directories within ``tolerance`` (see ``_saved``)."""
    mine, theirs = _saved(got), _saved(expected)
    assert sorted(mine) == sorted(theirs)
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in theirs)
    assert worst <= tolerance, f"weights differ by {worst:.3g}"


def _saved(path: str) -> Dict[str, torch.Tensor]:
    """What a directory holds: a model ``from_pretrained`` loads (``config.json``), else the
    tensors of its safetensors file (a PEFT adapter, a model of one's own)."""
    if os.path.exists(os.path.join(path, "config.json")):
        import transformers
        config = transformers.AutoConfig.from_pretrained(path)
        cls = getattr(transformers, config.architectures[0])
        return cls.from_pretrained(path).state_dict()
    from safetensors.torch import load_file
    name = "adapter_model.safetensors" if os.path.exists(
        os.path.join(path, "adapter_config.json")) else "model.safetensors"
    return load_file(os.path.join(path, name))
