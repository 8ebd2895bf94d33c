"""Where a checkpoint is written, and when it counts: only once every rank has written it.

``save`` writes into ``<parent>/.<name>.incomplete``. When every rank has finished, rank 0
renames that to ``<parent>/<name>`` and then writes the marker ``fastpipe-checkpoint.json``
into it (to a temporary file first, then renamed, so the marker is whole or absent). A
directory is a checkpoint only with its marker: a save interrupted anywhere leaves a staging
directory or a directory without marker, which ``load`` refuses and ``latest`` skips, and the
next save to the same name replaces. The marker numbers each checkpoint one above the highest
complete one beside it, so ``latest`` orders checkpoints without trusting names or clocks.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Dict, Optional

from .errors import IncompleteCheckpointError

MARKER = "fastpipe-checkpoint.json"
FORMAT = 1


def staging(directory: str) -> str:
    """The directory a save writes into before it is complete."""
    parent, name = os.path.split(os.path.abspath(directory))
    return os.path.join(parent, f".{name}.incomplete")


def refuse_existing(directory: str) -> Optional[str]:
    """Why ``directory`` cannot be saved to (a complete checkpoint is there), or ``None``."""
    if is_complete(directory):
        return (f"directory {directory!r} already holds a complete checkpoint; save each "
                f"checkpoint under its own name (e.g. 'step-000300') or remove the old one")
    if os.path.exists(directory) and not os.path.isdir(directory):
        return f"directory {directory!r} is a file, not a directory"
    return None


def prepare(directory: str) -> str:
    """Remove what an interrupted save left under this name; an empty staging directory."""
    stage = staging(directory)
    shutil.rmtree(stage, ignore_errors=True)
    if os.path.isdir(directory) and not is_complete(directory):
        shutil.rmtree(directory)
    os.makedirs(stage)
    return stage


def commit(directory: str, info: Dict[str, Any]) -> None:
    """Make the staged checkpoint complete: rename it into place, then write its marker."""
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.rename(staging(directory), directory)
    _sync(parent)
    marker = dict(info, format=FORMAT, serial=_next_serial(parent), saved_at=time.time())
    scratch = os.path.join(directory, f".{MARKER}.tmp")
    with open(scratch, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(scratch, os.path.join(directory, MARKER))
    _sync(directory)


def read_marker(directory: str) -> Dict[str, Any]:
    """The marker of a complete checkpoint; ``FileNotFoundError`` for a missing directory,
    ``IncompleteCheckpointError`` for one without a valid marker."""
    if not os.path.isdir(directory) and not os.path.isdir(staging(directory)):
        raise FileNotFoundError(f"no checkpoint directory {directory!r}")
    marker = _marker(directory) if os.path.isdir(directory) else None
    if marker is None:
        raise IncompleteCheckpointError(
            f"{directory!r} is not a complete checkpoint (no valid {MARKER}): a save that did "
            f"not finish, or a directory fastpipe.checkpoint.save did not write; "
            f"fastpipe.checkpoint.latest(root) finds the last complete one")
    return marker


def is_complete(directory: str) -> bool:
    """Whether ``directory`` is a checkpoint whose every rank finished writing it."""
    return os.path.isdir(directory) and _marker(directory) is not None


def latest(root: str) -> Optional[str]:
    """The complete checkpoint directly under ``root`` saved last (the highest serial number),
    or ``None`` when there is none (or no ``root``)."""
    found = []
    if os.path.isdir(root):
        for entry in os.scandir(root):
            if entry.is_dir() and not entry.name.startswith("."):
                marker = _marker(entry.path)
                if marker is not None:
                    found.append((marker["serial"], marker.get("saved_at", 0.0), entry.path))
    return max(found)[2] if found else None


def _marker(directory: str) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(directory, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(marker, dict) and marker.get("format") == FORMAT \
        and isinstance(marker.get("serial"), int)
    return marker if ok else None


def _next_serial(parent: str) -> int:
    serials = [m["serial"] for e in os.scandir(parent)
               if e.is_dir() and (m := _marker(e.path)) is not None]
    return max(serials, default=0) + 1


def _sync(path: str) -> None:
    """Flush a directory's entries (a rename) to disk, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
