"""The pure parts of the distributed transport: wire format, buckets, channels, last actions."""
from __future__ import annotations

import math

import pytest
import torch

from fastpipe.runtime.dist_executor import Topology, flows, last_gradient_actions, links
from fastpipe.runtime.grad_sync import buckets
from fastpipe.runtime.p2p import Kinds, from_meta, to_meta
from fastpipe.runtime.step import Message, _flatten, _TENSOR
from fastpipe.runtime.hop import Parcel
from fastpipe.runtime.wire import ALIGN, HEADER_LEN, Header, Meta, layouts_of, pack, payload_size, unpack
from fastpipe.schedule import get_schedule
from fastpipe.skip.layout import StageSkips


def test_header_round_trips_and_rejects_garbage():
    header = Header(1, 3, 2, 8, 61, 120, 4096, 17, loss=0.123456789)
    assert Header.decode(header.encode()) == header
    assert math.isnan(Header.decode(Header(0, 0, 0, 1, 1, 0, 0, 0).encode()).loss)
    with pytest.raises(ValueError, match="corrupt pipeline message header"):
        Header.decode(torch.zeros(HEADER_LEN, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_header_carries_the_loss_in_its_dtype(dtype):
    header = Header(1, 0, 0, 2, 4, 0, 0, 1, loss=1 / 3, loss_dtype=dtype)
    decoded = Header.decode(header.encode())
    assert decoded.loss == 1 / 3 and decoded.loss_dtype == dtype


@pytest.mark.parametrize("tensors", [
    [torch.randn(3, 5)],
    [torch.randn(2, 3), None, torch.arange(7), torch.tensor(True), torch.randn(()).double()],
    [None, torch.randn(4, 1).t()],  # one tensor, not contiguous
    [torch.randn(5, dtype=torch.bfloat16), torch.randint(0, 9, (3,), dtype=torch.int8)],
])
def test_pack_and_unpack_give_back_the_same_tensors(tensors):
    layouts = layouts_of(tensors)
    payload = pack(tensors)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_size(layouts)
    received = payload.clone()  # what a receive into a fresh byte buffer gives
    for got, want in zip(unpack(received, layouts), tensors):
        if want is None:
            assert got is None
        else:
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_single_contiguous_tensor_is_sent_without_a_copy():
    t = torch.randn(4, 5)
    assert pack([t]).data_ptr() == t.data_ptr()


def test_packed_tensors_are_aligned():
    tensors = [torch.randn(3), torch.randn(1, dtype=torch.float64), torch.ones(5, dtype=torch.int16)]
    assert payload_size(layouts_of(tensors)) % ALIGN == 0
    assert pack([]) is None and pack([None]) is None


def test_messages_survive_the_metadata_round_trip():
    value = {"x": torch.randn(2, 3), "n": 4, "pair": (torch.ones(2), "text")}
    leaves, spec = _flatten(value)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    constants = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    message = Message(spec, constants, Parcel(tensors), [True, False])
    meta = Meta.decode(to_meta(message, tensors).encode())
    back = from_meta(meta, tensors)
    assert back.spec == spec and back.requires_grad == [True, False]
    assert [c is _TENSOR for c in back.constants] == [c is _TENSOR for c in constants]
    bare = Message(_flatten(torch.ones(1))[1], [_TENSOR], Parcel([torch.ones(1)]), [True])
    assert from_meta(Meta.decode(to_meta(bare, [torch.ones(1)]).encode()), []).spec is bare.spec


def test_buckets_respect_size_dtype_and_order():
    grads = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64),
             torch.zeros(100), torch.zeros(1)]
    groups = buckets(grads, limit=100)
    assert [len(b) for b in groups] == [2, 1, 1, 1]
    assert [t for b in groups for t in b] == grads


def test_flows_skip_local_neighbours_and_links_group_them_by_sender():
    # zbv on 2 ranks: rank 0 holds virtual stages 0 and 3, rank 1 holds 1 and 2.
    schedule = get_schedule("zbv", 2, 4, virtual_stages=2)
    owner = [schedule.stage_of(v)[0] for v in range(4)]
    topology = Topology(owner, rank=1, stage=1, group=None, device=torch.device("cpu"))
    found = flows(topology, [1, 2], 4, {"act": 4, "grad": 4})
    assert {(f.kind, f.virtual_stage, f.src_rank) for f in found} == {("act", 1, 0),
                                                                     ("grad", 2, 0)}
    grouped = links(found)
    assert list(grouped) == [0] and grouped[0].count == 8  # 1 -> 2 and 2 -> 1 stay local
    forward_only = flows(topology, [1, 2], 4, {"act": 4})
    assert [(f.kind, f.virtual_stage) for f in forward_only] == [("act", 1)]


def test_flows_include_skip_connections():
    plan = {1: StageSkips(1, sends=(("h", 3),), receives=(("e", 0),))}
    topology = Topology([0, 1, 2, 3], rank=1, stage=1, group=None, device=torch.device("cpu"))
    found = {(f.kind, f.src_rank, f.count) for f in
             flows(topology, [1], 4, {"act": 3, "grad": 3}, plan)}
    assert found == {("act", 0, 3), ("grad", 2, 3), ("skip/e", 0, 3), ("skipgrad/h", 3, 3)}


def test_kinds_number_skip_names_alike_on_every_rank():
    kinds, other = Kinds(["b", "a"]), Kinds(["a", "b"])
    assert kinds.names == other.names == ["act", "grad", "skip/a", "skipgrad/a", "skip/b",
                                          "skipgrad/b"]
    for key in [("act", 3), ("grad", 0), ("skip", "a", 2), ("skipgrad", "b", 5)]:
        assert kinds.key(kinds.of(key), key[-1]) == key


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_last_gradient_actions_are_the_last_b_or_w_of_each_stage(name, v):
    schedule = get_schedule(name, 2, 4, virtual_stages=v)
    last = last_gradient_actions(schedule.actions[0], schedule)
    assert sorted(last.values()) == sorted({schedule.virtual_stage_of(a)
                                            for a in schedule.actions[0]})
    for action, stage in last.items():
        later = schedule.actions[0][schedule.actions[0].index(action) + 1:]
        assert not any(schedule.virtual_stage_of(a) == stage and a.kind.value in "BW"
                       for a in later)


def test_header_carries_a_token_count():
    header = Header(1, 2, 0, 4, 8, 0, 0, 3, loss=2.5, count=17.0)
    assert Header.decode(header.encode()).count == 17.0
    assert Header.decode(Header(0, 0, 0, 1, 1, 0, 0, 0).encode()).count == -1.0  # none
