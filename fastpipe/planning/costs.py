"""The cost of a layout: seconds of each chunk's F, B (input gradient) and W (weight gradient) per
micro-batch, its transfers, reductions and optimizer step, and the bytes each stage holds.

Per transformer layer and micro-batch of ``b`` sequences of ``s`` tokens (``h`` hidden, ``t``
tensor-parallel ranks): F's matrix products are those of the query/key/value, output and MLP
projections, ``2 b s x params`` FLOPs split over ``t``, plus attention's ``4 b s^2 h / t``
(half with causal flash attention); B repeats the projections' FLOPs for the input gradient
and doubles attention's; W repeats the projections' FLOPs for the weight gradient. A matrix
product takes its FLOPs over the GPU's peak times its achieved ``efficiency`` (one calibrated
number per GPU type), plus its operands' bytes over the memory bandwidth. Element-wise work
(norms, dropout, residual adds, the activation, a materialised softmax) moves bytes at the
GPU's memory bandwidth; tensor-parallel collectives, pipeline transfers and data-parallel
reductions move bytes over the link their group sits on (inside a node or across nodes, from
:meth:`Layout.inside_node`). The first chunk adds the embedding, the last the final norm, the
vocabulary projection and the loss. Activation bytes per layer follow Korthikanti et al. 2022
(arXiv 2205.05198) Section 4: ``s b h (10 + 24/t) + 5 a s^2 b / t`` without sequence
parallelism (norms, dropout and their inputs then split over ``t`` too), less the ``s^2`` term
with flash attention or selective recomputation; a checkpointed chunk keeps its input. Pure
Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Sequence, Tuple

from ..schedule.simulator import Costs
from .hardware import GPU, Link
from .layout import Layout
from .model_shape import ModelShape
from .runtime_model import Runtime

__all__ = ["ChunkCosts", "Work", "chunk_costs", "even_balance", "model_flops",
           "matmul_seconds", "split_weight"]

SPLIT_SCHEDULES = frozenset({"zb-h1", "zbv", "dualpipev"})
"""Schedules that run the weight gradient (W) apart from the input gradient (B)."""


@dataclass(frozen=True)
class Work:
    """What one training step does: ``global_batch`` sequences of ``seq`` tokens of ``model``."""

    model: ModelShape
    seq: int
    global_batch: int


@dataclass(frozen=True)
class ChunkCosts:
    """A layout's costs per virtual stage, in seconds: ``forward``, ``backward`` and ``weight``
    (W folded into B where the schedule runs no W), the transfers' ``send`` and ``p2p``, the
    gradient ``reduction``, its ``lead`` and the ``optimizer`` (the simulator's
    :class:`Costs` as :attr:`costs`); in bytes: what one micro-batch keeps for its backward
    (``held``), what a checkpointed one keeps meanwhile (``inputs``), and per physical stage
    the weights, gradients and optimizer state (``static``); ``balance``: transformer layers
    per virtual stage."""

    forward: Tuple[float, ...]
    backward: Tuple[float, ...]
    weight: Tuple[float, ...]
    send: Tuple[float, ...]
    p2p: Tuple[float, ...]
    reduction: Tuple[float, ...]
    lead: Tuple[float, ...]
    optimizer: Tuple[float, ...]
    held: Tuple[float, ...]
    inputs: Tuple[float, ...]
    static: Tuple[float, ...]
    balance: Tuple[int, ...]

    @cached_property
    def costs(self) -> Costs:
        """The simulator's costs (built when a layout is simulated, not for every estimate)."""
        return Costs(forward=self.forward, backward=self.backward, weight=self.weight,
                     p2p=self.p2p, send=self.send, reduction=self.reduction,
                     optimizer=self.optimizer, reduction_lead=self.lead, activation=self.held)


# -------------------------------------------------------------------------- arithmetic
def matmul_seconds(gpu: GPU, m: float, n: float, k: float, dtype: str, nbytes: int = 2
                   ) -> float:
    """Seconds of an ``(m x k) @ (k x n)`` product: its ``2mnk`` FLOPs at the achieved rate,
    plus moving its operands and result (``nbytes`` per element) at the memory's achieved
    bandwidth (what makes a product of few rows slower per FLOP: it reads the whole
    weight matrix for little work)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k / (gpu.peak(dtype) * gpu.efficiency)
    return flops + _memory_seconds(gpu, nbytes * (m * k + k * n + m * n))


def _memory_seconds(gpu: GPU, nbytes: float) -> float:
    return nbytes / (gpu.memory_bandwidth * gpu.memory_efficiency)


def _projections(model: ModelShape, t: int) -> List[Tuple[float, float]]:
    """Each projection of a layer as (output columns per rank, inner size per rank); the MLP's
    counted ``top_k`` times (the experts a token visits)."""
    h, f = model.hidden, model.inner
    qkv = h + 2 * model.groups * model.head_dim
    up = (2 if model.gated else 1) * f
    mlp = [(up / t, h), (h, f / t)] * model.top_k
    return [(qkv / t, h), (h, h / t), *mlp]


@dataclass(frozen=True)
class _Pass:
    """Seconds of a forward, an input gradient, a weight gradient, and the forward again
    for a checkpointed backward."""

    forward: float
    backward: float
    weight: float
    recompute: float


def _layer(model: ModelShape, seq: int, b: int, layout: Layout, gpu: GPU, rt: Runtime,
           tp_link: Link) -> _Pass:
    """One transformer layer's F, B and W seconds for one micro-batch."""
    t, tokens = layout.tensor, b * seq
    dtype = rt.dtype
    gemm = sum(matmul_seconds(gpu, tokens, n, k, dtype) for n, k in _projections(model, t))
    causal = 0.5 if rt.flash_attention else 1.0
    heads = max(1, model.heads // t)
    attention = (4.0 * b * seq * seq * heads * model.head_dim * causal
                 / (gpu.peak(dtype) * gpu.efficiency))
    rep = 1.0 / t if rt.sequence_parallel else 1.0
    elementwise = tokens * (22 * model.hidden * rep + (6 if model.gated else 4) * model.inner
                            * model.top_k / t)
    softmax = 0.0 if rt.flash_attention else 7.0 * tokens * seq * heads
    forward_mem = _memory_seconds(gpu, elementwise + softmax)
    comm = 2 * tp_link.all_reduce(rt.activation_bytes * tokens * model.hidden, t)
    forward = _overlap(gemm + attention, comm, rt) + forward_mem + gpu.layer_overhead
    backward = (_overlap(gemm + 2 * attention, comm, rt) + 2 * forward_mem
                + gpu.layer_overhead)
    recompute = {"always": forward, "selective": attention + _memory_seconds(gpu, softmax)
                 }.get(layout.checkpoint, 0.0)
    return _Pass(forward, backward, gemm, recompute)


def _overlap(compute: float, comm: float, rt: Runtime) -> float:
    """Compute with its tensor-parallel collectives: overlapped (the longer of the two) or
    one after the other."""
    return max(compute, comm) if rt.tp_overlap else compute + comm


def _embedding(model: ModelShape, seq: int, b: int, layout: Layout, gpu: GPU,
               rt: Runtime, tp_link: Link) -> _Pass:
    """The token embedding: a gather forward, a scatter-add of fp32 gradients backward."""
    tokens = b * seq
    comm = tp_link.all_reduce(rt.activation_bytes * tokens * model.hidden, layout.tensor)
    forward = _memory_seconds(gpu, 2 * rt.activation_bytes * tokens * model.hidden) + comm
    weight = _memory_seconds(gpu, 8 * tokens * model.hidden)
    return _Pass(forward, 0.0, weight, forward if layout.checkpoint == "always" else 0.0)


def _head(model: ModelShape, seq: int, b: int, layout: Layout, gpu: GPU, rt: Runtime) -> _Pass:
    """Final norm, vocabulary projection (split over the tensor ranks) and cross-entropy."""
    tokens, t = b * seq, layout.tensor
    gemm = matmul_seconds(gpu, tokens, model.vocab / t, model.hidden, rt.dtype)
    logits = tokens * model.vocab / t
    norm = _memory_seconds(gpu, 4 * tokens * model.hidden)
    forward = gemm + norm + _memory_seconds(gpu, 10 * logits)
    backward = gemm + 2 * norm + _memory_seconds(gpu, 8 * logits)
    return _Pass(forward, backward, gemm, forward if layout.checkpoint == "always" else 0.0)


# -------------------------------------------------------------------------- the split
def even_balance(layers: int, chunks: int, lighter_ends: bool = False) -> Tuple[int, ...]:
    """``layers`` over ``chunks`` virtual stages as evenly as possible (the extra layers on
    the middle chunks); ``lighter_ends``: one layer fewer on the first and last chunks, which
    also run the embedding and the head (an end chunk may be left with no layer)."""
    if chunks < 1 or layers < 0:
        raise ValueError(f"cannot split {layers} layers over {chunks} chunks")
    spare = 2 if lighter_ends and chunks > 1 else 0
    base, extra = divmod(layers + spare, chunks)
    counts = [base] * chunks
    middle = list(range(1, chunks - 1)) or list(range(chunks))
    order = sorted(middle, key=lambda i: abs(i - (chunks - 1) / 2)) + [
        i for i in range(chunks) if i not in middle]
    for i in order[:extra]:
        counts[i] += 1
    if spare:
        counts[0] -= 1
        counts[-1] -= 1
    if min(counts) < 0:
        raise ValueError(f"cannot split {layers} layers over {chunks} chunks with lighter ends")
    return tuple(counts)


def _link(layout: Layout, dimension: str, gpu: GPU, gpus_per_node: int) -> Link:
    return gpu.intra_node if layout.inside_node(dimension, gpus_per_node) else gpu.inter_node


def split_weight(layout: Layout) -> bool:
    """Whether the schedule runs W apart from B: a zero-bubble schedule without sharded data
    parallelism (FSDP's gradient hooks make a split backward compute both in its B)."""
    return layout.schedule in SPLIT_SCHEDULES and layout.shard == 1


def chunk_costs(work: Work, layout: Layout, gpu: GPU, rt: Runtime,
                gpus_per_node: Optional[int] = None) -> ChunkCosts:
    """Every cost of ``layout`` running ``work`` on ``gpu`` under runtime ``rt`` (see the
    module docstring)."""
    model, seq, b = work.model, work.seq, layout.micro_batch
    per_node = gpus_per_node or gpu.gpus_per_node
    chunks = layout.virtual_stages
    balance = layout.balance or even_balance(model.layers, chunks)
    if len(balance) != chunks or sum(balance) != model.layers:
        raise ValueError(f"balance={list(balance)} must give {model.layers} layers to "
                         f"{chunks} virtual stages")
    tp = _link(layout, "tensor", gpu, per_node)
    layer = _layer(model, seq, b, layout, gpu, rt, tp)
    embed = _embedding(model, seq, b, layout, gpu, rt, tp)
    head = _head(model, seq, b, layout, gpu, rt)
    passes = [_chunk_pass(n, layer, embed if v == 0 else None,
                          head if v == chunks - 1 else None) for v, n in enumerate(balance)]
    forward = [p.forward for p in passes]
    weight = [p.weight for p in passes]
    backward = [p.backward + p.recompute for p in passes]
    if not split_weight(layout):
        backward = [x + w for x, w in zip(backward, weight)]
        weight = [0.0] * chunks
    params = _chunk_params(model, balance, layout.tensor)
    send, p2p = _transfers(work, layout, gpu, rt, per_node)
    reduction = _reductions(params, layout, gpu, rt, per_node)
    optimizer = [o + g for o, g in zip(_optimizer(params, layout, gpu, rt),
                                       _gathers(params, forward, layout, gpu, rt, per_node))]
    if rt.reduce_overlap == "stage":
        optimizer = [o + r for o, r in zip(optimizer, reduction)]
        reduction = [0.0] * chunks
    lead = [b + w for b, w in zip(backward, weight)] if rt.reduce_overlap == "bucket" else [
        0.0] * chunks
    held, inputs = _activations(work, layout, rt, balance)
    return ChunkCosts(*map(tuple, (forward, backward, weight, send, p2p, reduction, lead,
                                   optimizer, held, inputs)),
                      _static(params, layout, rt), tuple(balance))


def _chunk_pass(layers: int, layer: _Pass, embed: Optional[_Pass],
                head: Optional[_Pass]) -> _Pass:
    """A chunk of ``layers`` layers, with the embedding or the head when it holds them."""
    ends = [p for p in (embed, head) if p is not None]
    return _Pass(*(layers * getattr(layer, name) + sum(getattr(p, name) for p in ends)
                   for name in ("forward", "backward", "weight", "recompute")))


def _chunk_params(model: ModelShape, balance: Sequence[int], t: int) -> List[float]:
    """Parameters each virtual stage holds per tensor-parallel rank."""
    params = [n * model.layer_params() / t for n in balance]
    params[0] += model.embedding_params() / t
    params[-1] += model.head_params() / t
    return params


def _transfers(work: Work, layout: Layout, gpu: GPU, rt: Runtime,
               per_node: int) -> Tuple[List[float], List[float]]:
    """Per virtual stage, (the sender's busy time, the receiver's delay) of one activation or
    gradient sent to a neighbouring chunk on another stage: the sender waits when sends
    block, else the receiver waits for the bytes. Each hop takes the link between the two
    stages' nodes; a chunk's two hops (its activation on, its gradient back) are averaged."""
    chunks = layout.virtual_stages
    if layout.pipeline == 1:
        return [0.0] * chunks, [0.0] * chunks
    nbytes = rt.activation_bytes * layout.micro_batch * work.seq * work.model.hidden
    if rt.scatter_gather or rt.sequence_parallel:
        nbytes /= layout.tensor
    stage = [0] * chunks
    for s in range(layout.pipeline):
        for c in range(layout.virtual):
            stage[_virtual(layout, s, c)] = s
    stride = layout.stride("pipeline")
    node = [s * stride // per_node for s in range(layout.pipeline)]
    seconds = []
    for v in range(chunks):
        hops = [(gpu.intra_node if node[stage[v]] == node[stage[u]] else gpu.inter_node)
                .transfer(nbytes) for u in (v - 1, v + 1)
                if 0 <= u < chunks and stage[u] != stage[v]]
        seconds.append(sum(hops) / len(hops) if hops else 0.0)
    zeros = [0.0] * chunks
    return (seconds, zeros) if rt.blocking_sends else (zeros, seconds)


def _reductions(params: Sequence[float], layout: Layout, gpu: GPU, rt: Runtime,
                per_node: int) -> List[float]:
    """Each chunk's gradient reduction over the replicas: an all-reduce over ``data``, a
    reduce-scatter over ``shard``."""
    data = _link(layout, "data", gpu, per_node)
    shard = _link(layout, "shard", gpu, per_node)
    out = []
    for p in params:
        grads = p * rt.grad_bytes
        seconds = shard.gather(grads, layout.shard)
        out.append(seconds + data.all_reduce(grads / layout.shard, layout.data))
    return out


def _optimizer(params: Sequence[float], layout: Layout, gpu: GPU, rt: Runtime) -> List[float]:
    """Each chunk's optimizer step: Adam reads and writes every state byte of its share of
    the parameters."""
    state = rt.master_bytes or rt.param_bytes
    touched = 2 * (state + rt.optimizer_bytes) + rt.grad_bytes + (
        rt.param_bytes if rt.master_bytes else 0)
    return [_memory_seconds(gpu, p / layout.shard * touched) for p in params]


def _gathers(params: Sequence[float], forward: Sequence[float], layout: Layout, gpu: GPU,
             rt: Runtime, per_node: int) -> List[float]:
    """Each chunk's exposed all-gather of its sharded weights (with ``shard`` ranks): whole,
    or what the chunk's first forward does not hide when the runtime prefetches it."""
    shard = _link(layout, "shard", gpu, per_node)
    seconds = [shard.gather(p * rt.param_bytes, layout.shard) for p in params]
    if rt.gather_overlap:
        return [max(0.0, g - f) for g, f in zip(seconds, forward)]
    return seconds


def _static(params: Sequence[float], layout: Layout, rt: Runtime) -> Tuple[float, ...]:
    """Per physical stage: weights and gradients whole (kept through the step), master
    weights and optimizer state split over the shard ranks."""
    per_chunk = [p * (rt.param_bytes + rt.grad_bytes)
                 + p * (rt.master_bytes + rt.optimizer_bytes) / layout.shard for p in params]
    return _per_stage_sum(per_chunk, layout)


def _activations(work: Work, layout: Layout, rt: Runtime, balance: Sequence[int]
                 ) -> Tuple[List[float], List[float]]:
    """Per virtual stage: bytes one micro-batch keeps for its backward (recomputed in its
    backward when checkpointed; the last chunk's logits and loss included), and the bytes a
    checkpointed micro-batch keeps meanwhile (its input)."""
    model, seq, b, t = work.model, work.seq, layout.micro_batch, layout.tensor
    sbh = seq * b * model.hidden
    rep = 1.0 / t if rt.sequence_parallel else 1.0
    mlp = seq * b * model.inner * model.top_k / t * (8 if model.gated else 4)
    layer = sbh * (10 * rep + 8 / t) + mlp
    if not rt.flash_attention and layout.checkpoint != "selective":
        layer += 5.0 * model.heads * seq * seq * b / t
    boundary = rt.activation_bytes * sbh * rep
    logits = seq * b * model.vocab / t * 6.0
    held = [n * layer + (logits if v == len(balance) - 1 else 0.0)
            for v, n in enumerate(balance)]
    return held, [boundary] * len(balance)


def _per_stage_sum(values: Sequence[float], layout: Layout) -> Tuple[float, ...]:
    return tuple(sum(values[_virtual(layout, stage, c)] for c in range(layout.virtual))
                 for stage in range(layout.pipeline))


def _virtual(layout: Layout, stage: int, chunk: int) -> int:
    """The virtual stage of (stage, chunk): V-shaped for the V schedules, else round robin."""
    if layout.schedule in ("zbv", "dualpipev") and layout.virtual == 2:
        return stage if chunk == 0 else 2 * layout.pipeline - 1 - stage
    return chunk * layout.pipeline + stage


def model_flops(work: Work) -> float:
    """Model FLOPs of one step (no recomputation, attention counted whole): three times the
    forward's ``2 x active parameters`` per token plus attention's ``4 s h`` per token and
    layer (the convention of Megatron-LM's and PaLM's utilisation figures)."""
    model = work.model
    tokens = work.global_batch * work.seq
    norms = (4 * model.layers + 2) * model.hidden
    matmul = model.active_params() - model.embedding_params() - norms
    per_token = 2 * matmul + 4 * work.seq * model.hidden * model.layers
    return 3.0 * per_token * tokens
