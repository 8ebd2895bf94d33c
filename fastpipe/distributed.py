"""``DistributedPipe``: one process per pipeline rank, messages over ``torch.distributed``.

Launch with ``torchrun --nproc_per_node=N script.py``; in the script, after
``torch.distributed.init_process_group()``, every rank builds the same ``DistributedPipe`` and
calls ``train_step`` with the same arguments (inputs are read on the first stage's rank, targets
on the last stage's rank; other ranks may pass ``None``). Each rank keeps only its own stages'
layers. The schedule, the stage runtime and the exactness guarantees are those of ``Pipe``: the
same IR drives both, only the transport differs (p2p sends and receives instead of mailboxes).

Data parallelism composes: give each pipeline its ``process_group`` and each stage's replicas a
``data_parallel_group`` (``init_mesh(pipeline=P, data=D)`` builds both); gradients are then
averaged across replicas, each stage's as soon as its last backward of the step ends. So do
tensor parallelism and sharded data parallelism (FSDP2): ``mesh=init_mesh(pipeline=P, data=D,
tensor=T, shard=S)``, ``tensor_parallel=plan``, ``data_parallel='fsdp'`` (``fastpipe.parallel``).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from . import generation, materialise, outputs, tracing
from .policies import compile as compiling, tied as tied_weights
from .errors import ProcessGroupError
from .frontdoor import FrontDoor, parse_layout
from .parallel import checkpoint as sharded_state, optimizer_names, setup as parallel_setup
from .parallel.mesh import Mesh, init_mesh  # noqa: F401 - the public init_mesh
from .placement import (StagesStayPut, auto_balance, check_balance, layer_names,
                        resolve_virtual_stages)
from .runtime.transport import backends
from .runtime import weight_versions
from .runtime.transport.backends import init_process_group  # noqa: F401 - safe under torchrun restarts
from .runtime.dist_executor import Topology
from .runtime.drivers.per_rank import PerRankDriver, RemoteStage
from .runtime.stage import Stage
from .runtime.gradients.tied import TiedSync
from .skip import exchange as skip_exchange, layout as skip_layout
from .skip.api import declaration

LayerFactory = Callable[[], nn.Module]
Layers = Union[nn.Sequential, Sequence[LayerFactory]]


class DistributedPipe(StagesStayPut, FrontDoor):
    """A pipeline whose stages live in different processes (one rank per pipeline stage).

    Args:
        module: the whole model as an ``nn.Sequential`` (it may be built on the ``meta`` device:
            each rank then materialises only its own layers, with ``to_empty`` and the layers'
            ``reset_parameters``), or a list of zero-argument functions that each build one
            layer, so a rank builds only the layers it keeps.
        chunks: micro-batches per batch (``torch.chunk`` semantics, as in ``Pipe``), or
            ``'auto'``: the rank of the first stage searches the count with the best measured
            step throughput (``fastpipe.autotune.chunk_count``); the others follow the count each
            step's first message announces.
        schedule: a schedule name of ``fastpipe.schedule`` (``'gpipe'``, ``'1f1b'``,
            ``'interleaved'``, ``'looped-bfs'``, ``'zb-h1'``, ``'zbv'``, ``'dualpipev'``,
            ``'pipedream'``), or ``'auto'``: the first training step runs 1F1B (looped BFS with
            virtual stages) and is traced on every rank; every rank then ranks the same
            gathered timeline with the simulator (as ``Pipe`` does) and keeps the same choice.
        balance: layers per virtual stage in model order (``ranks * virtual_stages`` entries);
            default: by parameter count for an ``nn.Sequential``, by layer count for factories.
        checkpoint: a checkpoint mode of ``Pipe`` (``'never'``, ``'except_last'``,
            ``'always'``, ``'selective'``, ``'offload'``).
        virtual_stages: model chunks per rank (interleaved and V-shaped schedules; default 2
            for ``'zbv'`` and ``'dualpipev'``, else 1).
        process_group: the pipeline's ranks, in stage order (default: the whole world).
        data_parallel_group: the replicas of this rank's stage in other pipelines; their
            gradients are averaged (default: none).
        device: where this rank's layers run. Default: ``cuda:LOCAL_RANK`` when the process
            group carries CUDA tensors over NCCL (``init_process_group()`` with no backend,
            ``'nccl'`` or ``'cpu:gloo,cuda:nccl'``) and a GPU exists, else the CPU. A device the
            group has no backend for is refused (``ProcessGroupError``).
        p2p: how messages move between ranks (``fastpipe.runtime.transport.backends.P2P_MODES``):
            ``'grouped'`` runs the NCCL program of the schedule (``fastpipe.schedule.lower_nccl``:
            one ``batch_isend_irecv`` group per round, posted in an order proven free of
            deadlock under NCCL's semantics, every receive sized exactly); ``'tagged'`` sends
            each message as soon as it is produced and matches it by tags (gloo only);
            ``'auto'`` (default): ``'grouped'`` on CUDA devices, ``'tagged'`` on the CPU.
        timeout: seconds any wait (a message, a send, a collective) may take before the step
            fails with an error naming the rank, the stage, the action and the micro-batch.
        deferred_batch_norm: as in ``Pipe``: running statistics over the whole mini-batch.
        tied: as in ``Pipe``: groups of parameters (plain-module names) to tie. Parameters the
            module already shares stay tied. A tied parameter used on several ranks has a copy
            on each; the copies start equal (broadcast from the first stage that uses it), their
            gradients are summed across those ranks at the end of every step, so identical
            optimizer steps keep them equal.
        split_points, example_inputs: as in ``Pipe``: any ``nn.Module`` is traced on
            ``example_inputs`` (every rank passes them) and cut at ``split_points``
            (``fastpipe.tracing``); names and state dicts are the module's own.
        init_weights: for a model built on the ``meta`` device, a function of one submodule
            that initialises its own tensors (a Hugging Face model's ``_init_weights``); each
            rank gives memory only to what its stages use (``fastpipe.materialise``). Default:
            each submodule's ``reset_parameters()``.
        mesh: a ``fastpipe.init_mesh(pipeline=P, data=D, tensor=T, shard=S)`` grid: the
            pipeline group, the data-parallel groups and the tensor-parallel group come from it
            (instead of ``process_group`` / ``data_parallel_group``, which it excludes). The
            loss is averaged over the ``data x shard`` ranks (each reads its slice of the
            global batch, ``mesh.replica``); the ``T`` ranks of a stage read the same inputs.
        tensor_parallel: with ``mesh`` of ``tensor > 1``: a ``parallelize_module`` plan (plain
            submodule names, or patterns, to ``ColwiseParallel()`` / ``RowwiseParallel()`` /
            ...) or a function ``(stage_module, tp_mesh) -> None``
            (``fastpipe.parallel.tensor``). Parameters become ``DTensor`` s; a replicated
            activation crosses a stage boundary once per tensor-parallel group
            (``fastpipe.parallel.boundary``).
        data_parallel: ``'replicate'`` (gradients all-reduced over ``data``, the default) or
            ``'fsdp'``: every stage sharded with FSDP2 over ``shard`` (or ``data``; over both,
            hybrid), gradients reduced once per step after the stage's last backward
            (``fastpipe.parallel.fsdp``). Not with ``schedule='pipedream'`` or tied weights.
        compile: as in ``Pipe``: ``True`` or a dict of ``torch.compile`` options compiles
            each of this rank's stages in place; a model in ``torch.compile`` (or with compiled
            submodules) is unwrapped, names stay plain. Not with ``checkpoint='selective'``,
            ``tensor_parallel`` or ``data_parallel='fsdp'``.
        output_reduction: as in ``Pipe``: how output leaves that are not one row per sample
            (a loss) combine over micro-batches, by leaf name. A rule that reads the labels
            reads them on the last stage's rank: pass the inputs there too.

    Casts (``.to(torch.bfloat16)``, ``.half()``, ``.to(device, dtype)`` on this rank's device)
    apply to this rank's layers; a move (``.to(device)``, ``.cuda()``, ``.cpu()``) raises
    ``TypeError``.
    """

    @compiling.takes_compiled
    def __init__(self, module: Layers, chunks: int = 1, schedule: str = "1f1b",
                 balance: Optional[Sequence[int]] = None, checkpoint: str = "except_last", *,
                 virtual_stages: Optional[int] = None, process_group: Optional[Any] = None,
                 data_parallel_group: Optional[Any] = None,
                 device: Optional[Union[str, torch.device]] = None, p2p: str = "auto",
                 timeout: float = 300.0, deferred_batch_norm: bool = False,
                 tied: Sequence[Sequence[Any]] = (), split_points: Optional[Any] = None,
                 example_inputs: Optional[Any] = None,
                 init_weights: Optional[Callable[[nn.Module], Any]] = None,
                 mesh: Optional[Mesh] = None,
                 tensor_parallel: Optional[parallel_setup.tensor.Plan] = None,
                 data_parallel: str = "replicate",
                 compile: Union[bool, Dict[str, Any]] = False,
                 output_reduction: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        compiler = compiling.check(compile)  # as takes_compiled resolved it
        reductions = outputs.check_output_reduction(output_reduction)
        if not dist.is_available() or not dist.is_initialized():
            raise ProcessGroupError("DistributedPipe needs torch.distributed: call "
                               "torch.distributed.init_process_group() first (under torchrun the "
                               "environment provides the rendezvous), or use fastpipe.Pipe in one "
                               "process")
        process_group = backends.as_group(process_group, "process_group")
        data_parallel_group = backends.as_group(data_parallel_group, "data_parallel_group")
        traced = module if tracing.wanted(module, split_points) else None
        self._take_outputs(reductions, module, traced is not None)
        par = parallel_setup.resolve(  # 3-D layouts (fastpipe.parallel), checked before any work
            module, mesh=mesh, process_group=process_group,
            data_parallel_group=data_parallel_group, tensor_parallel=tensor_parallel,
            data_parallel=data_parallel, schedule=schedule, traced=traced is not None, tied=tied)
        process_group, data_parallel_group = par.pipeline_group, par.data_group
        self.mesh = mesh
        if traced is not None:  # any module: traced, cut at split_points (fastpipe.tracing)
            group = process_group if process_group is not None else dist.group.WORLD
            count = dist.get_world_size(group) * resolve_virtual_stages(virtual_stages, schedule)
            module = tracing.stages_of(traced, split_points, example_inputs, count, follow=False,
                                       deferred_batch_norm=deferred_batch_norm)
        object.__setattr__(self, "_traced", (  # what generate() traces: no tensor kept
            None if traced is None else generation.skeleton(traced), split_points))
        layers = _check_layers(module)
        layout = parse_layout(chunks, checkpoint, schedule, virtual_stages, timeout,
                              deferred_batch_norm)
        compiling.check_modes(compiler, checkpoint=layout.checkpoint, sharded=par.active)
        tie_groups = _check_tied(module, tied)
        self._group = process_group if process_group is not None else dist.group.WORLD
        self._device = backends.resolve_device(device, self._group)
        self._p2p = backends.resolve_p2p(p2p, self._device, self._group)
        backends.warm_up(self._group, self._device)
        ranks = dist.get_process_group_ranks(self._group)
        p, v = len(ranks), layout.virtual_stages
        layout = layout.with_balance(_balance(module, layers, balance, p * v))
        skips = _skip_plans(module, layout.balance)
        plan = self._begin(layout)  # raises for a schedule that cannot run this layout
        rank = dist.get_rank()
        owner = [ranks[plan.stage_of(k)[0]] for k in range(p * v)]
        if tie_groups:
            tied_weights.tie(module, tie_groups)
        shared = (tied_weights.find(module, layout.balance)
                  if isinstance(module, nn.Sequential) else [])
        topology = Topology(owner, rank, ranks.index(rank), self._group, self._device)
        starts = [0, *itertools.accumulate(layout.balance)]
        kept: "OrderedDict[str, nn.Module]" = OrderedDict()
        keys = layer_names(module, len(layers))
        stages: List[Any] = []
        init = materialise.check_init_weights(init_weights)
        if isinstance(module, nn.Module):  # meta tensors this rank uses get memory, ties kept
            pairs = materialise.materialise_used(
                traced if traced is not None else module,
                [layers[i] for k in range(p * v) if owner[k] == rank
                 for i in range(starts[k], starts[k + 1])], self._device, init)
            new = {id(old): value for old, value in pairs}  # pairs hold the old: ids unique
            shared = [dataclasses.replace(w, parameter=new.get(id(w.parameter), w.parameter))
                      for w in shared]
        for k in range(p * v):
            if owner[k] != rank:
                stages.append(RemoteStage(k, self._device))
                continue
            part = OrderedDict((keys[i], _materialise(layers[i], self._device, init))
                               for i in range(starts[k], starts[k + 1]))
            kept.update(part)
            stage_module = par.apply(k, nn.Sequential(part))  # TP, FSDP (if any) in place
            stages.append(Stage(k, stage_module, self._device,
                                deferred_batch_norm=layout.deferred_batch_norm,
                                compiler=compiler))
        _no_skips_in_factories(module, kept)
        self.module = nn.Sequential(kept)  # this rank's layers under their plain-model names
        if traced is not None:  # this rank's parameters and buffers under the module's names
            self.module = tracing.local_view(traced, self.module)
        object.__setattr__(self, "_stages", stages)
        self._driver = PerRankDriver(topology, stages, skips, data_parallel_group, shared,
                                     layout.timeout, self._p2p, sharded=par.hooks(),
                                     **par.closing())
        par.wire(stages, owner, rank, layout.timeout)  # send-once TP boundaries, before skips
        self.parallel = par
        skip_exchange.wire(stages, self._driver.skips)
        self._pipedream = (weight_versions.PipeDream(stages)
                           if self._schedule_name == "pipedream" else None)
        _check_asynchronous(self._pipedream, data_parallel_group, self._driver.tied)
        self._driver.tied.broadcast_initial()
        optimizer_names.watch(self)  # its optimizers' state_dict() keyed by plain names

    # ---------------------------------------------------------------- properties
    @property
    def stages(self) -> Tuple[int, ...]:
        """The virtual stages this rank holds."""
        return tuple(self._driver.local)

    @property
    def device(self) -> torch.device:
        """Where this rank's layers run."""
        return self._device

    @property
    def p2p(self) -> str:
        """The transport this pipe runs: ``'tagged'`` or ``'grouped'``."""
        return self._p2p

    @property
    def num_stages(self) -> int:
        """Physical stages: the ranks of the pipeline's process group."""
        return dist.get_world_size(self._group)

    def _placement(self) -> Tuple[Sequence[torch.device], str]:
        return [self._device], "DistributedPipe(device=...)"

    # ---------------------------------------------------------------- plain-module names
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load this rank's entries of a plain-model (or any rank's) state dict; entries of
        layers other ranks hold are ignored, missing local ones are an error when ``strict``."""
        local = self.module.state_dict().keys()
        mine = {k: v for k, v in state_dict.items() if k in local}
        missing = [k for k in local if k not in mine]
        if strict and missing:
            raise RuntimeError(f"the state dict lacks {len(missing)} entries of the layers on rank "
                               f"{self._driver.topology.rank}, e.g. {missing[:3]}; save it from "
                               f"the plain model or gather every rank's state_dict()")
        if sharded_state.has_dtensors(self.module):  # TP / FSDP shards: cut or redistributed
            return sharded_state.load(self.module, mine, strict=False)
        return self.module.load_state_dict(mine, strict=False, assign=assign)

    def _checkpoint_names(self) -> Dict[str, str]:
        """As ``FrontDoor``'s; a copy of a weight tied across ranks is named, on every rank
        that holds one, by the weight's first name in the plain model (its optimizer state is
        then one checkpoint entry, whichever ranks hold copies)."""
        names = super()._checkpoint_names()
        for tied in self._driver.tied.shared:
            for name, param in self.named_parameters():
                if param is tied.local and name in tied.names:
                    names[name] = tied.names[0]
        return names

    def __repr__(self) -> str:
        return (f"DistributedPipe(rank={self._driver.topology.rank}, stages={list(self.stages)}, "
                f"balance={list(self.balance)}, chunks={self._chunks}, "
                f"schedule={self._schedule_name!r}, checkpoint={self.checkpoint!r})")


# -------------------------------------------------------------------- construction helpers
def _check_layers(module: Any) -> List[Any]:
    if isinstance(module, nn.Sequential):
        if len(module) == 0:
            raise ValueError("module is an empty nn.Sequential; give it at least one layer")
        return list(module)
    if isinstance(module, (list, tuple)) and module and all(callable(f) for f in module):
        return list(module)
    raise TypeError(f"module must be an nn.Sequential or a list of functions that each build "
                    f"one layer, got {type(module).__name__}")


def _check_asynchronous(pipedream: Optional[Any], data_group: Optional[Any],
                        tied: TiedSync) -> None:
    """PipeDream updates each stage inside the step: no cross-rank gradient sums then."""
    if pipedream is None:
        return
    if data_group is not None and dist.get_world_size(data_group) > 1:
        raise NotImplementedError("schedule='pipedream' with data_parallel_group is not "
                                  "supported (its updates happen per micro-batch, inside the "
                                  "step); use a flushed schedule such as '1f1b'")
    if tied.shared:
        raise NotImplementedError("schedule='pipedream' with weights tied across ranks is not "
                                  "supported; untie them or use a flushed schedule such as "
                                  "'1f1b'")


def _check_tied(module: Any, tied: Sequence[Sequence[Any]]) -> List[List[str]]:
    if not isinstance(module, nn.Sequential):
        if tied:
            raise ValueError("tied=... needs the model as an nn.Sequential (it names the "
                             "plain model's parameters); layer factories cannot share weights")
        return []
    return tied_weights.check(module, tied)


def _skip_plans(module: Any, balance: Sequence[int]) -> Dict[int, Any]:
    """Where the skip connections (``fastpipe.skip``) go, by virtual stage (checked)."""
    if isinstance(module, nn.Sequential):
        return skip_layout.plan(module, balance)
    return {}


def _no_skips_in_factories(module: Any, kept: Dict[str, nn.Module]) -> None:
    if isinstance(module, nn.Sequential):
        return
    if any(declaration(m) is not None for layer in kept.values() for m in layer.modules()):
        raise NotImplementedError("skip connections (fastpipe.skip) need the model as an "
                                  "nn.Sequential (on the meta device if it is large), so that "
                                  "every rank knows where each skip goes")


def _balance(module: Any, layers: List[Any], balance: Optional[Sequence[int]],
             parts: int) -> List[int]:
    if balance is None:
        if len(layers) < parts:
            raise ValueError(f"the model has {len(layers)} layers but the pipeline needs at "
                             f"least {parts} (ranks x virtual_stages); use fewer ranks")
        if isinstance(module, nn.Sequential):
            return auto_balance(module, parts)
        return [len(range(i, len(layers), parts)) for i in range(parts)]
    values = check_balance(balance, layers)
    if len(values) != parts:
        raise ValueError(f"balance has {len(values)} entries but the pipeline has {parts} "
                         f"virtual stages (ranks x virtual_stages); give one count per stage")
    return values


def _materialise(layer: Any, device: torch.device, init_weights: Any) -> nn.Module:
    """A kept layer on ``device``: built (factories), allocated (meta) or moved."""
    if not isinstance(layer, nn.Module):
        layer = layer()
        if not isinstance(layer, nn.Module):
            raise TypeError(f"a layer factory returned {type(layer).__name__}, not an nn.Module")
    if materialise.is_meta(layer):
        materialise.materialise_layer(layer, device, init_weights)
        return layer
    return layer.to(device)


