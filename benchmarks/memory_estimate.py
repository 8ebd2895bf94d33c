"""Activation memory estimated before running against the meter, per stage.

For each model (an unbalanced MLP, the skip model of the tests, a tiny traced GPT-2), schedule
(GPipe, 1F1B, ZB-H1, interleaved) and checkpoint mode, builds the pipe, estimates each physical
stage's peak of saved activations with ``fastpipe.memory.estimate_activation_peaks`` and
measures it over one training step with ``SavedActivationMeter.of_stages``. Not a timing:
sizes only, so any machine gives the same table.

    python benchmarks/memory_estimate.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fastpipe  # noqa: E402
from _common import machine, table  # noqa: E402
from fastpipe.memory import SavedActivationMeter, estimate_activation_peaks  # noqa: E402
from skip_models import model_with_skips  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
MODES = ("never", "except_last", "always")


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 8))


def gpt2() -> nn.Module:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, use_cache=False, resid_pdrop=0.1,
                                     embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def _lm(out, _y):
    return out["logits"].float().square().mean()


def cases(quick: bool):
    """(model name, factory, inputs, targets, loss, balances by virtual stages, extra kwargs)."""
    x16, x8 = torch.randn(64, 16), torch.randn(64, 8)
    ids = torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(1))
    yield "mlp", mlp, x16, torch.randn(64, 8), _mse, {1: [4, 4], 2: [2, 2, 2, 2]}, {}
    yield "skips", model_with_skips, x8, torch.randn(64, 4), _mse, {1: [3, 5], 2: [2, 2, 2, 2]}, {}
    if not quick:
        yield ("gpt2", gpt2, {"input_ids": ids}, ids, _lm, {1: None},
               {"split_points": "auto", "example_inputs": {"input_ids": ids[:2]}})


def row(name, make, x, y, loss, balance, extra, schedule, virtual, mode):
    pipe = fastpipe.Pipe(make(), chunks=4, devices=["cpu"] * 2, balance=balance,
                         checkpoint=mode, schedule=schedule, virtual_stages=virtual, **extra)
    estimate = estimate_activation_peaks(pipe, x)
    with SavedActivationMeter.of_stages(pipe) as meter:
        pipe.train_step(x, y, loss)
    errors = [abs(e - m) / m for e, m in zip(estimate, meter.peak_bytes)]
    return [name, schedule, mode, " / ".join(map(str, estimate)),
            " / ".join(map(str, meter.peak_bytes)), f"{max(errors):.1%}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="MLP and skip model only")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, make, x, y, loss, balances, extra in cases(args.quick):
        for schedule, virtual in SCHEDULES:
            if virtual not in balances:
                continue
            for mode in MODES:
                rows.append(row(name, make, x, y, loss, balances[virtual], extra, schedule,
                                virtual, mode))
    print(f"machine: {machine()}")
    print("2 stages, 4 micro-batches; bytes of saved activations per physical stage")
    print(table(["model", "schedule", "checkpoint", "estimate", "measured", "worst error"], rows))


if __name__ == "__main__":
    main()
