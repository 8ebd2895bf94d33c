"""The pure parts of the distributed transport: wire format, buckets, channels, last actions."""
from __future__ import annotations

import math

import pytest
import torch

from collections import Counter

from fastpipe.runtime.rank_executor import last_gradient_actions
from fastpipe.runtime.gradients.data_parallel import buckets
from fastpipe.runtime.lowering import lowering, skip_links
from fastpipe.runtime.transport.message import TENSOR as _TENSOR, Message, flatten as _flatten
from fastpipe.runtime.transport.p2p import Channels, from_meta, to_meta
from fastpipe.runtime.transport.device_copy import Parcel
from fastpipe.runtime.transport.wire import (ALIGN, HEADER_LEN, Header, Meta, layouts_of, pack,
    payload_size, unpack)
from fastpipe.schedule import CommKind, get_schedule
from fastpipe.skip.layout import StageSkips


def test_header_round_trips_and_rejects_garbage():
    header = Header(1, 3, 2, 8, 61, 120, 4096, 17, loss=0.123456789)
    assert Header.decode(header.encode()) == header
    assert Header.decode(Header(0, 0, 0, 1, 1, 0, 0, 0).encode()).loss is None  # no loss


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_loss_is_a_loss_not_a_missing_one(value):
    decoded = Header.decode(Header(1, 0, 0, 2, 4, 0, 0, 1, loss=value).encode())
    assert decoded.loss is not None
    assert (math.isnan(decoded.loss) if math.isnan(value) else decoded.loss == value)
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
    [torch.ones(2, 1).expand(2, 5)],  # one tensor, overlapping (stride 0)
    [torch.randn(3, 4)[:, ::2], torch.empty(0, 3), torch.randn(2, 3, dtype=torch.float64).t()],
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


def test_a_single_strided_tensor_is_packed_to_its_exact_size():
    t = torch.randn(5, 3).t()
    payload = pack([t])
    assert payload.numel() == payload_size(layouts_of([t])) == t.numel() * 4
    assert payload.data_ptr() != t.data_ptr()


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
    meta = Meta.decode(to_meta(message, tensors).encode(), 1)
    back = from_meta(meta, tensors)
    assert back.spec == spec and back.requires_grad == [True, False]
    assert [c is _TENSOR for c in back.constants] == [c is _TENSOR for c in constants]
    bare = Message(_flatten(torch.ones(1))[1], [_TENSOR], Parcel([torch.ones(1)]), [True])
    assert from_meta(Meta.decode(to_meta(bare, [torch.ones(1)]).encode(), 1), []).spec is bare.spec


def test_buckets_respect_size_dtype_and_order():
    grads = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64),
             torch.zeros(100), torch.zeros(1)]
    groups = buckets(grads, limit=100)
    assert [len(b) for b in groups] == [2, 1, 1, 1]
    assert [t for b in groups for t in b] == grads


def test_lowering_counts_what_each_peer_sends_and_keeps_local_neighbours_local():
    # zbv on 2 ranks: stage 0 holds virtual stages 0 and 3, stage 1 holds 1 and 2.
    schedule = get_schedule("zbv", 2, 4, virtual_stages=2)
    owner = [schedule.stage_of(v)[0] for v in range(4)]
    train = lowering(schedule, schedule.actions, ())
    sources = train.sources(1)
    assert Counter(owner[v] for v in sources) == {0: 8, 1: 8}  # 1 -> 2 and 2 -> 1 stay local
    routes = [route for _, route in train.rows[1]]
    assert {(r.virtual_stage, r.input.what.value, r.input.peer) for r in routes
            if r.input is not None and r.input.peer == 0} == {(1, "act", 0), (2, "grad", 0)}
    forward = lowering(schedule, schedule.forward_actions, ())
    assert [owner[v] for v in forward.sources(1)] == [0, 1] * 4  # act into 1 from 0, 2 from 1


def test_lowering_includes_skip_connections():
    plan = StageSkips(1, sends=(("h", 3),), receives=(("e", 0),))
    links = skip_links([plan])
    assert [(s.name, s.src, s.dst) for s in links] == [("e", 0, 1), ("h", 1, 3)]
    schedule = get_schedule("1f1b", 4, 3)
    lowered = lowering(schedule, schedule.actions, links)
    found = Counter((route.virtual_stage, src, key.what.value, key.skip and key.skip.name)
                    for _, route in lowered.rows[1]
                    for key, src in zip(route.waits, route.sources))
    assert found == {(1, 0, "act", None): 3, (1, 2, "grad", None): 3, (1, 0, "act", "e"): 3,
                     (1, 3, "grad", "h"): 3}


def test_channels_number_skip_connections_alike_on_every_rank():
    plans = [StageSkips(0, sends=(("b", 2), ("a", 1))), StageSkips(1, receives=(("a", 0),)),
             StageSkips(2, receives=(("b", 0),))]
    channels, other = Channels(skip_links(plans)), Channels(skip_links(reversed(plans)))
    names = ["act", "grad", "skip/a", "skipgrad/a", "skip/b", "skipgrad/b"]
    assert [channels.name(i) for i in range(len(channels))] == names
    assert channels.channels == other.channels
    schedule = get_schedule("1f1b", 3, 2)
    lowered = lowering(schedule, schedule.actions, skip_links(plans))
    keys = [op for program in lowered.programs for group in program if hasattr(group, "ops")
            for op in group.ops if op.kind is CommKind.RECV]
    assert len(keys) == 2 * (2 * 2 + 2 * 2)  # act, grad between 3 stages; a, b and their grads
    for key in keys:
        assert channels.key(channels.index(key), key.peer, key.microbatch,
                            key.virtual_stage) == key


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
