"""Checkpoints out in the Hugging Face format: a directory that ``from_pretrained`` loads.

:func:`save_pretrained` writes a live pipe's model (every rank's share, gathered on rank 0 by
:mod:`.gather`) with the model's own ``save_pretrained``: its config, its safetensors, its
generation config (a ``PeftModel`` writes its adapter). :func:`convert` does the same offline
from a directory of ``fastpipe.checkpoint.save``, in one process, with a model of the given
config built on the meta device (no memory for its weights): ``python -m fastpipe hf-export``.

``transformers`` is imported only by :func:`convert`, when it runs: the base install stays
``torch`` only.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ..distributed import DistributedPipe
from ..frontdoor import FrontDoor
from . import data_only, directory as folder
from .errors import CheckpointError
from .gather import full_state_dict
from .ranks import Ranks

PathLike = Any  # str or os.PathLike


def save_pretrained(directory: PathLike, pipe: nn.Module, model: Optional[nn.Module] = None, *,
                    timeout: Optional[float] = None, **options: Any) -> str:
    """Write ``pipe``'s model to ``directory`` in the Hugging Face format, from every rank's
    share; returns the directory's absolute path.

    ``model``: the object whose ``save_pretrained`` writes the files (its class and config name
    the format), by default the pipe's module when it has one (a ``Pipe`` of a Hugging Face
    model, or that model itself); a ``DistributedPipe`` keeps only its own layers, so pass the
    model it was built from. The weights written are the pipe's, not ``model``'s. ``options``
    go to ``model.save_pretrained`` (``max_shard_size``, ``safe_serialization``, ...). On a
    ``DistributedPipe`` every rank calls it with the same arguments; rank 0 writes, and every
    rank returns once the files are complete (or raises, all ranks alike).
    """
    path = os.path.abspath(os.fspath(directory))
    writer = model if model is not None else _own_model(pipe)
    if not callable(getattr(writer, "save_pretrained", None)):
        raise TypeError(f"save_pretrained needs a model with save_pretrained() (a transformers "
                        f"PreTrainedModel or a PeftModel): pass model=<the model the pipe was "
                        f"built from>, got {type(writer).__name__}")
    ranks = Ranks(pipe, timeout)
    ranks.agree(ranks.problem, "the arguments of a Hugging Face save", same=f"directory={path}")
    state = full_state_dict(pipe, timeout=timeout)
    problem = None
    if state is not None:
        try:
            writer.save_pretrained(path, state_dict=state, **options)
        except OSError as error:
            problem = CheckpointError(f"cannot write the Hugging Face checkpoint {path!r}: {error}")
    ranks.agree(problem, "the end of a Hugging Face save")
    return path


def _own_model(pipe: nn.Module) -> Any:
    """The model a pipe shows by its names: the traced module of a ``Pipe``; a plain module is
    its own."""
    if isinstance(pipe, DistributedPipe):
        return None
    return pipe.module if isinstance(pipe, FrontDoor) else pipe


def convert(checkpoint: PathLike, output: PathLike, config: Any, *,
            model_class: Optional[type] = None, **options: Any) -> str:
    """Write the model of a ``fastpipe.checkpoint`` directory (saved at any layout) to
    ``output`` in the Hugging Face format; returns ``output``'s absolute path.

    ``config``: a ``transformers`` config, or what ``AutoConfig.from_pretrained`` reads (a
    directory holding ``config.json``, or the file's path). ``model_class``: the model's class,
    by default the one the config's ``architectures`` names. The model is built on the meta
    device and writes the checkpoint's tensors; ``options`` go to its ``save_pretrained``.
    """
    source = os.fspath(checkpoint)
    folder.read_marker(source)  # a complete checkpoint, else IncompleteCheckpointError
    state = read_model_state(source)
    config = _config(config)
    cls = model_class if model_class is not None else _architecture(config)
    with torch.device("meta"):
        model = cls(config)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise CheckpointError(f"the checkpoint {source!r} lacks {len(missing)} entries of "
                              f"{cls.__name__}, e.g. {missing[:4]}: it was saved from another "
                              f"model, or config= describes another one")
    path = os.path.abspath(os.fspath(output))
    model.save_pretrained(path, state_dict=state, **options)
    return path


def read_model_state(checkpoint: str) -> Dict[str, torch.Tensor]:
    """The model entries of a ``fastpipe.checkpoint`` directory, as full CPU tensors, read in
    this one process."""
    metadata = data_only.DataOnlyReader(checkpoint).read_metadata()  # as data
    model = {key[len("model."):]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(md, "size")}
    template = {"model": model}
    with warnings.catch_warnings():  # one process reads, as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, storage_reader=data_only.DataOnlyReader(checkpoint),
                 planner=data_only.DataOnlyPlanner(), no_dist=True)
    return template["model"]


def _config(config: Any) -> Any:
    transformers = _transformers()
    if isinstance(config, transformers.PretrainedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        where = os.fspath(config)
        if os.path.basename(where) == "config.json":
            where = os.path.dirname(where) or "."
        return transformers.AutoConfig.from_pretrained(where)
    raise TypeError(f"config must be a transformers config or the path of one (a directory "
                    f"holding config.json), got {type(config).__name__}")


def _architecture(config: Any) -> type:
    names = getattr(config, "architectures", None) or []
    transformers = _transformers()
    found = [getattr(transformers, name, None) for name in names]
    if not names or found[0] is None:
        raise ValueError(f"the config names no model class transformers has (architectures="
                         f"{names!r}): pass model_class=, e.g. LlamaForCausalLM")
    return found[0]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(f"writing the Hugging Face format needs transformers ({error}): "
                          f"pip install 'fastpipe[transformers]'") from error
    return transformers
