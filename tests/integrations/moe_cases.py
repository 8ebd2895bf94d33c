"""A Mixtral trained on its own loss on 2 pipeline x 2 data ranks, run by every rank of a gloo
group (``dist_launch.launch(..., script='integrations/moe_cases.py')``): the load-balancing
loss averaged over the micro-batches of both replicas, the cross-entropy a token mean over both
(replicas holding different numbers of tokens), against the plain model run per micro-batch."""
from __future__ import annotations

import os
import sys
from typing import Dict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import fastpipe  # noqa: E402
from dist_common import DistributedPipe, main  # noqa: E402
import moe_models as moe  # noqa: E402

ROWS = 4  # per replica, in micro-batches of 2


def moe_replicas() -> Dict:
    whole = moe.batch(size=2 * ROWS)
    assert (whole["labels"][:ROWS] != -100).sum() != (whole["labels"][ROWS:] != -100).sum()
    plain = moe.build("mixtral")
    micro = moe.pieces(whole, [2] * (2 * ROWS // 2))  # both replicas' micro-batches
    expected_loss, expected = moe.reference(plain, micro)
    mesh = fastpipe.init_mesh(pipeline=2, data=2, timeout=60)
    model = moe.build("mixtral")
    pipe = DistributedPipe(model, chunks=2, split_points="auto", example_inputs=moe.batch(),
                           mesh=mesh, timeout=60)
    mine = {k: v[mesh.replica * ROWS:(mesh.replica + 1) * ROWS] for k, v in whole.items()}
    loss = pipe.train_step(mine)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")
    return {"replica": mesh.replica}


if __name__ == "__main__":
    main({"moe": moe_replicas})
