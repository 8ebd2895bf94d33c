"""Scripts run under ``accelerate launch`` by ``test_accelerate_launch.py``: every process
writes its result to ``result-<rank>.json`` in the working directory.

- ``pipe``: a ``DistributedPipe`` script as for ``torchrun`` (``init_process_group()``, a GPT
  on the meta device, two training steps): each rank's losses and its parameters' sums.
- ``trainer OUT``: the Llama run of ``hf_trainer_cases`` through ``PipelineTrainer``.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

STEPS = 2


def pipe_script() -> dict:
    from fastpipe.apps.models import counting_task, gpt, lm_loss
    from fastpipe.distributed import DistributedPipe

    dist.init_process_group()  # the environment accelerate launch set, as torchrun sets it
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gpt(layers=4)
    pipe = DistributedPipe(model, chunks=4, schedule="1f1b", timeout=120)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        ids, targets = counting_task(8, 16, 64, torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        losses.append(float(pipe.train_step(ids, targets, lm_loss, optimizer=optimizer)))
    sums = {name: float(p.detach().double().sum()) for name, p in pipe.named_parameters()}
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "losses": losses,
              "sums": sums}
    dist.destroy_process_group()
    return result


def trainer_script(out: str) -> dict:
    import hf_trainer_cases as cases

    run = cases.train("llama", out, {"chunks": 2}, max_steps=STEPS)
    return {"rank": int(os.environ["RANK"]), "logs": run["logs"], "final": run["final"]}


if __name__ == "__main__":
    mode = sys.argv[1]
    found = pipe_script() if mode == "pipe" else trainer_script(sys.argv[2])
    with open(f"result-{found['rank']}.json", "w", encoding="utf-8") as f:
        json.dump(found, f)
