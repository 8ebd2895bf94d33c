"""GPU types the planner knows: peak FLOP/s per dtype, memory, links, and one achieved efficiency.

Every number is either stated (a vendor's specification or a paper's description of its
cluster, named in ``GPU.sources``) or calibrated (``GPU.calibrated`` lists which: the achieved
share of peak on a transformer's matrix products, one per GPU type, fitted once to the
published runs in ``benchmarks/published/`` by ``benchmarks/published/calibrate.py``; never per
run). A machine the planner does not know is described by measuring one layer on it
(:mod:`fastpipe.planning.calibrate`). Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Tuple

__all__ = ["GPU", "GPUS", "Link", "gpu"]

GB = 1e9
GIB = 2 ** 30


@dataclass(frozen=True)
class Link:
    """A link's achieved bandwidth per GPU and direction (bytes/s) and its latency per message
    (seconds); a collective over ``n`` GPUs pays the latency once per ring step."""

    bandwidth: float
    latency: float

    def transfer(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` point to point."""
        return self.latency + nbytes / self.bandwidth

    def all_reduce(self, nbytes: float, n: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``n`` GPUs (0 for one GPU)."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.latency + 2 * (n - 1) / n * nbytes / self.bandwidth

    def gather(self, nbytes: float, n: int) -> float:
        """Seconds of a ring all-gather (or reduce-scatter) whose full result is ``nbytes``."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.latency + (n - 1) / n * nbytes / self.bandwidth


@dataclass(frozen=True)
class GPU:
    """One accelerator type. ``flops``: peak dense FLOP/s by dtype; ``memory`` bytes and
    ``memory_bandwidth`` bytes/s; ``efficiency``: the achieved share of peak on a transformer
    layer's matrix products (calibrated); ``memory_efficiency``: the achieved share of
    ``memory_bandwidth`` for element-wise kernels; ``layer_overhead``: fixed seconds per layer
    and pass (kernel launches, a CPU's per-op cost); ``intra_node`` / ``inter_node``: the
    links inside a node and across nodes."""

    name: str
    flops: Mapping[str, float]
    memory: float
    memory_bandwidth: float
    efficiency: float
    intra_node: Link
    inter_node: Link
    memory_efficiency: float = 0.8
    layer_overhead: float = 0.0
    gpus_per_node: int = 8
    sources: Mapping[str, str] = field(default_factory=dict)
    calibrated: Tuple[str, ...] = ("efficiency",)

    def peak(self, dtype: str = "bf16") -> float:
        """Peak dense FLOP/s in ``dtype``; raises ``ValueError`` naming the known dtypes."""
        if dtype not in self.flops:
            raise ValueError(f"{self.name} has no peak for dtype={dtype!r}; known: "
                             f"{', '.join(sorted(self.flops))}")
        return self.flops[dtype]

    def with_changes(self, **changes: object) -> GPU:
        """A copy with some fields replaced (e.g. a measured ``efficiency``)."""
        return replace(self, **changes)  # type: ignore[arg-type]


_NVLINK_A100 = ("NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s per GPU (both "
                "directions); NCCL reaches about 80% of one direction's 300 GB/s")
_HDR = ("Narayanan et al. 2021 (arXiv 2104.04473) Section 5: each DGX A100 node has eight "
        "200 Gbps HDR InfiniBand HCAs for application communication, one per GPU: 25 GB/s")
_NVLINK_H100 = ("NVIDIA H100/H200 datasheet: fourth-generation NVLink, 900 GB/s per GPU (both "
                "directions); about 80% of one direction's 450 GB/s achieved")
_NDR = ("Llama 3 (arXiv 2407.21783) Section 3.3.1 and the DGX H100 design: 400 Gbps "
        "between GPUs across nodes, one NIC per GPU: 50 GB/s")

LINK_SHARE = 0.8
"""Achieved share of a link's one-direction line rate for large messages (stated)."""

# efficiency: fitted by benchmarks/published/calibrate.py to the 79 A100 and 11 H100 published
# rows of benchmarks/published/ (one number per GPU type)
A100 = GPU(
    name="A100-SXM-80GB",
    flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    memory=80 * GB, memory_bandwidth=2.039e12, efficiency=0.738,
    intra_node=Link(LINK_SHARE * 300 * GB, 5e-6), inter_node=Link(LINK_SHARE * 25 * GB, 10e-6),
    sources={
        "flops": "Narayanan et al. 2021 (arXiv 2104.04473) Section 5: 'The peak device "
                 "throughput of an A100 GPU with 16-bit precision is 312 teraFLOP/s'",
        "memory": "80 GB HBM2e, 2,039 GB/s: NVIDIA A100 80GB SXM datasheet",
        "intra_node": _NVLINK_A100, "inter_node": _HDR},
)

H100 = GPU(
    name="H100-SXM-80GB",
    flops={"bf16": 989.4e12, "fp16": 989.4e12, "fp8": 1978.9e12, "tf32": 494.7e12,
           "fp32": 66.9e12},
    memory=80 * GB, memory_bandwidth=3.35e12, efficiency=0.534,
    intra_node=Link(LINK_SHARE * 450 * GB, 5e-6), inter_node=Link(LINK_SHARE * 50 * GB, 10e-6),
    sources={
        "flops": "NVIDIA H100 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, "
                 "989.4 dense",
        "memory": "80 GB HBM3, 3.35 TB/s: NVIDIA H100 SXM datasheet",
        "intra_node": _NVLINK_H100, "inter_node": _NDR},
)

H200 = H100.with_changes(
    name="H200-SXM-141GB", memory=141 * GB, memory_bandwidth=4.8e12,
    sources={**H100.sources, "memory": "141 GB HBM3e, 4.8 TB/s: NVIDIA H200 datasheet (the "
             "same Hopper compute and NVLink as the H100 SXM)",
             "efficiency": "the H100's (the same compute); no published H200 run checks it"},
)

GPUS: Dict[str, GPU] = {g.name.lower(): g for g in (A100, H100, H200)}
"""Known GPU types by lower-case name; also reachable as ``a100``, ``h100``, ``h200``."""
_SHORT = {"a100": A100, "h100": H100, "h200": H200}


def gpu(name: str | GPU) -> GPU:
    """The GPU type called ``name`` (``'h100'``, ``'A100-SXM-80GB'``, ...), or ``name`` itself
    when it is a :class:`GPU`; raises ``ValueError`` naming the known ones."""
    if isinstance(name, GPU):
        return name
    key = str(name).lower()
    found = GPUS.get(key) or _SHORT.get(key)
    if found is None:
        known = ", ".join(sorted({*_SHORT, *GPUS}))
        raise ValueError(f"gpu={name!r} is not a known GPU type; use one of {known}, or "
                         f"measure this machine with --calibrate")
    return found
