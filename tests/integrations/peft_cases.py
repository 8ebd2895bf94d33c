"""LoRA on a ``DistributedPipe``, run by every rank of a gloo group (``dist_launch.launch(...,
script='integrations/peft_cases.py')``): the training loop of ``peft_models`` against the plain
PeftModel (which every rank builds with the same seeds), what the ranks exchange, and the
adapter written from every rank's share."""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fastpipe  # noqa: E402
from dist_common import DistributedPipe, main  # noqa: E402
from peft_models import (ACCUMULATE, MAX_NORM, SPLIT, STEPS, batch, lora_llama,  # noqa: E402
                         pipe_run, plain_run)

class Reductions:
    """Every all-reduce this process starts, by its tensor's element count, and every send."""

    def __init__(self) -> None:
        self.reduced: List[int] = []
        self._real = dist.all_reduce

    def __enter__(self) -> "Reductions":
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.reduced.append(tensor.numel())
            return self._real(tensor, *args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._real


def lora(replicas: int, directory: str) -> Dict:
    """The loop on 2 pipeline ranks (x ``replicas`` data-parallel ones) against the plain
    PeftModel: every loss, the adapters, the frozen weights; what data parallelism and the
    tied embedding reduce; the adapter written by ``fastpipe.checkpoint.save_pretrained``."""
    plain = lora_llama()
    expected_losses = plain_run(plain, STEPS, ACCUMULATE, MAX_NORM)
    expected = dict(plain.named_parameters())
    model = lora_llama()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    if replicas > 1:
        mesh = fastpipe.init_mesh(pipeline=2, data=replicas, timeout=60)
        pipe = DistributedPipe(model, chunks=3, split_points=[SPLIT], example_inputs=batch(0),
                               mesh=mesh, timeout=60)
        replica = mesh.replica
    else:
        pipe = DistributedPipe(model, chunks=3, split_points=[SPLIT], example_inputs=batch(0),
                               timeout=60)
        replica = 0
    with Reductions() as reductions:
        losses = pipe_run(pipe, STEPS, ACCUMULATE, MAX_NORM, replicas, replica)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5,
                               atol=1e-5)
    mine = dict(pipe.named_parameters())
    trainable = {n: p for n, p in mine.items() if p.requires_grad}
    for name, p in mine.items():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
        if not p.requires_grad:
            assert p.grad is None, f"the frozen {name} has a gradient"
            assert torch.equal(p, frozen[name]), f"the frozen {name} changed"
    path = fastpipe.checkpoint.save_pretrained(directory, pipe, model)
    return {"trainable": len(trainable), "frozen": len(mine) - len(trainable),
            "trainable_numel": sum(p.numel() for p in trainable.values()),
            "largest_reduction": max(reductions.reduced, default=0),
            "reduced": sum(reductions.reduced), "path": path,
            "names": sorted(trainable)}


if __name__ == "__main__":
    main({"lora": lora})
