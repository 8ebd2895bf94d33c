"""Layout-string cases run by every rank of a gloo group (``dist_launch.launch(...,
script='layout_string_cases.py')``): ``DistributedPipe(..., layout=...)`` on an nn.Sequential
and on a traced GPT-2, four stages on two ranks (two virtual stages each, interleaved), each
against the plain model."""
from __future__ import annotations

import os
import sys
from typing import Any, Dict

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import (TOL, DistributedPipe, check_grads, data, main, model,  # noqa: E402
                         reference_grads)
from dist_model_cases import tiny_gpt2  # noqa: E402


def layouts() -> Dict[str, Any]:
    """An 8-layer Sequential cut 't*2|t*2|t*2|t*2' and a GPT-2 cut 'E,t|t|t|t,L': the loss
    and this rank's gradients equal the plain model's."""
    import transformers
    plain = model(8)
    x, y = data(8)
    expected_loss, expected = reference_grads(plain, x, y)
    pipe = DistributedPipe(model(8), chunks=2, schedule="interleaved", layout="t*2|t*2|t*2|t*2",
                           timeout=60)
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss, expected_loss, **TOL)
    check_grads(pipe, expected, "sequential")
    balance = list(pipe.balance)

    config, inputs, ids = tiny_gpt2()

    def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    plain_lm = transformers.GPT2LMHeadModel(config)
    reference = lm_loss(plain_lm(**inputs), ids)
    reference.backward()
    grads = {n: p.grad for n, p in plain_lm.named_parameters()}
    torch.manual_seed(0)
    pipe = DistributedPipe(transformers.GPT2LMHeadModel(config), chunks=2,
                           schedule="interleaved", layout="E,t|t|t|t,L",
                           example_inputs=inputs, timeout=60)
    loss = pipe.train_step(inputs, ids, lm_loss)
    torch.testing.assert_close(loss, reference.detach(), **TOL)
    check_grads(pipe, grads, "gpt2")
    return {"balance": balance, "names": sorted(n for n, _ in pipe.named_parameters())}


CASES = {f.__name__: f for f in (layouts,)}

if __name__ == "__main__":
    main(CASES)
