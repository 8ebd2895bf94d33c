"""Any nn.Module as a pipeline (``split_points``): Hugging Face GPT-2 and Llama and a ResNet with
batch norms, untouched, against the plain model: losses, gradients, names, ties, modes."""
import copy
import functools

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import tracing

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

VOCAB, SEQ = 50, 8


def gpt2(dropout: float = 0.0) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16, use_cache=False,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def batch(size: int = 6, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
    mask = torch.ones(size, SEQ, dtype=torch.long)
    mask[0, SEQ - 3:] = 0  # a padded sample
    return {"input_ids": ids, "attention_mask": mask}, ids


def lm_loss(output, targets):
    return nn.functional.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def plain_step(model, inputs, targets, chunks=None):
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(**inputs), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads(model, expected, tol=dict(rtol=1e-5, atol=1e-6)):
    got = {n: p.grad for n, p in model.named_parameters()}
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **tol,
                                   msg=lambda m: f"gradient of {name}: {m}")


def test_a_gpt2_trains_untouched_with_its_names_ties_and_keyword_inputs():
    model, plain = gpt2(), gpt2()
    inputs, targets = batch()
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 2, schedule="1f1b",
                         split_points=["transformer.h.2"], example_inputs=inputs)
    expected_loss, expected = plain_step(plain, inputs, targets)
    loss = pipe.train_step(inputs, targets, lm_loss)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads(model, expected)
    # the model's own names, ties and state dict; its output type; keyword inputs
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert model.lm_head.weight is model.transformer.wte.weight
    assert pipe.state_dict().keys() == plain.state_dict().keys()
    pipe.load_state_dict(plain.state_dict())
    out = pipe(**inputs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    torch.testing.assert_close(out.logits, plain(**inputs).logits, rtol=1e-5, atol=1e-6)


def test_train_and_eval_modes_run_their_own_graphs():
    model = gpt2(dropout=0.3)
    plain = copy.deepcopy(model).eval()
    inputs, _ = batch()
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, split_points="auto",
                         example_inputs=inputs)
    expected = plain(**inputs).logits
    torch.testing.assert_close(pipe.evaluate(**inputs).logits, expected, rtol=1e-5, atol=1e-6)
    assert model.training  # evaluate() restores the mode
    with torch.no_grad():
        noisy = pipe(**inputs).logits  # train mode: dropout on
    assert not torch.allclose(noisy, expected)


@functools.lru_cache(maxsize=None)
def _split(stages: int):
    model = gpt2()
    inputs, _ = batch()
    return model, tracing.split(model, "auto", inputs, stages).stages


EVERY = [(name, v, mode) for name, v in
         [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped-bfs", 2), ("zb-h1", 1),
          ("zbv", 2), ("dualpipev", 2)]
         for mode in ["never", "except_last", "always", "selective", "offload"]]


@pytest.mark.parametrize("schedule,virtual,checkpoint", EVERY)
def test_every_schedule_and_checkpoint_mode_on_a_traced_gpt2(schedule, virtual, checkpoint):
    model, stages = _split(2 * virtual)
    plain = copy.deepcopy(model)
    inputs, targets = batch(size=7)  # micro-batches of 2, 2, 2, 1
    expected_loss, expected = plain_step(plain, inputs, targets)
    model.zero_grad(set_to_none=True)
    pipe = fastpipe.Pipe(stages, chunks=4 if virtual == 1 else 2, devices=["cpu"] * 2,
                         balance=[1] * (2 * virtual), schedule=schedule,
                         virtual_stages=virtual, checkpoint=checkpoint)
    loss = pipe.train_step(inputs, targets, lm_loss)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads(model, expected)


def test_a_padded_batch_with_a_token_mean_loss_is_exact():
    """The causal-LM loss over non-padding tokens: (loss_sum, count) from loss_fn gives the
    plain model's token mean, though micro-batches hold different numbers of tokens."""
    model, plain = gpt2(), gpt2()
    inputs, ids = batch(size=7)
    inputs["attention_mask"][3, 2:] = 0  # two padded samples in different micro-batches
    labels = ids.masked_fill(inputs["attention_mask"] == 0, -100)

    def token_sum(output, y):
        logits, y = output.logits[:, :-1], y[:, 1:]
        total = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                            ignore_index=-100, reduction="sum")
        return total, (y != -100).sum()

    total, count = token_sum(plain(**inputs), labels)
    (total / count).backward()
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule="zb-h1",
                         split_points="auto", example_inputs=inputs)
    loss = pipe.train_step(inputs, labels, token_sum)
    torch.testing.assert_close(loss, (total / count).detach(), rtol=1e-5, atol=1e-6)
    assert_grads(model, {n: p.grad for n, p in plain.named_parameters()})


def test_a_llama_with_tied_embeddings_trains_exactly():
    model, plain = llama(), llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    inputs, targets = batch()
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 3, schedule="zb-h1",
                         split_points="auto", example_inputs=inputs, checkpoint="never")
    expected_loss, expected = plain_step(plain, inputs, targets)
    loss = pipe.train_step(inputs, targets, lm_loss)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads(model, expected)
    assert len(list(pipe.parameters())) == len(list(plain.parameters()))


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.layer = nn.Sequential(*[Block(8) for _ in range(4)])
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.layer(self.stem(x)).mean((2, 3)))


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_a_resnet_with_batch_norms_matches_the_plain_model_per_micro_batch(checkpoint):
    torch.manual_seed(0)
    model = ResNet()
    plain = copy.deepcopy(model)
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 10, (6,))
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 2, split_points=["layer.2"],
                         example_inputs=x, checkpoint=checkpoint)
    loss = pipe.train_step(x, y, nn.functional.cross_entropy)
    expected = sum(nn.functional.cross_entropy(plain(xs), ys) * len(xs) / len(x)
                   for xs, ys in zip(x.chunk(3), y.chunk(3)))  # batch statistics per micro-batch
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    for (name, b), c in zip(model.named_buffers(), plain.buffers()):  # counted once, not twice
        torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(pipe.evaluate(x), plain.eval()(x), rtol=1e-5, atol=1e-6)


def test_deferred_batch_norm_is_refused_for_the_batch_norms_of_a_traced_module():
    x = torch.randn(6, 3, 8, 8)
    with pytest.raises(NotImplementedError, match="deferred_batch_norm=True does not reach"):
        fastpipe.Pipe(ResNet(), chunks=3, devices=["cpu"] * 2, split_points=["layer.2"],
                      example_inputs=x, deferred_batch_norm=True)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not traceable
            return self.a(x)
        return self.b(x)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(split_points=["transformer.h.9"]), ValueError, "not a submodule"),
    (dict(split_points=["transformer.h.3", "transformer.h.1"], devices=["cpu"] * 3), ValueError,
     "out of execution order"),
    (dict(split_points=["transformer.h.1", "transformer.h.3"]), ValueError,
     "makes 3 stages but the pipeline has 2"),
    (dict(split_points="auto", devices=["cpu"] * 8), ValueError, "needs at least 8 blocks"),
    (dict(example_inputs=None), TypeError, "come with example_inputs="),
])
def test_bad_split_arguments_are_clear_errors_before_any_work(kwargs, error, match):
    model = gpt2()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, _ = batch()
    arguments = dict(chunks=2, devices=["cpu"] * 2, split_points="auto", example_inputs=inputs)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        fastpipe.Pipe(model, **arguments)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_an_untraceable_model_names_the_module_and_what_to_do():
    with pytest.raises(tracing.TraceError, match="could not trace Branchy.*control flow"):
        fastpipe.Pipe(Branchy(), chunks=2, devices=["cpu"] * 2, split_points=["b"],
                      example_inputs=torch.randn(4, 4))


def test_moving_a_stage_moves_the_devices_its_graph_was_traced_with():
    """The graph of a model traced on the CPU creates tensors on the CPU (positions, masks);
    placed on another device, a stage creates them there (checked on the meta device)."""
    model = gpt2()
    inputs, _ = batch()
    stages = tracing.split(model, ["transformer.h.2"], inputs).stages
    code = stages[0].train_graph.code
    assert "device(type='cpu')" in code
    stages.to("meta")
    assert "device(type='cpu')" not in stages[0].train_graph.code
    out = stages({k: v.to("meta") for k, v in inputs.items()})
    assert out.logits.device.type == "meta" and out.logits.shape == (6, SEQ, VOCAB)
