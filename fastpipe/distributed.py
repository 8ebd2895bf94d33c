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
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from . import generation, materialise, tracing
from .policies import compile as compiling, tied as tied_weights
from .policies.tied import TiedWeight
from .errors import ProcessGroupError
from .frontdoor import Blueprint, FrontDoor, OnRanks, plan_pipeline
from .frontdoor.layout_option import resolve_layout
from .parallel import checkpoint as sharded_state, optimizer_loads, setup as parallel_setup
from .parallel.mesh import Mesh, init_mesh  # noqa: F401 - the public init_mesh
from .placement import StagesStayPut
from .runtime.transport import backends
from .runtime import weight_versions
from .schedule import Schedule
from .runtime.transport.backends import init_process_group  # noqa: F401 - safe under torchrun restarts
from .runtime.dist_executor import Topology
from .runtime.drivers.per_rank import PerRankDriver, RemoteStage
from .runtime.stage import Stage
from .skip import exchange as skip_exchange
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
            gathered timeline with the simulator (as ``Pipe`` does) and keeps the same choice;
            or a ``Schedule`` object (e.g. ``fastpipe.schedule.read_csv(...)``), run for exactly
            its micro-batch count.
        balance: layers per virtual stage in model order (``ranks * virtual_stages`` entries);
            default: by parameter count for an ``nn.Sequential``, by layer count for factories.
        checkpoint: a checkpoint mode of ``Pipe`` (``'never'``, ``'except_last'``,
            ``'always'``, ``'selective'``, ``'offload'``).
        virtual_stages: model chunks per rank (interleaved and V-shaped schedules; default 2
            for ``'zbv'`` and ``'dualpipev'``, else 1).
        process_group: the pipeline's ranks, in stage order (default: the whole world).
        data_parallel_group: the replicas of this rank's stage in other pipelines; their
            gradients are averaged (default: none); with ``schedule='pipedream'``, each
            micro-batch's before each update, so every replica applies the same updates.
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
            optimizer steps keep them equal. With ``schedule='pipedream'`` they are summed and
            applied per micro-batch instead, as ``Pipe`` does
            (``fastpipe.runtime.tied_versions``), for weights the first stage uses.
        vertical_sync: as in ``Pipe``: with ``schedule='pipedream'``, run each micro-batch on
            every stage with the weight version stage 0 gave it (the version travels in the
            header of the micro-batch's messages; ``fastpipe.runtime.weight_versions``).
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
        layout: as in ``Pipe``: a Megatron-core layout string such as ``'E,t*3|t*4|t*3,L'``
            instead of ``balance`` or ``split_points``; its stage count over the ranks gives
            ``virtual_stages`` (stage ``k`` on rank ``k mod ranks`` with the interleaved
            schedules, as Megatron places them).

    Casts (``.to(torch.bfloat16)``, ``.half()``, ``.to(device, dtype)`` on this rank's device)
    apply to this rank's layers; a move (``.to(device)``, ``.cuda()``, ``.cpu()``) raises
    ``TypeError``.
    """

    @compiling.takes_compiled
    def __init__(self, module: Layers, chunks: int = 1, schedule: Union[str, Schedule] = "1f1b",
                 balance: Optional[Sequence[int]] = None, checkpoint: str = "except_last", *,
                 virtual_stages: Optional[int] = None, process_group: Optional[Any] = None,
                 data_parallel_group: Optional[Any] = None,
                 device: Optional[Union[str, torch.device]] = None, p2p: str = "auto",
                 timeout: float = 300.0, deferred_batch_norm: bool = False,
                 tied: Sequence[Sequence[Any]] = (), split_points: Optional[Any] = None,
                 example_inputs: Optional[Any] = None, mesh: Optional[Mesh] = None,
                 init_weights: Optional[Callable[[nn.Module], Any]] = None,
                 tensor_parallel: Optional[parallel_setup.tensor.Plan] = None,
                 data_parallel: str = "replicate", compile: Union[bool, Dict[str, Any]] = False,
                 output_reduction: Optional[Dict[str, Any]] = None,
                 layout: Optional[str] = None, vertical_sync: bool = False) -> None:
        super().__init__()
        compiler = compiling.check(compile)  # as takes_compiled resolved it
        par = _parallel(module, process_group, data_parallel_group, mesh=mesh,
                        tensor_parallel=tensor_parallel, data_parallel=data_parallel,
                        schedule=schedule, traced=tracing.wanted(module, split_points), tied=tied)
        cut = resolve_layout(layout, module, OnRanks(dist.get_process_group_ranks(
            par.pipeline_group)), balance=balance, split_points=split_points,
            virtual_stages=virtual_stages, schedule=schedule)
        blueprint = plan_pipeline(
            module, cut.where, chunks=chunks, schedule=schedule, balance=cut.balance,
            checkpoint=checkpoint, timeout=timeout, virtual_stages=cut.virtual_stages,
            deferred_batch_norm=deferred_batch_norm, tied=tied, split_points=cut.split_points,
            example_inputs=example_inputs, output_reduction=output_reduction)
        compiling.check_modes(compiler, checkpoint=blueprint.layout.checkpoint, sharded=par.active)
        self._vertical_sync = weight_versions.check_vertical_sync(
            vertical_sync, blueprint.layout.first_schedule, blueprint.layout.schedule)
        self._connect(par.pipeline_group, device, p2p)
        self._begin(blueprint, mesh=mesh)
        self._realise(blueprint, par, compiler, init_weights, cut.split_points)

    def _connect(self, group: Any, device: Optional[Union[str, torch.device]],
                 p2p: str) -> None:
        """This rank's device and transport (checked against the group's backends); NCCL's
        communicator made now, every rank of the pipeline taking part."""
        resolved = backends.resolve_device(device, group)
        self._keep(_group=group, _device=resolved,
                   _p2p=backends.resolve_p2p(p2p, resolved, group))
        backends.warm_up(group, resolved)

    def _realise(self, blueprint: Blueprint, par: parallel_setup.Parallel,
                 compiler: Optional[compiling.Compiler], init_weights: Any,
                 split_points: Any) -> None:
        """The plan on this rank: its stages built and wired, the driver, the tied weights'
        copies made equal."""
        init = materialise.check_init_weights(init_weights)
        self._keep(_traced=(  # what generate() traces: no tensor kept
            None if blueprint.traced is None else generation.skeleton(blueprint.traced),
            split_points))
        shared = self._tie_and_materialise(blueprint, init)
        stages, kept = self._build_stages(blueprint, par, compiler, init)
        rank, owner = dist.get_rank(), list(blueprint.placement)
        module = nn.Sequential(kept)  # this rank's layers under their plain-model names
        # a traced model: this rank's parameters and buffers under the model's names
        self.module = (module if blueprint.traced is None
                       else tracing.local_view(blueprint.traced, module))
        topology = Topology(owner, rank, blueprint.physical.index(rank), self._group,
                            self._device)
        driver = PerRankDriver(topology, stages, blueprint.skips, par.data_group, shared,
                               blueprint.layout.timeout, self._p2p, sharded=par.hooks(),
                               **par.closing())
        self._keep(_stages=stages, _driver=driver)
        par.wire(stages, owner, rank, blueprint.layout.timeout)  # TP boundaries, before skips
        self.parallel = par
        skip_exchange.wire(stages, driver.skips)
        self._pipedream = (weight_versions.PipeDream(
            stages, self._vertical_sync, replicas=driver.grad_sync,
            across=driver.tied if driver.tied.trained() else None)
            if self._schedule_name == "pipedream" else None)
        driver.pipedream = self._pipedream  # its updates replace the step's gradient syncs
        driver.tied.broadcast_initial()

    def _tie_and_materialise(self, blueprint: Blueprint, init: Any) -> List[TiedWeight]:
        """Tie the planned groups; give memory on this rank's device to the meta tensors its
        stages use (ties kept); the weights that layers of several stages share."""
        module = blueprint.module
        if blueprint.ties:
            tied_weights.tie(module, blueprint.ties)
        shared = (tied_weights.find(module, blueprint.layout.balance)
                  if isinstance(module, nn.Sequential) else [])
        if not isinstance(module, nn.Module):
            return shared
        rank = dist.get_rank()
        mine = [layer for k, owner in enumerate(blueprint.placement) if owner == rank
                for layer in blueprint.layers_of(k)]
        pairs = materialise.materialise_used(
            blueprint.traced if blueprint.traced is not None else module, mine, self._device,
            init)
        new = {id(old): value for old, value in pairs}  # pairs hold the old: ids unique
        return [dataclasses.replace(w, parameter=new.get(id(w.parameter), w.parameter))
                for w in shared]

    def _build_stages(self, blueprint: Blueprint, par: parallel_setup.Parallel,
                      compiler: Optional[compiling.Compiler], init: Any
                      ) -> Tuple[List[Any], "OrderedDict[str, nn.Module]"]:
        """Every virtual stage: this rank's built on its device (its layers built, given
        memory or moved; tensor parallelism and FSDP applied), a stand-in for another rank's;
        and this rank's layers by plain name."""
        rank, device = dist.get_rank(), self._device
        kept: "OrderedDict[str, nn.Module]" = OrderedDict()
        stages: List[Any] = []
        for k, owner in enumerate(blueprint.placement):
            if owner != rank:
                stages.append(RemoteStage(k, device))
                continue
            part = OrderedDict((name, _materialise(layer, device, init))
                               for name, layer in blueprint.stages[k])
            kept.update(part)
            stage_module = par.apply(k, nn.Sequential(part))  # TP, FSDP (if any) in place
            stages.append(Stage(k, stage_module, device,
                                deferred_batch_norm=blueprint.layout.deferred_batch_norm,
                                compiler=compiler))
        _no_skips_in_factories(blueprint.module, kept)
        return stages, kept

    def _train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                    loss_reduction: str, ending: Any) -> torch.Tensor:
        """``FrontDoor``'s step; the optimizer it steps is checked first (a load that lost
        this rank's parameter groups refuses the step) and watched (such a load is refused
        when it happens): ``parallel.optimizer_loads``."""
        if ending.optimizer is not None:
            optimizer_loads.watch(ending.optimizer)
            optimizer_loads.check_groups(ending.optimizer)
        return super()._train_step(inputs, targets, loss_fn, loss_reduction, ending)

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
            raise RuntimeError(f"the state dict lacks {len(missing)} entries of the layers on "
                               f"rank {self._driver.topology.rank}, e.g. {missing[:3]}; save it "
                               f"from the plain model or gather every rank's state_dict()")
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
def _parallel(module: Any, process_group: Any, data_parallel_group: Any, **options: Any
              ) -> parallel_setup.Parallel:
    """The 3-D layout (``fastpipe.parallel``), checked before any work, on an initialised
    ``torch.distributed``."""
    if not dist.is_available() or not dist.is_initialized():
        raise ProcessGroupError("DistributedPipe needs torch.distributed: call "
                                "torch.distributed.init_process_group() first (under torchrun "
                                "the environment provides the rendezvous), or use "
                                "fastpipe.Pipe in one process")
    return parallel_setup.resolve(
        module, process_group=backends.as_group(process_group, "process_group"),
        data_parallel_group=backends.as_group(data_parallel_group, "data_parallel_group"),
        **options)


def _no_skips_in_factories(module: Any, kept: Dict[str, nn.Module]) -> None:
    if isinstance(module, nn.Sequential):
        return
    if any(declaration(m) is not None for layer in kept.values() for m in layer.modules()):
        raise NotImplementedError("skip connections (fastpipe.skip) need the model as an "
                                  "nn.Sequential (on the meta device if it is large), so that "
                                  "every rank knows where each skip goes")


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


