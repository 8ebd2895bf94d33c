"""How a training runtime spends its time and memory beyond the model's arithmetic: which of its
communications block or overlap, how attention is computed, how many bytes each parameter
costs. Stated per runtime (fastpipe's own; the runtimes of the published runs, from their
papers' text), never tuned per run. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["FASTPIPE", "FASTPIPE_CPU", "RUNTIMES", "Runtime", "runtime"]


@dataclass(frozen=True)
class Runtime:
    """``blocking_sends``: a stage waits for its pipeline sends to finish (else they overlap
    its next action); ``tp_overlap``: tensor-parallel collectives overlap the matrix products
    around them; ``reduce_overlap``: when a chunk's gradient reduction starts: ``'stage'``
    once the stage's compute is done, ``'chunk'`` when the chunk's last backward ends,
    ``'bucket'`` during that backward, bucket by bucket (each overlaps later compute);
    ``gather_overlap``: sharded weights are all-gathered ahead of the forward that needs
    them (prefetched), so only what the chunk's forward does not cover is exposed;
    ``flash_attention``: attention never materialises the score matrix (no ``s x s`` bytes,
    and causal masking skips half its products); ``sequence_parallel``: norms and dropout
    split over the tensor-parallel ranks; ``scatter_gather``: a pipeline transfer sends
    ``1/tensor`` of the activation per rank; bytes per parameter: the weights the model runs
    in (``param_bytes``), their gradients (``grad_bytes``), a full-precision master copy
    (``master_bytes``) and the optimizer's state (``optimizer_bytes``; Adam: 8)."""

    name: str
    blocking_sends: bool = False
    tp_overlap: bool = False
    reduce_overlap: str = "chunk"
    gather_overlap: bool = True
    flash_attention: bool = True
    sequence_parallel: bool = False
    scatter_gather: bool = False
    param_bytes: int = 2
    grad_bytes: int = 4
    master_bytes: int = 4
    optimizer_bytes: int = 8
    activation_bytes: int = 2
    dtype: str = "bf16"

    def with_changes(self, **changes: object) -> Runtime:
        return replace(self, **changes)  # type: ignore[arg-type]


FASTPIPE = Runtime(
    "fastpipe", blocking_sends=False, tp_overlap=False, reduce_overlap="chunk",
    flash_attention=True, sequence_parallel=False, scatter_gather=False,
    param_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8)
"""fastpipe: sends as produced (``runtime/transport/p2p``), DTensor tensor parallelism without
overlap, each stage's data-parallel reduction started by its last backward
(``runtime/gradients/data_parallel``), fp32 weights under autocast, Adam, PyTorch's fused
attention; FSDP2 prefetches the next layer's all-gather."""

FASTPIPE_CPU = FASTPIPE.with_changes(
    name="fastpipe-cpu", flash_attention=False, activation_bytes=4, dtype="fp32")
"""fastpipe on CPU processes over gloo: fp32 throughout, attention with its score matrix."""

RUNTIMES = {
    "fastpipe": FASTPIPE,
    "fastpipe-cpu": FASTPIPE_CPU,
    # Narayanan et al. 2021 (arXiv 2104.04473): Section 4.1's scatter/gather of pipeline
    # transfers, blocking point-to-point, fused softmax on materialised scores (Section 4.2);
    # Megatron-LM at the time (commit a8d172b31e): train_step all-reduces the gradients
    # after forward_backward_func returns, and its GPT-3 example trains in fp16 without
    # --accumulate-allreduce-grads-in-fp32 (fp16 gradients, fp32 master weights)
    "megatron-2021": Runtime("megatron-2021", blocking_sends=True, tp_overlap=False,
                             reduce_overlap="stage", flash_attention=False,
                             sequence_parallel=False, scatter_gather=True, grad_bytes=2,
                             dtype="fp16"),
    # Qi et al. 2024 (arXiv 2401.10241), Megatron-LM based: materialised attention (its
    # Table 1 memory counts the 5as term), blocking point-to-point as in Megatron
    "zero-bubble-2024": Runtime("zero-bubble-2024", blocking_sends=True, tp_overlap=False,
                                reduce_overlap="stage", flash_attention=False,
                                sequence_parallel=False, scatter_gather=False),
    # Megatron-LM README (2024 H100 scaling table): "fine-grained overlapping of data-parallel,
    # tensor-parallel and pipeline-parallel communication with computation"
    "megatron-core-2024": Runtime("megatron-core-2024", blocking_sends=False, tp_overlap=True,
                                  reduce_overlap="bucket", flash_attention=True,
                                  sequence_parallel=True, scatter_gather=True),
    # Llama 3 (arXiv 2407.21783) Section 3.3.2: FSDP, asynchronous point-to-point in PP
    "llama3": Runtime("llama3", blocking_sends=False, tp_overlap=False, reduce_overlap="bucket",
                      flash_attention=True, sequence_parallel=True, scatter_gather=True),
}
"""Runtimes by name; the published runs name theirs."""


def runtime(name: str | Runtime) -> Runtime:
    """The runtime called ``name``, or ``name`` itself; raises ``ValueError`` naming the known."""
    if isinstance(name, Runtime):
        return name
    if name not in RUNTIMES:
        raise ValueError(f"runtime={name!r} is not known; use one of {', '.join(RUNTIMES)}")
    return RUNTIMES[name]
