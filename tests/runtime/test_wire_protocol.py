"""Message metadata is data: every structure a stage sends round-trips through the JSON
encoding, and bytes that are not that data (a forged pickle, an import by name, garbage) are
refused with a ``ProtocolError`` naming the sending rank, without running anything."""
from __future__ import annotations

import math
import pickle
import sys
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any, List

import pytest
import torch
from torch.utils import _pytree as pytree

from fastpipe.errors import ProtocolError
from fastpipe.runtime.transport.device_copy import Parcel
from fastpipe.runtime.transport.message import TENSOR, Message, flatten, unflatten
from fastpipe.runtime.transport.p2p import from_meta, to_meta
from fastpipe.runtime.transport.wire import Meta

Point = namedtuple("Point", "x y")
pytree._register_namedtuple(Point, serialized_type_name="tests.wire_protocol.Point")
Loose = namedtuple("Loose", "a b")  # not registered: cannot cross ranks


class Pair:
    """A container registered with torch's pytree without a serialized name."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second


pytree.register_pytree_node(Pair, lambda p: ([p.first, p.second], None),
                            lambda values, _: Pair(*values))


def round_trip(value: Any, sender: int = 3) -> Any:
    """``value`` sent as a stage message: its metadata encoded, decoded, the tensors put back."""
    leaves, spec = flatten(value)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    constants = [TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    message = Message(spec, constants, Parcel(tensors), [t.requires_grad for t in tensors])
    meta = Meta.decode(to_meta(message, tensors).encode(), sender)
    assert meta.layouts == [(t.dtype, tuple(t.shape)) for t in tensors]
    back = from_meta(meta, tensors)
    it = iter(tensors)
    return unflatten([next(it) if c is TENSOR else c for c in back.constants], back.spec)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, Pair):
        return isinstance(b, Pair) and same(a.first, b.first) and same(a.second, b.second)
    return type(a) is type(b) and a == b


VALUES = {
    "tensor": torch.randn(2, 3),
    "skip-like": (torch.randn(2, 3), torch.ones(3, dtype=torch.float16)),
    "leaves": {"x": torch.randn(2), "n": 4, "f": 0.1, "flag": True, "none": None, "s": "text",
               "big": 2 ** 70},
    "non-finite": [math.nan, math.inf, -math.inf, -0.0, 1e-308],
    "torch values": [torch.float16, torch.bfloat16, torch.int8, torch.device("cpu"), 1 + 2j],
    "keys": {1: torch.ones(1), (2, "b"): "tuple key", None: 3},
    "containers": OrderedDict(a=[torch.ones(1), (2, [3])], b=defaultdict(list, {"k": 1})),
    "namedtuple": Point(torch.ones(2), "y"),
    "registered": Pair(torch.zeros(1), {"deep": Pair(1, None)}),
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_kind_of_message_structure_round_trips(name):
    value = VALUES[name]
    assert same(round_trip(value), value)


def test_a_hugging_face_output_round_trips_by_its_registered_name():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    value = outputs.CausalLMOutputWithPast(logits=torch.randn(2, 3, 5),
                                           hidden_states=(torch.randn(2, 3, 4),))
    back = round_trip(value)
    assert type(back) is type(value) and list(back.keys()) == list(value.keys())
    assert torch.equal(back.logits, value.logits)
    raw = bytes(to_meta(Message(*_parts(value)), []).encode().tolist())
    assert b"transformers.modeling_outputs.CausalLMOutputWithPast" in raw


def _parts(value: Any) -> List[Any]:
    leaves, spec = flatten(value)
    constants = [TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    return [spec, constants, Parcel([]), [False] * sum(c is TENSOR for c in constants)]


@pytest.mark.parametrize("value, match", [
    (Loose(torch.ones(1), 2), "namedtuple registered with a serialized_type_name"),
    ({"f": lambda: 0}, "a value of type function"),
    ([object()], "a value of type object"),
])
def test_a_value_that_is_not_data_is_refused_at_the_sender(value, match):
    with pytest.raises(TypeError, match=match):
        to_meta(Message(*_parts(value)), []).encode()


# ------------------------------------------------------------------------- what is refused
RAN: List[str] = []


def _ran(what: str) -> None:
    RAN.append(what)


class Exploit:
    """Unpickling an instance calls ``_ran``: what a forged message would make a rank run."""

    def __reduce__(self) -> Any:
        return _ran, ("code from a peer",)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def test_a_forged_pickle_that_would_run_code_is_refused_and_nothing_runs():
    payload = pickle.dumps((None, [Exploit()], [False], [], []))
    pickle.loads(payload)  # the payload is live: a pickle-based decoder runs it
    assert RAN == ["code from a peer"]
    RAN.clear()
    with pytest.raises(ProtocolError, match="rank 5 sent pipeline message metadata that does "
                                            "not decode") as caught:
        Meta.decode(_bytes(payload), 5)
    assert caught.value.rank == 5 and RAN == []


@pytest.mark.parametrize("forged", [
    b'[1,["this.Zen",null,[]],[],[],[],[]]',  # a type by an importable path, not registered
    b'[1,["builtins.dict",{"__enum__":1,"fqn":"this:Zen","name":"x"},[]],[],[],[],[]]',
    b'[1,null,[{"$":"type","v":"os.system"}],[false],[],[]]',
    b'[1,["collections.namedtuple",{"$":"type","v":"builtins.dict"},[null]],[1],[false],[],[]]',
    b'[1,["collections.defaultdict",[{"$":"type","v":"builtins.eval"},{"$":"tuple","v":[]}],'
    b'[]],[],[],[],[]]',
])
def test_names_that_are_not_registered_containers_resolve_to_nothing(forged):
    """torch's own spec loader imports a module named in an enum context; this decoder never
    imports (``this`` prints when imported) and resolves types only in the pytree registry."""
    had = "this" in sys.modules
    with pytest.raises(ProtocolError, match="rank 2 sent"):
        Meta.decode(_bytes(forged), 2)
    assert ("this" in sys.modules) == had


@pytest.mark.parametrize("garbage", [
    b"", b"\xff\xfe", b"{", b"[1, NaN]", b"[2,null,[],[],[],[]]", b'[1,null,[3],[true],[],[]]',
    b'[1,null,[],[],[],[["float99",[2]]]]', b'[1,null,[],[],[],[["float32",[-1]]]]',
    b'[1,["builtins.tuple",null,[null,null]],[1],[false],[],[]]', b"[" * 100000,
])
def test_bytes_that_are_not_metadata_are_a_protocol_error(garbage):
    with pytest.raises(ProtocolError) as caught:
        Meta.decode(_bytes(garbage), 1)
    assert caught.value.rank == 1 and "nothing in it was run" in str(caught.value)
