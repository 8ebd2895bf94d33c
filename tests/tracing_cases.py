"""Tracing cases run by every rank of a gloo group (``dist_launch.launch(...,
script='tracing_cases.py')``): a traced ``DistributedPipe`` traces its module once when built,
and the eval graph on every rank when the pipe enters eval mode, before the step; a model whose
trace holds for one sequence length is traced again for another on every rank, before the
step."""
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


def _mamba() -> nn.Module:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=4,
                                      vocab_size=50, use_cache=False, expand=2, conv_kernel=4)
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config)


def retraced_per_shape() -> Dict:
    """A Mamba (its trace specialises the sequence length) traced at 16 tokens, trained at 12,
    16 and 12 on its own loss, every rank given the batch: each rank traces the new length
    before the step (once), and loss and local gradients equal the plain model's."""
    count = [0]
    real = tracing.trace

    def counted(module: nn.Module, example: tracing.Call) -> torch.fx.GraphModule:
        count[0] += 1
        return real(module, example)

    tracing.trace = counted
    plain, model = _mamba(), _mamba()
    generator = torch.Generator().manual_seed(5)

    def batch(seq: int) -> Dict[str, torch.Tensor]:
        ids = torch.randint(0, 50, (4, seq), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    pipe = DistributedPipe(model, chunks=2, split_points="auto", example_inputs=batch(16),
                           timeout=60)
    for seq in (12, 16, 12):
        inputs = batch(seq)
        plain.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        expected = plain(**inputs).loss
        expected.backward()
        loss = pipe.train_step(inputs)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        reference = dict(plain.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, reference[name].grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{seq} tokens, {name}: {m}")
    return {"traces": count[0]}


CASES = {f.__name__: f for f in (eval_traced_lazily, retraced_per_shape)}

if __name__ == "__main__":
    main(CASES)
