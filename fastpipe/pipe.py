"""``Pipe``: split an ``nn.Sequential`` into stages, place them, run micro-batches through them.

The front door of the local executor. ``Pipe`` takes torchgpipe's ``GPipe`` arguments plus a
``schedule``; ``pipe(x)`` runs a forward pass whose output can be backpropagated as usual, and
``pipe.train_step(inputs, targets, loss_fn)`` runs forward and backward on any schedule of the IR,
accumulating exactly the gradients that the unsplit module gives on the whole batch.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .policies import compile as compiling, tied as tied_weights
from .frontdoor import Blueprint, FrontDoor, Layout, OnDevices, plan_pipeline
from .frontdoor.layout_option import resolve_layout
from .placement import Device, StagesStayPut, check_flag, check_workers
from .runtime import graphs, weight_versions
from .schedule import Schedule
from .runtime.drivers.in_process import InProcessDriver
from .runtime.stage import Stage
from .autotune.workers import WorkerPolicy
from .skip import exchange as skip_exchange


class Pipe(StagesStayPut, FrontDoor):
    """A pipeline-parallel wrapper of an ``nn.Sequential``.

    Args:
        module: the model, an ``nn.Sequential``; its layers are moved to the stages' devices.
            A model in ``torch.compile`` is taken out of it (its stages are compiled with its
            options), and so are compiled submodules (see ``compile``): names stay plain.
        chunks: number of micro-batches each batch is split into (``torch.chunk`` semantics: a
            batch of 5 in 4 chunks gives micro-batches of 2, 2 and 1). ``'auto'``: the first
            training steps measure the throughput of candidate counts and the pipe keeps the
            best (``fastpipe.autotune.chunk_count``; logged, measurements in ``chunk_search``).
        devices: one device per stage (``'cpu'``, ``'cuda:N'``; a device may repeat). Default: the
            CUDA devices, or the CPU.
        balance: layers per stage. ``None`` splits by parameter count into one stage per device;
            ``fastpipe.balance.by_time`` / ``by_size`` give profiled balances.
        checkpoint: ``'never'``, ``'except_last'`` (all micro-batches but the last recompute their
            forward in backward), ``'always'``, or ``'offload'`` (nothing recomputed: the tensors
            saved for backward wait in host memory, see ``fastpipe.policies.offload``), or
            ``'selective'`` (matrix-product outputs kept, everything else recomputed in backward,
            see ``fastpipe.policies.selective``).
        schedule: a schedule name of ``fastpipe.schedule`` (``'gpipe'``, ``'1f1b'``,
            ``'interleaved'``, ``'looped-bfs'``, ``'zb-h1'``, ``'zbv'``, ``'dualpipev'``), or
            ``'auto'``: the first ``train_step`` runs 1F1B (looped BFS with virtual stages),
            measures each action, and the pipe keeps the schedule the simulator predicts fastest
            for those costs (see ``fastpipe.autotune.schedule_choice``; the choice is logged and
            kept in
            ``auto_ranking``), or a ``Schedule`` object (e.g. ``fastpipe.schedule.read_csv(...)``:
            one written by PyTorch's pipelining or torchtitan), run for exactly its micro-batch
            count.
        virtual_stages: model chunks per device, for interleaved and V-shaped schedules; then
            ``balance`` lists ``len(devices) * virtual_stages`` chunk sizes in model order and
            the schedule's placement decides which device holds which chunk. Default: 2 for
            ``'zbv'`` and ``'dualpipev'`` (they need two), else 1.
        timeout: seconds any stage may wait for an input (and any action may run) before the
            step fails with an error naming the stage, the action and the micro-batch.
        cpu_workers: threads that run the CPU stages (consecutive stages share a thread when
            there are more stages than threads). Default ``None``: one per core (at most one per
            stage) while actions are long, one in all when the measured time per action is so
            short that hand-offs between threads would cost more than the overlap gains.
            Each GPU stage always has its own thread.
        deferred_batch_norm: normalise each micro-batch with its own statistics but update
            batch-norm running statistics once per mini-batch, from all its micro-batches, so
            they match the plain model's (torchgpipe's semantics; see ``fastpipe.batchnorm``).
        tied: groups of parameters to tie, by plain-module name or as Parameters, e.g.
            ``[('0.weight', '5.weight')]``: each group becomes the first one's Parameter. Layers
            of several stages sharing a Parameter (tied in the module or here) keep sharing it,
            across devices too (see ``fastpipe.tied``). Skip connections between layers are
            declared on the layers (see ``fastpipe.skip``).
        cuda_graphs: capture each CUDA stage's forward and backward as CUDA graphs, per input
            shape and dtype, and replay them in training steps (fewer kernel launches; see
            ``fastpipe.runtime.graphs``). CPU stages, unusual inputs and failed captures run
            eagerly, with one warning each. Not with ``schedule='pipedream'``.
        vertical_sync: with ``schedule='pipedream'``, run each micro-batch on every stage with
            the weight version stage 0 gave it (see ``fastpipe.runtime.weight_versions``).
        split_points: for any ``nn.Module`` (or to cut an ``nn.Sequential`` by submodule
            names): submodule names, each beginning a stage, or ``'auto'`` (the largest list of
            repeated blocks, cut into ``len(devices) * virtual_stages`` stages). The module is
            traced with ``torch.export`` (``fastpipe.tracing``); names, ties, inputs and outputs
            stay the module's own.
        example_inputs: the batch the module is traced on (a tensor, a tuple of positional
            inputs, a dict of keyword inputs); required for a module other than a Sequential.
        compile: ``True``, or a dict of ``torch.compile`` options (``{'backend': 'aot_eager'}``,
            ``{'mode': 'max-autotune'}``): each stage's module is compiled in place (the first
            step compiles; names, hooks and wrappers unchanged, see
            ``fastpipe.policies.compile``). Submodules given in ``torch.compile`` are then
            compiled as part of their stage; with ``False`` (default) they stay compiled alone.
            Not with ``checkpoint='selective'`` or ``cuda_graphs=True``.
        output_reduction: how output leaves that are not one row per sample combine over
            micro-batches, by leaf name: ``{'loss': 'mean'}`` (a mean over samples), ``'sum'``,
            ``'token_mean'`` (over labels that are not -100), ``'shifted_token_mean'`` (a
            causal LM's), ``'cat'``, or a function of a micro-batch's named inputs giving the
            count its mean is over (``fastpipe.outputs``). The loss of the Hugging Face models
            ``fastpipe.hf_losses`` knows needs none; another leaf without a rule is an
            ``OutputReductionError`` naming it.
        layout: a Megatron-core layout string (``--pipeline-model-parallel-layout``), e.g.
            ``'E,t*3|t*4|t*3,L'``, instead of ``balance`` or ``split_points``: ``|`` ends a
            stage; a traced model's ``E`` is what runs before its repeated blocks, each ``t``
            one block, ``L`` what runs after them; an ``nn.Sequential``'s letters are one layer
            each. Stages over devices give ``virtual_stages``; without ``devices``, one device
            per stage (see ``fastpipe.frontdoor.layout_string``).

    The pipe casts like a module (``pipe.to(torch.bfloat16)``, ``.to(dtype=...)``,
    ``.half()``, ``.to(device, dtype)`` on the stages' own device), but its stages stay on their
    devices: a move (``.to(device)``, ``.to(tensor)``, ``.cuda()``, ``.cpu()``) raises
    ``TypeError``, as in torchgpipe.
    """

    @compiling.takes_compiled
    def __init__(self, module: nn.Sequential, chunks: Union[int, str] = 1,
                 devices: Optional[Sequence[Device]] = None,
                 balance: Optional[Sequence[int]] = None, checkpoint: str = "except_last",
                 schedule: Union[str, Schedule] = "gpipe", *, virtual_stages: Optional[int] = None,
                 timeout: float = 300.0, cpu_workers: Optional[int] = None,
                 deferred_batch_norm: bool = False, tied: Sequence[Sequence[Any]] = (),
                 vertical_sync: bool = False, cuda_graphs: bool = False,
                 split_points: Optional[Any] = None, example_inputs: Optional[Any] = None,
                 compile: Union[bool, Dict[str, Any]] = False,
                 output_reduction: Optional[Dict[str, Any]] = None,
                 layout: Optional[str] = None) -> None:
        super().__init__()
        compiler = compiling.check(compile)  # as takes_compiled resolved it
        cut = resolve_layout(layout, module, OnDevices(devices), balance=balance,
                             split_points=split_points, virtual_stages=virtual_stages,
                             schedule=schedule)
        blueprint = plan_pipeline(
            module, cut.where, chunks=chunks, schedule=schedule, balance=cut.balance,
            checkpoint=checkpoint, virtual_stages=cut.virtual_stages, timeout=timeout,
            deferred_batch_norm=deferred_batch_norm, tied=tied, split_points=cut.split_points,
            example_inputs=example_inputs, output_reduction=output_reduction)
        workers = check_workers(cpu_workers)
        use_graphs = check_flag(cuda_graphs, "cuda_graphs")
        compiling.check_modes(compiler, checkpoint=blueprint.layout.checkpoint,
                              cuda_graphs=use_graphs)
        vertical_sync = _check_vertical_sync(vertical_sync, blueprint.layout)
        weight_versions.check_cuda_graphs(use_graphs, blueprint.layout.first_schedule)
        self._begin(blueprint, _devices=blueprint.physical,
                    _traced=(blueprint.traced, cut.split_points))  # what generate() traces
        self._realise(blueprint, compiler, use_graphs, vertical_sync, workers)

    def _realise(self, blueprint: Blueprint, compiler: Optional[compiling.Compiler],
                 use_graphs: bool, vertical_sync: bool, cpu_workers: Optional[int]) -> None:
        """The plan on this process's devices: weights tied, each stage's layers moved to its
        device, tied weights and skip connections wired, the workers and the driver."""
        layout = blueprint.layout
        tied_weights.tie(blueprint.module, blueprint.ties)
        parts = [nn.Sequential(*blueprint.layers_of(k)) for k in range(len(layout.balance))]
        for part, device in zip(parts, blueprint.placement):
            part.to(device)
        stages = [Stage(k, part, device, deferred_batch_norm=layout.deferred_batch_norm,
                        compiler=compiler)
                  for k, (part, device) in enumerate(zip(parts, blueprint.placement))]
        tied_grads = tied_weights.bind(stages, tied_weights.find(blueprint.module, layout.balance))
        skip_exchange.wire(stages, blueprint.skips)
        if use_graphs:
            graphs.enable(stages)
        workers = WorkerPolicy(self._devices, cpu_workers)
        self._keep(_partitions=nn.ModuleList(parts), _stages=stages, _workers=workers,
                   _pipedream=(weight_versions.PipeDream(stages, vertical_sync)
                               if layout.first_schedule == "pipedream" else None),
                   _driver=InProcessDriver(stages, self._devices, workers, tied_grads,
                                           layout.timeout))
        # names, state dicts and modes are the traced module's, or the layers'
        self.module = blueprint.traced if blueprint.traced is not None else blueprint.module

    # ---------------------------------------------------------------- read-only properties
    @property
    def partitions(self) -> nn.ModuleList:
        """The stages' modules, in order (each an ``nn.Sequential`` of the original layers)."""
        return self._partitions

    @property
    def devices(self) -> Tuple[torch.device, ...]:
        """Device of each stage."""
        return self._devices

    @property
    def cpu_workers(self) -> int:
        """Threads that run the CPU stages in the next step."""
        return self._workers.current

    @property
    def num_stages(self) -> int:
        """Physical stages (``len(devices)``)."""
        return len(self._devices)

    # ---------------------------------------------------------------- plain-module names
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a plain module's state dict; tensors are copied onto each stage's device."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _placement(self) -> Tuple[Sequence[torch.device], str]:
        return self._devices, "Pipe(devices=...)"

    def _local_devices(self) -> Tuple[torch.device, ...]:
        return self._devices

    def __repr__(self) -> str:
        layout = ", ".join(f"{b}@{d}" for b, d in zip(self.balance, self._devices))
        return (f"Pipe(stages=[{layout}], chunks={self._chunks}, "
                f"schedule={self._schedule_name!r}, checkpoint={self.checkpoint!r})")

    def __del__(self) -> None:
        workers = self.__dict__.get("_workers")
        if workers is not None:
            workers.shutdown()


def _check_vertical_sync(vertical_sync: Any, layout: Layout) -> bool:
    """``vertical_sync``, checked: it applies to PipeDream's weight versions only."""
    return weight_versions.check_vertical_sync(vertical_sync, layout.first_schedule,
                                               layout.schedule)
