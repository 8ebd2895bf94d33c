"""A load that reads a checkpoint as data: nothing in its files can run code.

``torch.distributed.checkpoint`` unpickles two things without restriction: its ``.metadata``
file (``pickle.load``) and every non-tensor entry (``torch.load(..., weights_only=False)``:
here the optimizer's hyperparameters and fastpipe's own entries). A ``fastpipe.checkpoint.load``
reads both through restricted loaders instead: the metadata with an unpickler that builds only
``torch.distributed.checkpoint``'s own record types (its dataclasses and enums), torch's dtypes,
``torch.Size`` and paths, and the entries with ``torch.load(..., weights_only=True)`` (numbers,
strings, containers, tensors). Anything else is refused with a ``CheckpointError`` naming it,
unless the caller passed ``trust_pickled=True`` (then torch's own loaders run, as
``torch.distributed.checkpoint.load`` does).
"""
from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
import sys
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CheckpointError

_DCP = "torch.distributed.checkpoint"
_PLAIN = {("collections", "OrderedDict"): OrderedDict, ("torch", "Size"): torch.Size,
          ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
          **{("pathlib", c.__name__): c for c in (pathlib.PosixPath, pathlib.WindowsPath,
                                                  pathlib.PurePosixPath, pathlib.PureWindowsPath,
                                                  pathlib.Path)}}
TRUST_HINT = ("pass trust_pickled=True to fastpipe.checkpoint.load only for a checkpoint you "
              "trust as you trust code (its pickles can run any code)")


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file whose loading needs arbitrary unpickling (a type outside the data a
    checkpoint holds); refused before anything changes."""


def reader(path: str, trust_pickled: bool) -> dcp.FileSystemReader:
    """The storage reader of a load: the metadata read as data unless ``trust_pickled``."""
    return dcp.FileSystemReader(path) if trust_pickled else DataOnlyReader(path)


def planner(trust_pickled: bool) -> DefaultLoadPlanner:
    """The load planner: non-tensor entries read as data unless ``trust_pickled``."""
    return DefaultLoadPlanner() if trust_pickled else DataOnlyPlanner()


class DataOnlyReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not "
                                        f"torch.distributed.checkpoint's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only ``torch.distributed.checkpoint``'s record types (dataclasses and enums of
    its modules, already imported), torch's dtypes, ``torch.Size``, ``torch.serialization``'s
    layout lookup, paths, sets and ``OrderedDict``."""

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN.get((module, name))
        if found is None:
            found = _allowed(module, name)
        if found is None:
            raise UnsafeCheckpointError(
                f"the checkpoint metadata {self.where} names {module}.{name}, which is not "
                f"one of torch.distributed.checkpoint's record types: a forged or foreign "
                f"file, or one written by a torch newer than this fastpipe knows; "
                f"{TRUST_HINT}")
        return found


def _allowed(module: str, name: str) -> Any:
    """The record type, dtype or layout lookup ``module.name`` names, if it is one."""
    if module == "torch":
        value = vars(torch).get(name)
        return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) \
            else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    if module != _DCP and not module.startswith(_DCP + "."):
        return None
    value = vars(sys.modules[module]).get(name) if module in sys.modules else None
    is_record = isinstance(value, type) and (dataclasses.is_dataclass(value)
                                             or issubclass(value, enum.Enum))
    return value if is_record else None


class DataOnlyPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor entries are read with
    ``torch.load(..., weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"the checkpoint entry {fqn!r} needs arbitrary unpickling, which a load does "
                f"not do: {refusal_reason(error)}; {TRUST_HINT}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def refusal_reason(error: BaseException) -> str:
    """The first line of torch's weights-only refusal (what it met)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines if "Unsupported" in line or "GLOBAL" in line]
    return (useful or lines or ["unpickling refused"])[0][:300]
