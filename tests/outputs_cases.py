"""Models that return their own loss, on every rank of a gloo group
(``dist_launch.launch(..., script='outputs_cases.py')``), and the tiny Hugging Face models and
batches ``tests/core/test_outputs.py`` shares: a causal LM (GPT-2), encoder-decoder LMs (BART, T5) and
an encoder with a classification head (BERT), each given ``labels`` padded with ``-100`` and a
batch that splits into uneven micro-batches."""
from __future__ import annotations

import copy
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import DistributedPipe, main  # noqa: E402

VOCAB, SEQ, SIZE = 50, 8, 7  # 7 samples: micro-batches of 2, 2, 2, 1 (chunks=4)
TOL = dict(rtol=1e-5, atol=1e-6)


def _transformers() -> Any:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    return transformers


def gpt2() -> nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bart() -> nn.Module:
    t = _transformers()
    return t.BartForConditionalGeneration(t.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, use_cache=False, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0))


def t5() -> nn.Module:
    t = _transformers()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
        dropout_rate=0.0))


def bert() -> nn.Module:
    t = _transformers()
    return t.BertForSequenceClassification(t.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


# name: (builder, split point, schedule, checkpoint) - a different schedule for each model
MODELS: Dict[str, Tuple[Callable[[], nn.Module], str, str, str]] = {
    "gpt2": (gpt2, "transformer.h.1", "zb-h1", "except_last"),
    "bart": (bart, "model.decoder", "1f1b", "always"),
    "t5": (t5, "decoder", "1f1b", "never"),
    "bert": (bert, "bert.encoder.layer.1", "gpipe", "except_last"),
}


def build(kind: str) -> nn.Module:
    """The model ``kind``, the same weights every call."""
    torch.manual_seed(0)
    return MODELS[kind][0]()


def batch(kind: str, size: int = SIZE) -> Dict[str, torch.Tensor]:
    """Keyword inputs with labels: token labels padded with -100 (the last sample wholly, so
    that micro-batch counts nothing), or class labels with one -100."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (size, SEQ), generator=generator)
    mask = torch.ones(size, SEQ, dtype=torch.long)
    mask[0, 5:] = 0
    if kind == "bert":
        labels = torch.randint(0, 3, (size,), generator=generator)
        labels[1] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, 3:] = -100
    labels[size - 1] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def plain_results(kind: str, inputs: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """The plain model's train-mode loss and gradients and eval-mode output on the batch."""
    model = build(kind)
    output = model(**inputs)
    output.loss.backward()
    with torch.no_grad():
        evaluated = copy.deepcopy(model).eval()(**inputs)
    return {"output": output, "grads": {n: p.grad for n, p in model.named_parameters()},
            "eval": evaluated}


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    torch.testing.assert_close(got, expected, **TOL, msg=lambda m: f"{what}: {m}")
    return (got - expected).abs().max().item()


def model_loss(kinds: List[str]) -> Dict:
    """Every rank passes the batch with its labels: ``pipe(**batch)`` and ``evaluate`` return
    the model's own output with the plain model's loss (on the last stage's rank), and
    ``train_step(batch)`` gives the plain model's loss (every rank) and gradients (each rank's
    parameters), with uneven micro-batches and -100 labels."""
    found: Dict[str, Any] = {}
    for kind in kinds:
        _, split, schedule, checkpoint = MODELS[kind]
        inputs = batch(kind)
        expected = plain_results(kind, inputs)
        pipe = DistributedPipe(build(kind), chunks=4, schedule=schedule, checkpoint=checkpoint,
                               split_points=[split], example_inputs=inputs, timeout=60)
        mine: Dict[str, float] = {}
        out = pipe(**inputs)
        if out is not None:
            assert type(out) is type(expected["output"]), type(out)
            mine["forward"] = _close(out.loss, expected["output"].loss.detach(), "forward loss")
            _close(out.logits, expected["output"].logits.detach(), "forward logits")
        evaluated = pipe.evaluate(**inputs)
        if evaluated is not None:
            mine["evaluate"] = _close(evaluated.loss, expected["eval"].loss, "evaluate loss")
        loss = pipe.train_step(inputs)
        mine["train_step"] = _close(loss, expected["output"].loss.detach(), "train_step loss")
        named = dict(pipe.named_parameters())
        assert named, "this rank holds no parameters"
        mine["grads"] = max(_close(p.grad, expected["grads"][n], f"gradient of {n}")
                            for n, p in named.items())
        found[kind] = mine
    return {"found": found}


class Tagger(nn.Module):
    """Not a Hugging Face model: returns a dict with its own token-mean loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(20, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def tagger_batch() -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 20, (5, 6), generator=generator)
    labels = torch.randint(0, 5, (5, 6), generator=generator)
    labels[0, 2:] = -100
    labels[4, 1:] = -100
    return {"ids": ids, "labels": labels}


def unknown_loss() -> Dict:
    """A loss nothing says how to combine: ``train_step`` refuses it on every rank before any
    work, ``pipe(...)`` on the last stage's rank once its outputs are in, and the pipe goes on
    (a step on a loss_fn of the caller's follows). With ``output_reduction`` the same model
    trains exactly on a V-shaped schedule (the first rank runs the last stage too)."""
    import fastpipe
    inputs = tagger_batch()
    pipe = DistributedPipe(Tagger(), chunks=3, split_points="auto", example_inputs=inputs,
                           timeout=60)
    refused = []
    try:
        pipe.train_step(inputs)
    except fastpipe.OutputReductionError as error:
        assert "'loss'" in str(error) and "output_reduction" in str(error), error
        refused.append("train_step")
    try:
        out = pipe(**inputs)
        assert out is None, "only the last stage's rank has outputs to combine"
    except fastpipe.OutputReductionError as error:
        assert "'loss'" in str(error) and "output_reduction" in str(error), error
        refused.append("forward")
    labels = inputs["labels"]
    pipe.train_step(inputs, labels, lambda out, y: nn.functional.cross_entropy(
        out["logits"].flatten(0, 1), y.flatten()))  # the pipe is still usable
    plain = Tagger()
    expected = plain(**inputs)["loss"]
    expected.backward()
    pipe = DistributedPipe(Tagger(), chunks=3, schedule="zbv", split_points="auto",
                           example_inputs=inputs, timeout=60,
                           output_reduction={"loss": "token_mean"})
    loss = pipe.train_step(inputs)
    _close(loss, expected.detach(), "train_step loss")
    grads = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        _close(p.grad, grads[name].grad, f"gradient of {name}")
    return {"refused": refused}


def both(kinds: List[str]) -> Dict:
    """``model_loss`` and ``unknown_loss`` in one launch (processes are slow to start)."""
    return {**model_loss(kinds), **unknown_loss()}


CASES = {f.__name__: f for f in (model_loss, unknown_loss, both)}

if __name__ == "__main__":
    main(CASES)
