"""PEFT adapters through the traced split, in one process: a LoRA Llama (a ``PeftModel``, as
``peft.get_peft_model`` returns it) goes into ``fastpipe.Pipe`` untouched and trains exactly as
the plain PeftModel does (gradient accumulation, clipping, AdamW, a learning-rate schedule) on
every schedule; its frozen base weights get no gradient and no optimizer state; its adapter,
written after pipelined training, loads with ``PeftModel.from_pretrained``."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("peft", reason="needs PEFT (pip install 'fastpipe[peft]')")
pytest.importorskip("transformers", reason="needs transformers (the Llama)")

import fastpipe  # noqa: E402
from fastpipe import tracing  # noqa: E402

import peft_models as models  # noqa: E402  (pytest puts this folder on the path)

TOL = dict(rtol=1e-5, atol=1e-5)
@pytest.fixture(scope="module")
def plain():
    """The plain PeftModel after the loop, and its losses."""
    model = models.lora_llama()
    losses = models.plain_run(model, models.STEPS, models.ACCUMULATE, models.MAX_NORM)
    return model, losses


@pytest.mark.parametrize("schedule, virtual, split", [
    ("1f1b", 1, [models.SPLIT]),
    ("zb-h1", 1, ["base_model.model.model.layers.1"]),
    ("interleaved", 2, "auto"),
    ("zbv", 2, "auto"),
])
def test_a_lora_llama_trains_through_the_pipe_as_the_plain_peft_model(plain, schedule, virtual,
                                                                      split):
    expected, expected_losses = plain
    model = models.lora_llama()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    pipe = fastpipe.Pipe(model, chunks=3 if virtual == 1 else 2, devices=["cpu"] * 2,
                         schedule=schedule, virtual_stages=virtual, split_points=split,
                         example_inputs=models.batch(0))
    losses = models.pipe_run(pipe, models.STEPS, models.ACCUMULATE, models.MAX_NORM)
    assert pipe.last_step.grad_norm > models.MAX_NORM  # the clip acted
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), **TOL)
    reference = dict(expected.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, reference[name], **TOL, msg=lambda m: f"{name}: {m}")
        if name in frozen:
            assert p.grad is None, f"the frozen {name} got a gradient"
            assert torch.equal(p, frozen[name]), f"the frozen {name} changed"
    assert len(frozen) > len(models.adapter_state(model)) > 0


def test_the_optimizer_keeps_state_for_the_adapters_only():
    model = models.lora_llama()
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 2, split_points=[models.SPLIT],
                         example_inputs=models.batch(0))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.train_step(models.batch(1), optimizer=optimizer, max_grad_norm=1.0)
    with_state = {id(p) for p in optimizer.state}
    names = {n for n, p in model.named_parameters() if id(p) in with_state}
    assert names == set(models.adapter_state(model))
    assert all("lora_" in n for n in names)


def test_evaluate_equals_the_plain_peft_model_in_eval_mode(plain):
    expected, _ = plain
    model = models.lora_llama()
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 2, split_points=[models.SPLIT],
                         example_inputs=models.batch(0))
    pipe.load_state_dict(expected.state_dict())
    inputs = models.batch(7, size=5)
    got = pipe.evaluate(**inputs)
    with torch.no_grad():
        want = expected.eval()(**inputs)
    expected.train()
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    torch.testing.assert_close(got.logits, want.logits, **TOL)


def test_the_adapter_written_after_pipelined_training_loads_with_from_pretrained(plain,
                                                                                  tmp_path):
    import peft
    expected, _ = plain
    model = models.lora_llama()
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 2, split_points=[models.SPLIT],
                         example_inputs=models.batch(0))
    models.pipe_run(pipe, models.STEPS, models.ACCUMULATE, models.MAX_NORM)
    fastpipe.checkpoint.save_pretrained(tmp_path, pipe, model)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "adapter_config.json",
                                            "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(models.lora_llama().get_base_model(), tmp_path)
    trained = models.adapter_state(expected)
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(trained)
    for name, value in trained.items():
        torch.testing.assert_close(got[name], value, **TOL, msg=lambda m: f"{name}: {m}")


class Extras(nn.Module):
    """A model whose forward takes some inputs through ``**kwargs`` (as a PeftModel's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x)) * extra["scale"]
        return x + extra["shift"]


def test_inputs_a_forward_takes_through_kwargs_are_traced_and_the_module_left_as_it_was():
    model = Extras()
    forward = model.forward
    inputs = {"x": torch.randn(6, 4), "scale": torch.rand(6, 1), "shift": torch.randn(6, 4)}
    stages = tracing.split(model, ["blocks.1"], inputs).stages
    assert "forward" not in vars(model) and model.forward == forward
    torch.testing.assert_close(stages(inputs), model(**inputs))
    other = {k: v[:4] for k, v in inputs.items()}  # another batch size
    torch.testing.assert_close(stages(other), model(**other))
