"""The Hugging Face format out of any pipe: ``fastpipe.checkpoint.save_pretrained`` from a
``Pipe`` and from every rank of a ``DistributedPipe`` (a weight tied across ranks included),
and ``hf_format.convert`` / ``python -m fastpipe hf-export`` from a ``fastpipe.checkpoint``
directory saved at any layout; ``from_pretrained`` loads each, equal to the trained weights."""
import os

import pytest

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (pip install 'fastpipe[transformers]')")

import torch  # noqa: E402

import fastpipe  # noqa: E402
from dist_launch import assert_all_ok, launch  # noqa: E402
from fastpipe.__main__ import main as cli  # noqa: E402
from fastpipe.checkpoint import hf_format  # noqa: E402
from fastpipe.checkpoint.errors import CheckpointError, IncompleteCheckpointError  # noqa: E402
from save_pretrained_cases import batch, tied_llama  # noqa: E402

SCRIPT = "integrations/save_pretrained_cases.py"


def trained_pipe():
    model = tied_llama()
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu", "cpu"], split_points="auto",
                         example_inputs=batch(0))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for step in range(2):
        optimizer.zero_grad()
        pipe.train_step(batch(step + 1), optimizer=optimizer)
    return model, pipe


def assert_loads_as(path, pipe):
    loaded = transformers.LlamaForCausalLM.from_pretrained(path)
    theirs = dict(loaded.named_parameters(remove_duplicate=False))
    for name, p in pipe.named_parameters():
        assert torch.equal(p.detach(), theirs[name]), name
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    changed = [not torch.equal(p, q) for p, q in zip(tied_llama().parameters(),
                                                      loaded.parameters())]
    assert any(changed)  # the trained weights, not the initial ones


def test_save_pretrained_of_a_pipe_loads_with_from_pretrained(tmp_path):
    _, pipe = trained_pipe()
    path = fastpipe.checkpoint.save_pretrained(tmp_path / "hf", pipe)
    assert path == str(tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(path))
    assert_loads_as(path, pipe)


def test_a_checkpoint_converts_offline_and_through_the_command_line(tmp_path, capsys):
    model, pipe = trained_pipe()
    fastpipe.checkpoint.save(tmp_path / "ckpt", pipe)
    model.config.save_pretrained(tmp_path / "config")  # names no class: the model's is given
    converted = hf_format.convert(tmp_path / "ckpt", tmp_path / "hf", tmp_path / "config",
                                  model_class=transformers.LlamaForCausalLM)
    assert_loads_as(converted, pipe)
    assert cli(["hf-export", str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--config",
                str(tmp_path / "config" / "config.json"), "--model-class",
                "LlamaForCausalLM"]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    assert_loads_as(str(tmp_path / "cli"), pipe)


def test_conversion_refuses_what_it_cannot_write(tmp_path, capsys):
    model, pipe = trained_pipe()
    fastpipe.checkpoint.save(tmp_path / "ckpt", pipe)
    (tmp_path / "half").mkdir()
    with pytest.raises(IncompleteCheckpointError):
        hf_format.convert(tmp_path / "half", tmp_path / "out", model.config)
    other = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=100, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="lacks 18 entries of LlamaForCausalLM"):
        hf_format.convert(tmp_path / "ckpt", tmp_path / "out", other,
                          model_class=transformers.LlamaForCausalLM)
    with pytest.raises(ValueError, match="model_class="):  # a config naming no class
        hf_format.convert(tmp_path / "ckpt", tmp_path / "out", model.config)
    assert cli(["hf-export", str(tmp_path / "half"), str(tmp_path / "out"), "--config",
                str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m fastpipe hf-export: error:") and error.count("\n") == 1
    with pytest.raises(TypeError, match="save_pretrained"):
        fastpipe.checkpoint.save_pretrained(tmp_path / "x", fastpipe.Pipe(
            torch.nn.Sequential(torch.nn.Linear(2, 2)), devices=["cpu"]))


@pytest.mark.parametrize("data", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_save_pretrained_of_a_distributed_pipe_gathers_every_rank(data, tmp_path):
    results = assert_all_ok(launch("save_and_load", 2 * data, limit=400, script=SCRIPT,
                                   args=dict(out=str(tmp_path), data=data)))
    assert len({tuple(r["names"]) for r in results}) == 2  # each rank held a part
    for result in results:
        assert result["worst"] == 0.0 and result["moved"] > 0 and result["tied"]
        assert "pass model=" in result["refused"]  # every rank, before any collective
    assert not (tmp_path / "unwritten").exists()
    _, pipe = trained_pipe()  # the same steps in one process: the same weights
    loaded = transformers.LlamaForCausalLM.from_pretrained(results[0]["path"])
    theirs = dict(loaded.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(theirs[name], p.detach(), rtol=1e-5, atol=1e-6)
    converted = hf_format.convert(tmp_path / "pipeline", tmp_path / "offline",
                                  results[0]["path"])  # saved on 2 ranks, converted in one
    offline = transformers.LlamaForCausalLM.from_pretrained(converted).state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(offline[name], value), name
