"""``PipelineStrategy``'s own arguments and the pipe's, checked when the strategy is built.

The strategy builds a ``Pipe`` (every stage in this process, on ``stage_devices``) or a
``DistributedPipe`` (one rank per stage, ``data_parallel_size`` replicas of the pipeline) from
the model a ``LightningModule`` holds. Every other argument is the front door's own and goes to
its constructor; those the strategy decides itself, or cannot honour, are refused here, naming
the argument and what to do instead.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

from torch import nn

from ...distributed import DistributedPipe
from ...pipe import Pipe

# The front doors' arguments the strategy sets itself, and what to use instead.
OWNED = {
    "module": "the strategy pipelines the LightningModule's model (attribute=...)",
    "devices": "give the stages' devices as stage_devices=[...]",
    "device": "each rank runs on the device Lightning gives it (Trainer(accelerator=..., "
              "devices=...))",
    "process_group": "the strategy builds the groups from Trainer(devices=..., num_nodes=...) "
                     "and data_parallel_size",
    "data_parallel_group": "set data_parallel_size=... instead",
    "mesh": "set data_parallel_size=... instead",
}
# The front doors' arguments Lightning's loop cannot drive (yet).
UNSUPPORTED = {
    "tensor_parallel": "tensor parallelism is not supported by PipelineStrategy yet",
    "data_parallel": "sharded data parallelism is not supported by PipelineStrategy yet; "
                     "data_parallel_size=... replicates the pipeline",
    "vertical_sync": "schedule='pipedream' is not supported by PipelineStrategy",
}


@dataclass(frozen=True)
class StrategyOptions:
    """The checked arguments: where the stages run, how many replicas, the model's attribute
    and the front door's own arguments (``pipe_options``)."""

    stage_devices: Optional[Tuple[str, ...]]
    data_parallel_size: int
    attribute: str
    pipe_options: Dict[str, Any]

    @property
    def in_process(self) -> bool:
        """Every stage in this process (a ``Pipe``), else one rank per stage."""
        return self.stage_devices is not None


def check(stage_devices: Optional[Sequence[Any]], data_parallel_size: Any, attribute: Any,
          pipe_options: Dict[str, Any]) -> StrategyOptions:
    """The strategy's arguments, or a ``TypeError`` / ``ValueError`` /
    ``NotImplementedError`` naming the one it cannot take."""
    if not isinstance(attribute, str) or not attribute.isidentifier():
        raise TypeError(f"attribute names the LightningModule's attribute that holds the model "
                        f"(e.g. 'model'), got {attribute!r}")
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) \
            or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be a positive int (replicas of the "
                         f"pipeline), got {data_parallel_size!r}")
    devices = _check_devices(stage_devices)
    if devices is not None and data_parallel_size != 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} with stage_devices: every "
                         f"stage runs in this one process; for replicas, leave stage_devices "
                         f"out and launch one rank per stage and replica with torchrun")
    _check_pipe_options(pipe_options, Pipe if devices is not None else DistributedPipe)
    return StrategyOptions(devices, data_parallel_size, attribute, dict(pipe_options))


def _check_devices(stage_devices: Optional[Sequence[Any]]) -> Optional[Tuple[str, ...]]:
    if stage_devices is None:
        return None
    if isinstance(stage_devices, (str, bytes)) or not isinstance(stage_devices, Sequence) \
            or not stage_devices:
        raise TypeError(f"stage_devices must be a non-empty list of devices, one per stage "
                        f"(e.g. ['cuda:0', 'cuda:1']), got {stage_devices!r}")
    return tuple(str(d) for d in stage_devices)


def _check_pipe_options(pipe_options: Dict[str, Any], door: type) -> None:
    taken = set(inspect.signature(door).parameters)
    for name in pipe_options:
        if name in OWNED:
            raise TypeError(f"PipelineStrategy({name}=...): {OWNED[name]}")
        if name in UNSUPPORTED:
            raise NotImplementedError(f"PipelineStrategy({name}=...): {UNSUPPORTED[name]}")
        if name not in taken:
            known = ", ".join(sorted(taken - set(OWNED) - set(UNSUPPORTED)))
            raise TypeError(f"PipelineStrategy got an unknown argument {name!r}: it takes "
                            f"stage_devices, data_parallel_size, attribute, "
                            f"process_group_backend, process_group_timeout and the arguments "
                            f"of {door.__name__} ({known})")
    if pipe_options.get("schedule") == "pipedream":
        raise NotImplementedError("PipelineStrategy(schedule='pipedream'): PipeDream updates "
                                  "the weights inside each step, where Lightning's loop steps "
                                  "the optimizer after it; choose another schedule")


def build(options: StrategyOptions, model: nn.Module, example_inputs: Any,
          device: Any = None, mesh: Any = None) -> Any:
    """The front door over ``model``: a ``Pipe`` on ``stage_devices``, or this rank's part of a
    ``DistributedPipe`` on ``device`` (over ``mesh`` when there are replicas)."""
    kwargs = dict(options.pipe_options)
    if example_inputs is not None:
        kwargs["example_inputs"] = example_inputs
    if options.in_process:
        return Pipe(model, devices=list(options.stage_devices or ()), **kwargs)
    if mesh is not None:
        kwargs["mesh"] = mesh
    return DistributedPipe(model, device=device, **kwargs)


def example_inputs_for(options: StrategyOptions, model: nn.Module, module: Any) -> Any:
    """The batch a traced model is traced on: ``example_inputs=`` given to the strategy, else
    the LightningModule's ``example_input_array`` (Lightning's own example of the model's
    input); none for an ``nn.Sequential``, which is not traced."""
    given = options.pipe_options.get("example_inputs")
    if given is not None or isinstance(model, nn.Sequential):
        return given
    return getattr(module, "example_input_array", None)
