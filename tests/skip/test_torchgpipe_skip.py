"""fastpipe.skip side by side with torchgpipe.skip 0.0.7 (when installed): namespaces and
skippable layers behave and show alike."""
import copy
import pickle

import pytest
from torch import nn

import fastpipe.skip

torchgpipe_skip = pytest.importorskip("torchgpipe.skip", reason="torchgpipe is not installed")


def both(program):
    """``program(skip)`` with torchgpipe's skip module, then fastpipe's."""
    return [program(module) for module in (torchgpipe_skip, fastpipe.skip)]


def namespace_copies(skip):
    ns = skip.Namespace()
    copies = [copy.copy(ns), copy.deepcopy(ns), pickle.loads(pickle.dumps(ns))]
    return ([c == ns for c in copies], [hash(c) == hash(ns) for c in copies],
            [c is ns for c in copies], skip.Namespace() == ns, len({ns, *copies}))


def test_namespace_copies_are_the_same_namespace_alike():
    theirs, ours = both(namespace_copies)
    assert ours == theirs == ([True] * 3, [True] * 3, [False] * 3, False, 1)


def skippable_reprs(skip):
    @skip.skippable(stash=["hello"])
    class Hello(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1)

        def forward(self, x):
            yield skip.stash("hello", x)
            return self.conv(x)

    @skip.skippable(pop=["hello"])
    class Shown(nn.Module):
        def extra_repr(self):
            return "shown"

        def forward(self, x):
            hello = yield skip.pop("hello")
            return x + hello

    return repr(Hello()), repr(nn.Sequential(Hello(), Shown()))


def test_a_skippable_layer_shows_as_in_torchgpipe():
    theirs, ours = both(skippable_reprs)
    assert ours == theirs
    assert ours[0].startswith("@skippable(Hello(\n  (conv): Conv2d(1, 1")
