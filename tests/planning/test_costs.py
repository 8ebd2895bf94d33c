"""The cost model: FLOPs of F, B and W per layer, activation bytes, the split over chunks, the
per-step costs, and the linear extension of long steps."""
import math

import pytest

from fastpipe.planning.costs import Work, chunk_costs, even_balance, model_flops, split_weight
from fastpipe.planning.hardware import GPU, Link
from fastpipe.planning.layout import Layout
from fastpipe.planning.model_shape import ModelShape
from fastpipe.planning.predict import predict, schedule_for
from fastpipe.planning.runtime_model import RUNTIMES, FASTPIPE
from fastpipe.schedule.simulator import simulate

FREE = Link(math.inf, 0.0)
# one FLOP per second, memory and links free: a pass's seconds are its matrix FLOPs
COUNTER = GPU("counter", {"bf16": 1.0, "fp16": 1.0}, memory=1e30, memory_bandwidth=math.inf,
              efficiency=1.0, intra_node=FREE, inter_node=FREE)
MODEL = ModelShape(layers=4, hidden=256, heads=4, vocab=1000, name="tiny")
S, B = 128, 2
WORK = Work(MODEL, S, 16)
MATERIALISED = RUNTIMES["zero-bubble-2024"]


def layer_only(layout, rt=MATERIALISED):
    """The costs of chunks holding one layer each with the embedding and head removed: the
    middle chunks of a 4-chunk split of 4 layers."""
    return chunk_costs(WORK, layout, COUNTER, rt, 8).costs


def test_a_layers_passes_have_the_zero_bubble_papers_flops():
    """arXiv 2401.10241 Table 1: F = sbh(24h + 4s), B = sbh(24h + 8s), W = 24 sbh^2."""
    costs = layer_only(Layout(pipeline=4, schedule="zb-h1", micro_batch=B))
    sbh, h = S * B * 256, 256
    assert costs.forward[1] == pytest.approx(sbh * (24 * h + 4 * S))
    assert costs.backward[1] == pytest.approx(sbh * (24 * h + 8 * S))
    assert costs.weight[1] == pytest.approx(24 * sbh * h)


def test_causal_flash_attention_does_half_the_attention_products():
    costs = layer_only(Layout(pipeline=4, schedule="zb-h1", micro_batch=B), FASTPIPE)
    sbh, h = S * B * 256, 256
    assert costs.forward[1] == pytest.approx(sbh * (24 * h + 2 * S))


def test_tensor_parallelism_splits_the_flops():
    one = layer_only(Layout(pipeline=4, schedule="zb-h1", micro_batch=B))
    two = layer_only(Layout(pipeline=4, tensor=2, schedule="zb-h1", micro_batch=B))
    assert two.forward[1] == pytest.approx(one.forward[1] / 2)


def test_the_head_and_embedding_land_on_the_end_chunks():
    costs = layer_only(Layout(pipeline=4, schedule="zb-h1", micro_batch=B))
    head = 2 * S * B * 256 * 1000  # the vocabulary projection's forward FLOPs
    assert costs.forward[3] == pytest.approx(costs.forward[1] + head)
    assert costs.forward[0] == pytest.approx(costs.forward[1])  # a gather costs no FLOPs


def test_a_schedule_without_w_folds_it_into_b_and_fsdp_unsplits_zero_bubble():
    split = layer_only(Layout(pipeline=4, schedule="zb-h1", micro_batch=B))
    folded = layer_only(Layout(pipeline=4, schedule="1f1b", micro_batch=B))
    assert folded.weight == (0.0,) * 4
    assert folded.backward[1] == pytest.approx(split.backward[1] + split.weight[1])
    assert split_weight(Layout(pipeline=4, schedule="zb-h1"))
    assert not split_weight(Layout(pipeline=4, shard=2, schedule="zb-h1"))


def test_checkpointing_adds_the_forward_to_the_backward():
    never = layer_only(Layout(pipeline=4, schedule="1f1b", micro_batch=B))
    always = layer_only(Layout(pipeline=4, schedule="1f1b", micro_batch=B, checkpoint="always"))
    assert always.backward[1] == pytest.approx(never.backward[1] + never.forward[1])


def test_activation_bytes_per_layer_follow_korthikanti():
    """arXiv 2205.05198: s b h (10 + 24/t) + 5 a s^2 b / t bytes per layer; with sequence
    parallelism sbh (34/t); flash attention or selective recomputation drop the s^2 term."""
    sbh, a = S * B * 256, 4
    for t in (1, 2, 4):
        layout = Layout(pipeline=4, tensor=t, micro_batch=B)
        held = chunk_costs(WORK, layout, COUNTER, MATERIALISED, 8).held[1]
        assert held == pytest.approx(sbh * (10 + 24 / t) + 5 * a * S * S * B / t)
        sp = MATERIALISED.with_changes(sequence_parallel=True, flash_attention=True)
        assert chunk_costs(WORK, layout, COUNTER, sp, 8).held[1] == pytest.approx(34 * sbh / t)
        selective = layout.with_changes(checkpoint="selective")
        held = chunk_costs(WORK, selective, COUNTER, MATERIALISED, 8).held[1]
        assert held == pytest.approx(sbh * (10 + 24 / t))


def test_static_bytes_follow_the_runtime_and_the_shards():
    """Megatron's fp16 weights and gradients (2 + 2 bytes) whole, fp32 master and Adam state
    (4 + 8 bytes) split over the shard ranks."""
    rt = RUNTIMES["megatron-2021"]
    one = chunk_costs(WORK, Layout(pipeline=4), COUNTER, rt, 8)
    four = chunk_costs(WORK, Layout(pipeline=4, shard=4), COUNTER, rt, 8)
    params = MODEL.layer_params()
    assert one.static[1] == pytest.approx(params * 16)
    assert four.static[1] == pytest.approx(params * (4 + 12 / 4))


def test_links_price_reductions_transfers_and_collectives():
    gpu = COUNTER.with_changes(intra_node=Link(100.0, 0.0), inter_node=Link(10.0, 0.0))
    rt = MATERIALISED.with_changes(reduce_overlap="chunk", blocking_sends=False)
    inside = chunk_costs(WORK, Layout(pipeline=2, data=2, order="tensor,shard,data,pipeline"),
                         gpu, rt, 2).costs
    # data groups of 2 neighbours sit inside a 2-GPU node: ring all-reduce at 100 B/s
    embed_and_layers = (2 * MODEL.layer_params() + MODEL.embedding_params()) * rt.grad_bytes
    assert inside.reduction[0] == pytest.approx(embed_and_layers / 100.0)
    # consecutive stages are 2 ranks apart: across nodes, the receiver waits bytes / 10
    assert inside.p2p == pytest.approx((2 * S * 1 * 256 / 10.0,) * 2)


@pytest.mark.parametrize("layers, chunks, ends, expected", [
    (22, 8, True, (2, 3, 3, 3, 3, 3, 3, 2)),
    (30, 32, True, (0,) + (1,) * 30 + (0,)),
    (10, 4, False, (2, 3, 3, 2)),
    (8, 4, False, (2, 2, 2, 2)),
    (8, 4, True, (1, 3, 3, 1)),
])
def test_even_balance(layers, chunks, ends, expected):
    assert even_balance(layers, chunks, ends) == expected


def test_layout_strides_and_nodes():
    layout = Layout(tensor=8, pipeline=4, data=2)
    assert layout.stride("tensor") == 1 and layout.stride("data") == 8
    assert layout.stride("pipeline") == 16
    assert layout.inside_node("tensor", 8) and not layout.inside_node("data", 8)
    other = layout.with_changes(order="tensor,pipeline,shard,data")
    assert other.stride("pipeline") == 8 and other.stride("data") == 32


@pytest.mark.parametrize("name, v, m", [("1f1b", 1, 64), ("interleaved", 2, 64),
                                        ("zb-h1", 1, 40), ("zbv", 2, 48)])
def test_a_long_step_extended_linearly_equals_its_full_simulation(name, v, m):
    layout = Layout(pipeline=4, virtual=v, schedule=name, micro_batch=1)
    work = Work(MODEL, S, m)
    rt = MATERIALISED.with_changes(reduce_overlap="chunk", blocking_sends=True)
    gpu = COUNTER.with_changes(intra_node=Link(1e9, 1.0))
    predicted = predict(work, layout, gpu, rt, 8)
    assert predicted.simulated_microbatches < m
    full = simulate(schedule_for(name, 4, m, v), chunk_costs(work, layout, gpu, rt, 8).costs)
    assert predicted.step_time == pytest.approx(full.step_time, rel=1e-9)


def test_model_flops_are_six_per_parameter_and_token_plus_attention():
    work = Work(MODEL, S, 16)
    matrices = MODEL.layers * (MODEL.layer_params() - 4 * 256) + MODEL.vocab * 256
    expected = 3 * (2 * matrices + 4 * S * 256 * MODEL.layers) * 16 * S
    assert model_flops(work) == pytest.approx(expected)


def test_each_pipeline_hop_takes_the_link_between_its_stages_nodes():
    """Four stages on nodes of two GPUs: the hop between stages 1 and 2 crosses nodes, the
    others do not; a chunk's cost averages its two hops."""
    gpu = COUNTER.with_changes(intra_node=Link(100.0, 0.0), inter_node=Link(10.0, 0.0))
    rt = MATERIALISED.with_changes(blocking_sends=True)
    costs = chunk_costs(WORK, Layout(pipeline=4, micro_batch=1), gpu, rt, 2).costs
    nbytes = 2 * S * 256
    inside, across = nbytes / 100.0, nbytes / 10.0
    assert costs.send == pytest.approx((inside, (inside + across) / 2, (across + inside) / 2,
                                        inside))
    assert costs.p2p == (0.0,) * 4
