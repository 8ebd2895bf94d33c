"""Generation through the pipeline with a KV cache (``pipe.generate``): the decode schedule in
the IR and its validation; greedy decoding equal to ``transformers``' ``generate`` token for
token (GPT-2 and Llama, padded prompts, any number of groups in flight), sampling equal to its
draws under the same seed, end-of-sequence tokens, a module passing its own cache, generation
without a cache; every bad input a typed error before any work; ``DistributedPipe`` on 2 gloo
ranks (``generation_cases.py``)."""
import pytest
import torch
from torch import nn

import fastpipe
from dist_launch import assert_all_ok, launch
from fastpipe.generation import api as generation_api
from fastpipe.schedule import ScheduleError, lower
from fastpipe.schedule.decode import decode, unrolled_placement, validate_decode
from generation_cases import MODELS, VOCAB, greedy_reference, prompts

pytest.importorskip("transformers")


# ------------------------------------------------------------------------------ the schedule
def test_the_decode_schedule_unrolls_iterations_onto_the_stages_placement():
    schedule = decode(2, 3, 4)
    assert schedule.placement == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert schedule.to_strings()[0][:4] == ["0F0", "0F1", "0F2", "0F0.1"]
    assert all(a.kind is fastpipe.ActionKind.FORWARD for row in schedule.actions for a in row)
    assert unrolled_placement(((0, 2), (1, 3)), 2) == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_the_token_edge_is_an_activation_from_the_last_stage_to_the_first():
    program = " ".join(str(op) for op in lower(decode(2, 1, 2))[0])
    assert "recv act0 v2<-1" in program  # iteration 1's first stage takes the token


@pytest.mark.parametrize("comm", ["buffered", "rendezvous", "nccl"])
@pytest.mark.parametrize("placement", [None, ((0, 2), (1, 3))])
def test_decode_schedules_are_deadlock_free_under_every_model(comm, placement):
    report = validate_decode(decode(2, 3, 5, placement), comm=comm)
    assert report.num_steps > 0


def test_validation_names_what_is_wrong_with_a_decode_schedule():
    good = decode(2, 2, 2)
    with pytest.raises(ScheduleError, match="not a forward"):
        validate_decode(fastpipe.Schedule.from_strings(
            "decode", ["0F0 0B0", "1F0 1B0"], num_chunks=1))
    with pytest.raises(ScheduleError, match="has no forward"):
        rows = [list(good.to_strings()[0][:-1]), good.to_strings()[1]]
        validate_decode(fastpipe.Schedule.from_strings(
            "decode", rows, 2, num_chunks=2, placement=good.placement))
    # stage 0 waits for group 1's token before it sends group 0's activation: a deadlock
    swapped = ["0F1 0F0.1 0F0 0F1.1", "1F0 1F1 1F0.1 1F1.1"]
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate_decode(fastpipe.Schedule.from_strings(
            "decode", swapped, 2, num_chunks=2, placement=good.placement))


# ------------------------------------------------------------------------------ Pipe
def _pipe(kind, **kwargs):
    build, points = MODELS[kind]
    ids, _ = prompts()
    example = ids if kind == "cached" else {"input_ids": ids}
    return build(), fastpipe.Pipe(build(), chunks=2, devices=["cpu", "cpu"], split_points=points,
                                  example_inputs=example, **kwargs)


@pytest.fixture(scope="module")
def gpt2():
    return _pipe("gpt2")


@pytest.fixture(scope="module")
def llama():
    return _pipe("llama")


def _hf(model, ids, mask, new, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, use_cache=True,
                          **kwargs)


@pytest.mark.parametrize("chunks", [None, 1, 4])
@pytest.mark.parametrize("padded", [True, False])
def test_greedy_generation_equals_transformers_generate_gpt2(gpt2, chunks, padded):
    model, pipe = gpt2
    ids, mask = prompts()
    mask = mask if padded else None
    expected = _hf(model, ids, mask, 6, do_sample=False)
    assert torch.equal(pipe.generate(ids, 6, attention_mask=mask, chunks=chunks), expected)


def test_greedy_generation_equals_transformers_generate_llama(llama):
    model, pipe = llama
    ids, mask = prompts()
    expected = _hf(model, ids, mask, 6, do_sample=False)
    assert torch.equal(pipe.generate(ids, 6, attention_mask=mask), expected)
    assert torch.equal(pipe.generate(ids[1:2], 3), _hf(model, ids[1:2], None, 3,
                                                        do_sample=False))


def test_prompts_of_one_token_and_batches_of_one(gpt2):
    model, pipe = gpt2
    ids = prompts()[0][:1, :1]
    assert torch.equal(pipe.generate(ids, 4), _hf(model, ids, None, 4, do_sample=False))


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7, "top_k": 10, "top_p": 0.8}])
def test_sampling_from_a_seed_equals_transformers_under_the_same_seed(gpt2, settings):
    model, pipe = gpt2
    ids, mask = prompts()
    torch.manual_seed(11)
    expected = _hf(model, ids, mask, 6, do_sample=True, **settings)  # generate's top_k=50
    out = pipe.generate(ids, 6, attention_mask=mask, do_sample=True, seed=11, **settings)
    assert torch.equal(out, expected)
    assert torch.equal(pipe.generate(ids, 6, attention_mask=mask, do_sample=True, seed=11,
                                     chunks=4, **settings), expected)


def test_end_of_sequence_tokens_stop_and_pad_as_transformers_does(gpt2):
    model, pipe = gpt2
    ids, mask = prompts()
    free = _hf(model, ids, mask, 6, do_sample=False)
    eos = int(free[0, ids.shape[1] + 1])  # sequence 0 stops at its second token at the latest
    expected = _hf(model, ids, mask, 6, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = pipe.generate(ids, 6, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, expected)
    finished = (out[:, ids.shape[1]:] == eos).any(dim=1)
    assert bool(finished[0]) and (out.shape[1] < free.shape[1] or bool((out == 0).any()))


def test_generation_without_a_cache_equals_transformers_without_one(gpt2):
    model, pipe = gpt2
    ids, mask = prompts()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                              use_cache=False)
    assert torch.equal(pipe.generate(ids, 4, attention_mask=mask, use_cache=False), expected)


def test_a_module_passing_its_own_cache():
    model, pipe = _pipe("cached")
    ids, _ = prompts()
    expected = greedy_reference(model, ids, 5)
    assert torch.equal(pipe.generate(ids, 5), expected)
    assert torch.equal(pipe.generate(ids, 5, chunks=4), expected)
    assert torch.equal(pipe.generate(ids, 5, use_cache=False), expected)


def test_a_sequential_generates_without_a_cache_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, VOCAB)).eval()
    pipe = fastpipe.Pipe(model, chunks=2, balance=[2, 2], devices=["cpu", "cpu"])
    ids, mask = prompts()
    with pytest.raises(TypeError, match="use_cache=False"):
        pipe.generate(ids, 3)
    out, expected = pipe.generate(ids, 3, use_cache=False), ids
    with torch.no_grad():
        for _ in range(3):
            expected = torch.cat([expected, model(expected)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="input_ids only"):
        pipe.generate(ids, 3, attention_mask=mask, use_cache=False)


def test_a_failing_forward_is_located_and_the_pipe_generates_after_it(gpt2):
    model, pipe = gpt2
    ids, _ = prompts()
    bad = ids.clone()
    bad[3, 2] = VOCAB + 5  # outside the vocabulary: the embedding of group 1 fails
    with pytest.raises(IndexError) as failure:
        pipe.generate(bad, 3)
    assert failure.value.pipeline_location == {"rank": None, "stage": 0, "action": "0F1",
                                               "microbatch": 1}
    assert torch.equal(pipe.generate(ids, 3), _hf(model, ids, None, 3, do_sample=False))


def test_virtual_stages_generate_on_their_placement():
    build, _ = MODELS["gpt2"]
    ids, mask = prompts()
    model = build()
    pipe = fastpipe.Pipe(build(), chunks=2, devices=["cpu", "cpu"], virtual_stages=2,
                         schedule="interleaved", split_points="auto",
                         example_inputs={"input_ids": ids})
    expected = _hf(model, ids, mask, 4, do_sample=False)
    assert torch.equal(pipe.generate(ids, 4, attention_mask=mask), expected)


# ------------------------------------------------------------------------------ bad inputs
@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if generation starts any work (tracing or running the schedule)."""
    def refuse(*args, **kwargs):
        raise AssertionError("generate started work before refusing its arguments")
    monkeypatch.setattr(generation_api, "traced_model", refuse)
    monkeypatch.setattr(generation_api, "run_schedule", refuse)


def test_a_model_without_a_language_model_head_is_refused(no_work):
    import transformers
    ids, _ = prompts()
    base = transformers.GPT2Model(transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, use_cache=False))
    pipe = fastpipe.Pipe(base, devices=["cpu", "cpu"], split_points=["h.1"],
                         example_inputs={"input_ids": ids})
    with pytest.raises(TypeError, match="language-model head.*ForCausalLM"):
        pipe.generate(ids, 3)


@pytest.mark.parametrize("arguments, error, match", [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
    ({"max_new_tokens": -2}, ValueError, "max_new_tokens must be >= 1"),
    ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens must be an int"),
    ({"input_ids": torch.zeros(2, 3)}, TypeError, "int64 token ids"),
    ({"input_ids": torch.zeros(3, dtype=torch.long)}, TypeError, "batch, length"),
    ({"attention_mask": torch.ones(4, 5)}, ValueError, "input_ids' shape"),
    ({"input_ids": torch.zeros(1, 40, dtype=torch.long)}, ValueError, "32 positions"),
    ({"max_new_tokens": 30}, ValueError, "lower max_new_tokens to at most 26"),
    ({"temperature": 0.0, "do_sample": True}, ValueError, "temperature"),
    ({"top_p": 1.5, "do_sample": True}, ValueError, "top_p"),
    ({"chunks": 0}, ValueError, "chunks must be >= 1"),
])
def test_bad_arguments_raise_before_any_work(gpt2, no_work, arguments, error, match):
    _, pipe = gpt2
    ids, _ = prompts()
    call = {"input_ids": ids, "max_new_tokens": 3, **arguments}
    with pytest.raises(error, match=match):
        pipe.generate(call.pop("input_ids"), call.pop("max_new_tokens"), **call)


def test_generation_settings_it_does_not_apply_are_refused(gpt2, no_work):
    _, pipe = gpt2
    pipe.module.generation_config.repetition_penalty = 1.3
    try:
        with pytest.raises(NotImplementedError, match="repetition_penalty"):
            pipe.generate(prompts()[0], 3)
    finally:
        pipe.module.generation_config.repetition_penalty = 1.0


def test_a_module_without_a_cache_argument_names_the_alternatives(no_work):
    class NoCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

        def forward(self, input_ids):
            return self.head(self.embed(input_ids))

    ids, _ = prompts()
    pipe = fastpipe.Pipe(NoCache(), devices=["cpu", "cpu"], split_points=["head"],
                         example_inputs=ids)
    with pytest.raises(TypeError, match="use_cache=False.*past_key_values"):
        pipe.generate(ids, 3)


# ------------------------------------------------------------------------------ DistributedPipe
@pytest.fixture(scope="module")
def distributed():
    """Every rank's results of the ``suite`` case (one launch for the tests below)."""
    return assert_all_ok(launch("suite", 2, limit=300, script="generation_cases.py"))


@pytest.mark.parametrize("kind", list(MODELS))
def test_distributed_greedy_generation_equals_the_plain_model(distributed, kind):
    results = [r[kind] for r in distributed]
    assert all(r["equal"] and r["again"] for r in results)
    assert results[0]["tokens"] == results[1]["tokens"]  # every rank returns the sequences


def test_a_prompt_refused_on_the_first_rank_raises_on_every_rank(distributed):
    first, other = (r["refused"] for r in distributed)
    assert first["errors"][0].startswith("TypeError") and "int64" in first["errors"][0]
    assert "refused the prompt" in other["errors"][0]
    assert all("positions" in r["errors"][1] for r in (first, other))
    assert first["then"] == other["then"] == [4, 9]  # the pipe still generates


def test_ranks_asking_for_different_generations_all_refuse(distributed):
    for rank, result in enumerate(distributed):
        assert f"rank(s) [{1 - rank}]" in result["mismatched"]["error"]
        assert result["mismatched"]["then"] == [4, 9]


@pytest.mark.slow
def test_a_failing_forward_on_one_rank_stops_every_rank():
    first, other = assert_all_ok(launch("failing", 2, limit=240, script="generation_cases.py"))
    assert first["type"] == "IndexError" and first["location"]["rank"] == 0
    assert other["type"] in ("PipelineAborted", "PeerLost") and "rank 0" in other["message"]


@pytest.mark.slow
@pytest.mark.parametrize("case, args, p2p", [
    ("greedy", {"kind": "llama", "padded": False, "chunks": 1}, "auto"),
    ("greedy", {"kind": "gpt2", "padded": False, "chunks": 4}, "grouped"),
    ("greedy", {"kind": "gpt2", "eos": True}, "auto"),
    ("sampled", {"kind": "gpt2"}, "auto"),
    ("meta_model", {}, "auto"),
])
def test_distributed_generation_more(case, args, p2p):
    results = assert_all_ok(launch(case, 2, limit=300, args=args, p2p=p2p,
                                   script="generation_cases.py"))
    assert all(r["equal"] for r in results)


@pytest.mark.cuda
def test_greedy_generation_on_a_gpu_equals_transformers():
    build, points = MODELS["gpt2"]
    ids, mask = prompts()
    model = build().cuda()
    pipe = fastpipe.Pipe(build(), chunks=2, devices=["cuda:0", "cuda:0"], split_points=points,
                         example_inputs={"input_ids": ids})
    expected = _hf(model, ids.cuda(), mask.cuda(), 6, do_sample=False)
    assert torch.equal(pipe.generate(ids.cuda(), 6, attention_mask=mask.cuda()), expected)
