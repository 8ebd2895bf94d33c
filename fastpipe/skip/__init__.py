"""Skip connections across stages: a tensor stashed in one layer and popped in a later one.

Declare the names a layer class stashes and pops with :func:`skippable`, and call
:func:`stash` / :func:`pop` inside its ``forward``::

    @fastpipe.skip.skippable(stash=["x"])
    class Keep(nn.Module):
        def forward(self, x):
            fastpipe.skip.stash("x", x)
            return x

    @fastpipe.skip.skippable(pop=["x"])
    class Add(nn.Module):
        def forward(self, h):
            return h + fastpipe.skip.pop("x")

Run unsplit, the layers pass the tensor through a per-thread dictionary. Inside a ``Pipe`` the
declarations tell, at construction, which stage produces and which consumes each name; the
tensor then travels straight from the producing stage to the consuming one (not through the
stages between), and its gradient travels straight back, into the producer's backward.

torchgpipe's form runs unchanged: a generator ``forward`` that writes ``yield stash('x', x)``
and ``x = yield pop('x')``, ``Namespace`` with ``layer.isolate(ns)`` to use a skippable class
twice, ``stash(name, None)``, and :func:`verify_skippables`.
"""
from .api import (Declaration, Namespace, SkipError, declaration, declared, pop, skippable,
                  stash, verify_skippables)
from .layout import plan

__all__ = ["Declaration", "Namespace", "SkipError", "declaration", "declared", "plan", "pop",
           "skippable", "stash", "verify_skippables"]
