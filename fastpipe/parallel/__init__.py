"""3-D parallelism inside the stages of ``DistributedPipe``: one concept per module.

- ``mesh``: ``init_mesh(pipeline=P, data=D, tensor=T, shard=S)``, the named rank grid
  (pipeline outermost, tensor innermost) and the process groups each dimension gives.
- ``tensor``: tensor parallelism with DTensor (``parallelize_module`` plans applied per stage).
- ``fsdp``: sharded data parallelism with FSDP2 (``fully_shard`` per layer and per stage),
  gradients reduced once per step.
- ``boundary``: a replicated activation crosses a stage boundary once per tensor-parallel
  group (each rank sends a slice, the receivers all-gather), its gradient likewise.
- ``checkpoint``: plain-model state dicts loaded into sharded (DTensor) parameters.
- ``setup``: the checked combination of the above for one pipe (what ``DistributedPipe`` calls).
- ``optimizer_loads``: a rank's optimizer refuses a load that lost its parameter groups
  (``torch.distributed.checkpoint`` keeps one rank's copy of what all save under one key).

The engines are PyTorch's own (DTensor, FSDP2, ``torch.distributed.checkpoint``); this package
only decides which ranks and which submodules they apply to, checks the arguments before any
work, and tells the pipeline driver when a stage's gradients may be reduced.
"""
from .mesh import DIMS, Mesh, init_mesh

__all__ = ["DIMS", "Mesh", "init_mesh"]
