"""How a Hugging Face model normalises the loss it returns when it is given ``labels``.

Each micro-batch's loss is a mean over something (tokens whose label is not ``-100``, the
tokens after the first of each row, samples, label entries), so the batch's loss is the
micro-batch losses weighted by those counts. What the count is depends on the code of the
model's ``forward``, so only classes whose code was read (transformers 5.x; the same semantics
in 4.4x) are known here, by exact class; any other model's loss, or a known model whose
``loss_function`` was replaced, gets no rule and ``output_reduction`` must say how it combines.

- Causal LMs computing ``self.loss_function(logits, labels, ..., **kwargs)``, that function
  being transformers' ``ForCausalLMLoss``: a mean over ``labels[..., 1:] != ignore_index``
  (``shift_labels`` when given); with ``num_items_in_batch`` given, a sum over those tokens
  divided by it, so the micro-batch losses add up.
- Mixture-of-experts causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, Jamba, Qwen3-Next,
  PhiMoE, GraniteMoE): that loss plus ``router_aux_loss_coef`` times the router's
  load-balancing loss, which the model also returns, unscaled, as ``aux_loss`` (when it
  outputs its router logits). The load-balancing loss is a statistic of the micro-batch's
  tokens, which no weighting turns into the whole batch's, so it is averaged over micro-batches
  (Megatron-core's semantics; :class:`fastpipe.outputs.WithAuxiliary`).
- A PEFT ``PeftModel`` (LoRA and the other tuners) computes its base model's loss: the base
  model's rule.
- Encoder-decoder LMs (T5, BART and their families), masked LMs and token classifiers:
  ``CrossEntropyLoss()`` over ``labels.view(-1)``: a mean over ``labels != -100``.
- Sequence classifiers: by ``config.problem_type`` (set by the model's first forward with
  labels, from ``num_labels`` and the labels' dtype): ``'single_label_classification'``,
  cross-entropy, a mean over ``labels != -100``; ``'regression'`` (``MSELoss``) and
  ``'multi_label_classification'`` (``BCEWithLogitsLoss``), means over every label entry.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from .outputs import IGNORE_INDEX, Cat, MicrobatchMean, Rule, WithAuxiliary, require

_CAUSAL = frozenset({
    "GPT2LMHeadModel", "GPTNeoForCausalLM", "GPTNeoXForCausalLM", "GPTJForCausalLM",
    "CodeGenForCausalLM", "OPTForCausalLM", "BloomForCausalLM", "FalconForCausalLM",
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "PhiForCausalLM",
    "Phi3ForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM", "StableLmForCausalLM",
    "Starcoder2ForCausalLM", "GraniteForCausalLM", "CohereForCausalLM", "SmolLM3ForCausalLM",
    "DeepseekV3ForCausalLM", "MambaForCausalLM", "Mamba2ForCausalLM",
})
# mixture-of-experts causal LMs: ForCausalLMLoss, plus ``router_aux_loss_coef`` times the
# router's load-balancing loss (returned unscaled as ``aux_loss``) when the model outputs its
# router logits (``output_router_logits``)
_MOE_CAUSAL = frozenset({
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
    "GptOssForCausalLM", "JambaForCausalLM", "Qwen3NextForCausalLM", "PhimoeForCausalLM",
    "GraniteMoeForCausalLM",
})
# the mixture-of-experts LMs that return their router logits when asked (one row per token)
_ROUTED = _MOE_CAUSAL | {"DeepseekV3ForCausalLM"}
_TOKENS = frozenset({
    # encoder-decoder LMs: decoder inputs are the labels shifted right, the loss is not shifted
    "T5ForConditionalGeneration", "MT5ForConditionalGeneration",
    "UMT5ForConditionalGeneration", "BartForConditionalGeneration",
    "MBartForConditionalGeneration", "PLBartForConditionalGeneration",
    "PegasusForConditionalGeneration", "MarianMTModel", "BlenderbotForConditionalGeneration",
    "BlenderbotSmallForConditionalGeneration", "LEDForConditionalGeneration",
    # masked LMs and token classifiers
    "BertForMaskedLM", "RobertaForMaskedLM", "XLMRobertaForMaskedLM", "DistilBertForMaskedLM",
    "AlbertForMaskedLM", "ElectraForMaskedLM", "BertForTokenClassification",
    "RobertaForTokenClassification", "XLMRobertaForTokenClassification",
    "DistilBertForTokenClassification", "AlbertForTokenClassification",
    "ElectraForTokenClassification", "DebertaV2ForTokenClassification",
})
_CLASSIFIERS = frozenset({
    "BertForSequenceClassification", "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification", "DistilBertForSequenceClassification",
    "AlbertForSequenceClassification", "ElectraForSequenceClassification",
    "ModernBertForSequenceClassification", "GPT2ForSequenceClassification",
})
_NUM_ITEMS = "num_items_in_batch"


class CausalLoss(Rule):
    """transformers' ``ForCausalLMLoss``: a mean over the labels after the first of each row
    that are not ``ignore_index`` (or over ``shift_labels``), or, given ``num_items_in_batch``,
    the sum over them divided by it."""

    label = "a causal LM's loss (ForCausalLMLoss)"
    reads = ("labels", "shift_labels", "ignore_index", _NUM_ITEMS)

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        if inputs.get(_NUM_ITEMS) is not None:
            return 1.0, False
        ignore = inputs.get("ignore_index", IGNORE_INDEX)
        if inputs.get("shift_labels") is not None:
            return float((inputs["shift_labels"] != ignore).sum()), True
        labels = require(inputs, "labels", self)
        return float((labels[..., 1:] != ignore).sum()), True


class LabelMean(Rule):
    """``CrossEntropyLoss()`` over ``labels.view(-1)``: a mean over ``labels != -100``."""

    label = "the model's loss (cross-entropy over its labels)"
    reads = ("labels",)

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        return float((require(inputs, "labels", self) != IGNORE_INDEX).sum()), True


class ClassifierLoss(Rule):
    """A sequence classifier's loss, by ``config.problem_type`` (inferred as the model infers
    it when unset): cross-entropy over ``labels != -100``, or a mean over every label entry
    (MSE, binary cross-entropy)."""

    label = "a sequence classifier's loss"
    reads = ("labels",)

    def __init__(self, config: Any) -> None:
        self.config = config

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        labels = require(inputs, "labels", self)
        kind = self.config.problem_type
        if kind is None:
            kind = ("regression" if self.config.num_labels == 1 else
                    "single_label_classification" if labels.dtype in (torch.long, torch.int)
                    else "multi_label_classification")
        if kind == "single_label_classification":
            return float((labels != IGNORE_INDEX).sum()), True
        return float(labels.numel()), True


def known_rules(module: Any) -> Dict[str, Rule]:
    """The rule of the ``loss`` a Hugging Face model returns, for the classes known here
    (``{}`` for any other module); for a mixture-of-experts LM also those of its
    load-balancing loss (averaged over micro-batches) and of its router logits (a row per
    token: concatenated)."""
    rule = _loss_rule(module)
    if rule is None:
        return {}
    rules: Dict[str, Rule] = {"loss": rule}
    if isinstance(rule, WithAuxiliary):
        rules[rule.auxiliary] = MicrobatchMean()
    if type(_adapted(module) or module).__name__ in _ROUTED:
        rules["router_logits"] = Cat()  # one row per token of the micro-batch, in order
    return rules


def _loss_rule(module: Any) -> Optional[Rule]:
    base = _adapted(module)
    if base is not None:
        return _loss_rule(base)
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None
    name = cls.__name__
    if name in _CAUSAL:
        return CausalLoss() if _default_loss(module, "ForCausalLM") else None
    if name in _MOE_CAUSAL:
        coefficient = getattr(module, "router_aux_loss_coef", None)
        if not _default_loss(module, "ForCausalLM") or not isinstance(coefficient, (int, float)):
            return None
        return WithAuxiliary(CausalLoss(), "aux_loss", coefficient)
    if name in _TOKENS:
        return LabelMean()
    if name in _CLASSIFIERS:
        return ClassifierLoss(module.config)
    generic = _generic_classifier(cls)
    if generic is not None and _default_loss(module, generic):
        return ClassifierLoss(module.config) if generic == "ForSequenceClassification" \
            else LabelMean()
    return None


def _adapted(module: Any) -> Optional[Any]:
    """The model a PEFT ``PeftModel`` adapts, when its adapter leaves the loss to that model
    (LoRA and the other tuners: the model's own ``forward`` on the batch as given); ``None``
    for any other module, and for prompt learning (virtual tokens prepended to the inputs and
    their labels change what the loss is a mean over)."""
    if not type(module).__module__.startswith("peft."):
        return None
    try:
        prompt = module.active_peft_config.is_prompt_learning
        return None if prompt else module.get_base_model()
    except AttributeError:  # not a PeftModel (a tuner layer, another PEFT class)
        return None


def _default_loss(module: Any, loss_type: str) -> bool:
    """Whether ``module.loss_function`` is transformers' own function for ``loss_type``, not
    one the user set: read as the property reads it (a ``loss_type`` it does not know means
    ``'ForCausalLM'``), without calling it (it logs a warning for such a ``loss_type``)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:  # pragma: no cover - a transformers without the loss registry
        return False
    if "_loss_function" in vars(module):
        return False
    found = getattr(module, "loss_type", None)
    return (found if found in LOSS_MAPPING else "ForCausalLM") == loss_type


def _generic_classifier(cls: type) -> Optional[str]:
    """``'ForSequenceClassification'`` / ``'ForTokenClassification'`` for a class that runs
    transformers' generic classifier forward (Llama, Mistral, Qwen2, Gemma...), whose loss is
    ``self.loss_function``'s; else ``None``."""
    try:
        from transformers import modeling_layers as layers
    except ImportError:  # pragma: no cover - an older transformers
        return None
    for loss_type in ("ForSequenceClassification", "ForTokenClassification"):
        generic = getattr(layers, f"Generic{loss_type}", None)
        if generic is not None and getattr(cls, "forward", None) is generic.forward:
            return loss_type
    return None
