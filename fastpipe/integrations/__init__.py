"""Thin adapters that run a training framework's own loop on a pipe (optional extras).

Each framework has its own module, importable only when the framework is installed:
``fastpipe.integrations.transformers`` (Hugging Face ``Trainer`` and TRL's ``SFTTrainer``:
``pip install 'fastpipe[transformers]'``), ``fastpipe.integrations.lightning`` (Lightning's
``Trainer`` with ``PipelineStrategy``: ``pip install 'fastpipe[lightning]'``). An adapter maps
the framework's loop onto the front doors' ``train_step`` / ``evaluate`` and
``fastpipe.checkpoint``; nothing of a framework reaches the runtime, and ``import fastpipe``
imports no framework.
"""
from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import the framework ``module``, or raise an ``ImportError`` naming the extra that
    installs it (``pip install 'fastpipe[<extra>]'``)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"this fastpipe integration needs {module!r}, which is not installed "
                          f"({error}); install it with: pip install 'fastpipe[{extra}]'") from error
