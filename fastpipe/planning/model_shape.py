"""A transformer's dimensions: from a Hugging Face config (a dict or a ``config.json``), a known
name, or arguments. Dense and mixture-of-experts decoders; what the cost model needs, no more.
Pure Python.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Union

__all__ = ["KNOWN", "ModelShape", "from_hf_config", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer. ``ffn``: the MLP's inner size (default ``4 * hidden``);
    ``gated``: SwiGLU-style MLP (three matrices instead of two); ``kv_heads``: grouped-query
    attention's key/value heads (default ``heads``); ``experts`` and ``top_k``: a
    mixture-of-experts MLP in every layer (``ffn`` then each expert's size); ``tied``: the
    head reuses the embedding matrix."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: Optional[int] = None
    kv_heads: Optional[int] = None
    gated: bool = False
    experts: int = 1
    top_k: int = 1
    tied: bool = False
    name: str = "model"

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "experts", "top_k"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape({key}={value!r}): give a positive whole number")
        for key in ("ffn", "kv_heads"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"ModelShape({key}={value!r}): give a positive whole number "
                                 f"or None")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape: hidden={self.hidden} is not a multiple of "
                             f"heads={self.heads}")
        if self.top_k > self.experts:
            raise ValueError(f"ModelShape: top_k={self.top_k} exceeds experts={self.experts}")

    @property
    def inner(self) -> int:
        """The MLP's inner size (each expert's when there are several)."""
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def groups(self) -> int:
        """Key/value heads."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def attention_params(self) -> int:
        """Query, key, value and output projections of one layer."""
        h = self.hidden
        return h * (h + 2 * self.groups * self.head_dim) + h * h

    def mlp_params(self) -> int:
        """One layer's MLP: every expert, plus the router."""
        matrices = 3 if self.gated else 2
        router = self.hidden * self.experts if self.experts > 1 else 0
        return matrices * self.hidden * self.inner * self.experts + router

    def layer_params(self) -> int:
        """One transformer layer (two norms included)."""
        return self.attention_params() + self.mlp_params() + 4 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """The output projection (0 when tied to the embedding) and the final norm."""
        return (0 if self.tied else self.vocab * self.hidden) + 2 * self.hidden

    def params(self) -> int:
        """Every parameter."""
        return (self.layers * self.layer_params() + self.embedding_params()
                + self.head_params())

    def active_params(self) -> int:
        """Parameters one token passes through (``top_k`` experts of each layer)."""
        inactive = (3 if self.gated else 2) * self.hidden * self.inner * (
            self.experts - self.top_k)
        return self.params() - self.layers * inactive


_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_FFN = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size")
_EXPERTS = ("num_local_experts", "n_routed_experts", "num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "top_k")
_EXPERT_FFN = ("moe_intermediate_size",)
_GATED_ACTS = ("silu", "swiglu", "swish", "gelu_pytorch_tanh_gated", "geglu")


def _first(config: Mapping[str, Any], keys: tuple, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def from_hf_config(config: Union[Mapping[str, Any], str, "os.PathLike[str]"]) -> ModelShape:
    """The shape in a Hugging Face ``config.json`` (a path) or its dict; raises ``ValueError``
    naming a missing dimension."""
    if not isinstance(config, Mapping):
        with open(config, encoding="utf-8") as file:
            config = json.load(file)
    text = config.get("text_config")
    if isinstance(text, Mapping):  # multimodal configs nest the language model's
        config = {**config, **text}
    found = {name: _first(config, keys) for name, keys in
             (("layers", _LAYERS), ("hidden", _HIDDEN), ("heads", _HEADS))}
    found["vocab"] = config.get("vocab_size")
    missing = [name for name, value in found.items() if value is None]
    if missing:
        raise ValueError(f"the config lacks {', '.join(missing)}: give a decoder's config.json "
                         f"(num_hidden_layers, hidden_size, num_attention_heads, vocab_size) "
                         f"or the dimensions")
    experts = int(_first(config, _EXPERTS, 1) or 1)
    ffn = _first(config, _EXPERT_FFN) if experts > 1 else None
    ffn = ffn if ffn is not None else _first(config, _FFN)
    act = str(config.get("hidden_act", config.get("activation_function", ""))).lower()
    gated = act in _GATED_ACTS or config.get("model_type") in ("llama", "mistral", "mixtral",
                                                                "qwen2", "qwen3", "gemma")
    return ModelShape(
        layers=int(found["layers"]), hidden=int(found["hidden"]), heads=int(found["heads"]),
        vocab=int(found["vocab"]), ffn=None if ffn is None else int(ffn),
        kv_heads=config.get("num_key_value_heads"), gated=gated, experts=experts,
        top_k=int(_first(config, _TOP_K, 1) or 1) if experts > 1 else 1,
        tied=bool(config.get("tie_word_embeddings", False)),
        name=str(config.get("_name_or_path") or config.get("model_type") or "model"))


KNOWN: Dict[str, ModelShape] = {
    # Llama 3 (arXiv 2407.21783) Table 3: layers, model and FFN dimension, heads, KV heads,
    # SwiGLU, vocabulary 128,000
    "llama-3-8b": ModelShape(32, 4096, 32, 128000, 14336, 8, gated=True, name="llama-3-8b"),
    "llama-3-70b": ModelShape(80, 8192, 64, 128000, 28672, 8, gated=True, name="llama-3-70b"),
    "llama-3-405b": ModelShape(126, 16384, 128, 128000, 53248, 8, gated=True,
                               name="llama-3-405b"),
    # GPT-3 175B as Narayanan et al. 2021 (arXiv 2104.04473) Section 5.3.2 run it: 96 layers,
    # 96 heads, hidden 12288; vocabulary 51,200 (Section 5.1)
    "gpt3-175b": ModelShape(96, 12288, 96, 51200, name="gpt3-175b"),
}
"""Shapes known by name (each from the paper named beside it)."""


def model_shape(model: Union[ModelShape, Mapping[str, Any], str, "os.PathLike[str]"],
                **overrides: Any) -> ModelShape:
    """A :class:`ModelShape` from a shape, a config dict, a ``config.json`` path or a name in
    :data:`KNOWN`; ``overrides`` replace fields (e.g. ``layers=4``)."""
    if isinstance(model, ModelShape):
        shape = model
    elif isinstance(model, Mapping):
        shape = from_hf_config(model)
    elif isinstance(model, str) and model.lower() in KNOWN:
        shape = KNOWN[model.lower()]
    elif isinstance(model, (str, os.PathLike)) and os.path.exists(model):
        shape = from_hf_config(model)
    else:
        raise ValueError(f"model={model!r} is neither a config.json that exists nor a known "
                         f"name ({', '.join(sorted(KNOWN))}); give a path, a config dict "
                         f"or a ModelShape")
    return replace(shape, **overrides) if overrides else shape
