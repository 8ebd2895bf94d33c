"""State dicts of sharded stages under the plain model's names.

With tensor parallelism or FSDP, a stage's parameters are ``DTensor`` s: ``state_dict()`` gives
this rank's shards under the plain names, which ``torch.distributed.checkpoint`` saves (each
rank its shards, the replicated ones once) and loads into any other layout, another
(pipeline, data, tensor) grid or the plain model (``dcp.load(..., no_dist=True)``): the shards
carry their global shape and offsets. :func:`load` is ``load_state_dict`` for such a module: a
full tensor (a plain-model checkpoint) is cut to this rank's shard locally, with no
communication; a ``DTensor`` is copied (redistributed if its placements differ).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn


def has_dtensors(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(t, DTensor) for t in module.state_dict().values())


def load(module: nn.Module, state: Dict[str, Any], strict: bool = True) -> Tuple[List[str],
                                                                                  List[str]]:
    """Load ``state`` (full tensors or ``DTensor`` s, keyed by ``module``'s names) into
    ``module``, whose entries may be ``DTensor`` s; the (missing, unexpected) keys, raising for
    missing ones when ``strict``."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_state_dict: missing keys {missing[:5]}, unexpected keys "
                           f"{unexpected[:5]}")
    with torch.no_grad():
        for key, target in own.items():
            if key not in state:
                continue
            value = state[key]
            if isinstance(target, DTensor):
                if isinstance(value, DTensor):
                    if value.placements != target.placements:
                        value = value.redistribute(target.device_mesh, target.placements)
                    local = value.to_local()
                else:  # a full tensor: this rank's shard, cut here (src_data_rank=None)
                    if tuple(value.shape) != tuple(target.shape):
                        raise RuntimeError(f"load_state_dict: {key} has shape "
                                           f"{tuple(value.shape)}, the model's is "
                                           f"{tuple(target.shape)}")
                    local = distribute_tensor(value.to(target.dtype), target.device_mesh,
                                              target.placements, src_data_rank=None).to_local()
                target.to_local().copy_(local)
            else:
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                target.copy_(value)
    return missing, unexpected
