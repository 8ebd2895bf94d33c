"""Tracing cases run by every rank of a gloo group (``dist_launch.launch(...,
script='tracing_cases.py')``): a traced ``DistributedPipe`` traces its module once when built,
and the eval graph on every rank when the pipe enters eval mode, before the step."""
from __future__ import annotations

import os
import sys
from typing import Dict

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import DistributedPipe, main  # noqa: E402
from fastpipe import tracing  # noqa: E402


def _gpt2(device: str) -> nn.Module:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, use_cache=False, resid_pdrop=0.1,
                                     embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.GPT2LMHeadModel(config)


def eval_traced_lazily(meta: bool) -> Dict:
    """Construction traces once; ``evaluate()`` (another batch size and sequence length than
    the example) traces the eval graph once more, on this rank, and equals the plain model in
    eval mode; a meta model materialised per rank traces it on meta twins."""
    count = [0]
    real = tracing.trace

    def counted(module: nn.Module, example: tracing.Call) -> torch.fx.GraphModule:
        count[0] += 1
        return real(module, example)

    tracing.trace = counted
    plain = _gpt2("cpu").eval()
    generator = torch.Generator().manual_seed(5)
    example = {"input_ids": torch.randint(0, 50, (6, 8), generator=generator)}
    inputs = {"input_ids": torch.randint(0, 50, (5, 7), generator=generator)}
    model = _gpt2("meta" if meta else "cpu")
    pipe = DistributedPipe(model, chunks=2, split_points="auto", example_inputs=example,
                           init_weights=model._init_weights if meta else None, timeout=60)
    construction = count[0]
    pipe.load_state_dict(plain.state_dict())
    out = pipe.evaluate(**inputs)
    found = {"construction": construction, "after_eval": count[0]}
    if out is not None:
        with torch.no_grad():
            expected = plain(**inputs).logits
        found["evaluate"] = (out.logits - expected).abs().max().item()
    again = pipe.evaluate(**inputs)
    if again is not None:
        assert torch.equal(again.logits, out.logits)
    found["after_eval"] = count[0]
    return found


CASES = {f.__name__: f for f in (eval_traced_lazily,)}

if __name__ == "__main__":
    main(CASES)
