"""Inference cases run by every rank of a gloo group (``dist_launch.launch(...,
script='inference_cases.py')``): train/eval modes reaching every stage of a ``DistributedPipe``
(Sequential and traced, dropout and batch norm, a Hugging Face GPT-2), and the module's own
state-dict rules (a Llama's non-persistent buffers)."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import DistributedPipe, main  # noqa: E402

WIDTH = 8


class Blocks(nn.Module):
    """Not a Sequential (traced at split points): dropout and batch norm in every block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.3),
                          nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sequential() -> nn.Sequential:
    torch.manual_seed(3)
    layers: List[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.3), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 4))


def gpt2() -> Tuple[Callable[[], nn.Module], Any]:
    """A GPT-2 with dropout everywhere, and its inputs."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, use_cache=False, resid_pdrop=0.1,
                                     embd_pdrop=0.1, attn_pdrop=0.1)
    ids = torch.randint(0, 50, (6, 8), generator=torch.Generator().manual_seed(5))

    def build() -> nn.Module:
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)
    return build, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _outputs(value: Any) -> torch.Tensor:
    return value.logits if hasattr(value, "logits") else value


def _stage_modes(pipe: Any) -> List[bool]:
    return [m.training for stage in pipe._stages if getattr(stage, "module", None) is not None
            for m in stage.module.modules()]


def modes(kind: str) -> Dict:
    """``evaluate()`` (and ``eval()`` with ``no_grad``) equal the plain model in eval mode, bit
    for bit, on every rank's stages, again after a training step; the modes are restored."""
    if kind == "gpt2":
        build, x = gpt2()
        kwargs: Dict[str, Any] = dict(split_points="auto", example_inputs=x)
    else:
        build = Blocks if kind == "traced" else sequential
        x = torch.randn(6, WIDTH, generator=torch.Generator().manual_seed(1))
        kwargs = dict(split_points="auto", example_inputs=x) if kind == "traced" else {}
    plain = build().eval()

    def run(model: nn.Module, inputs: Any) -> Any:
        return model(**inputs) if isinstance(inputs, dict) else model(inputs)

    with torch.no_grad():
        expected = _outputs(run(plain, x))
    pipe = DistributedPipe(build(), chunks=2, timeout=60, **kwargs)
    found: Dict[str, Any] = {}
    first = pipe.evaluate(**x) if isinstance(x, dict) else pipe.evaluate(x)
    if first is not None:
        found["evaluate"] = (_outputs(first) - expected).abs().max().item()
        assert torch.equal(_outputs(first), expected), f"{kind}: evaluate {found['evaluate']}"
    assert pipe.training and all(_stage_modes(pipe)), f"{kind}: modes not restored"
    pipe.eval()
    assert not any(_stage_modes(pipe)), f"{kind}: eval() did not reach every stage"
    with torch.no_grad():
        again = pipe(**x) if isinstance(x, dict) else pipe(x)
    if again is not None:
        assert torch.equal(_outputs(again), expected), f"{kind}: eval + no_grad forward"
    pipe.train()
    assert all(_stage_modes(pipe)), f"{kind}: train() did not reach every stage"
    twice = [pipe.evaluate(**x) if isinstance(x, dict) else pipe.evaluate(x) for _ in range(2)]
    if twice[0] is not None:  # dropout off: the same output every call
        assert torch.equal(_outputs(twice[0]), _outputs(twice[1])), f"{kind}: evaluate drifts"
    return {"found": found}


def llama_state_dict() -> Dict:
    """A traced Llama's state dict leaves out what the model leaves out (``persistent=False``
    buffers: ``rotary_emb.inv_freq``), so the plain model's state dict loads strictly, and the
    pipe's loads into the plain model."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=50, max_position_embeddings=16, use_cache=False)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(1)
    pipe = DistributedPipe(transformers.LlamaForCausalLM(config), chunks=2,
                           split_points="auto", example_inputs={"input_ids": ids}, timeout=60)
    keys = set(pipe.state_dict())
    plain_keys = set(plain.state_dict())
    assert keys <= plain_keys, f"not the plain model's keys: {sorted(keys - plain_keys)[:3]}"
    assert not any(k.endswith("inv_freq") for k in keys)
    pipe.load_state_dict(plain.state_dict())  # strict
    out = pipe.evaluate(input_ids=ids)
    if out is not None:
        with torch.no_grad():
            torch.testing.assert_close(out.logits, plain.eval()(input_ids=ids).logits,
                                       rtol=1e-5, atol=1e-6)
    missing, unexpected = plain.load_state_dict(pipe.state_dict(), strict=False)
    assert not unexpected, unexpected
    return {"keys": len(keys), "missing_here": len(missing)}


CASES = {f.__name__: f for f in (modes, llama_state_dict)}

if __name__ == "__main__":
    main(CASES)
