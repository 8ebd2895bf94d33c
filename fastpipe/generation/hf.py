"""What generation needs to know of Hugging Face models, without importing ``transformers``
unless the model is one of its own: the language-model head check, the position limit, the
generation settings the model carries, and its cache as tensors.

A ``transformers`` cache (``DynamicCache``) holds per layer the keys and values of every past
token. Generation passes it between forwards as a flat tuple of tensors (layer 0's keys, its
values, layer 1's keys, ...): each pipeline stage keeps the tensors of its own layers, and the
traced step rebuilds the cache object from them inside the graph.
"""
from __future__ import annotations

import sys
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn


def is_hf(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` model (``PreTrainedModel``)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return base is not None and isinstance(module, base)


def check_head(module: nn.Module) -> None:
    """A ``transformers`` model without a language-model head cannot generate."""
    can = getattr(module, "can_generate", None)
    if callable(can) and not can():
        raise TypeError(f"generate needs a causal language model with a language-model head, "
                        f"but {type(module).__name__} has none (it returns hidden states, not "
                        f"logits); build the model's ...ForCausalLM class (e.g. "
                        f"AutoModelForCausalLM) instead")


def max_positions(module: nn.Module) -> Optional[int]:
    """The number of positions the model has (``config.max_position_embeddings``), if known."""
    config = getattr(module, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def setting(module: nn.Module, name: str) -> Any:
    """A setting of the model's ``generation_config`` (``None`` when it has none)."""
    config = getattr(module, "generation_config", None)
    return getattr(config, name, None) if config is not None else None


# generation_config settings that change which tokens transformers' generate picks, with the
# values under which they do nothing; generation implements none of them
_UNSUPPORTED = {
    "repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "bad_words_ids": (None, []),
    "suppress_tokens": (None, []), "begin_suppress_tokens": (None, []),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "sequence_bias": (None,),
    "num_beams": (None, 1), "num_return_sequences": (None, 1), "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "min_p": (None,),
    "top_h": (None,), "renormalize_logits": (None, False),
    "exponential_decay_length_penalty": (None,), "guidance_scale": (None, 1.0),
}


def check_settings(module: nn.Module) -> None:
    """The model's ``generation_config`` asks for nothing generation does not do (a repetition
    penalty, a minimum length, beams...): its tokens would differ from ``generate``'s."""
    config = getattr(module, "generation_config", None)
    if config is None:
        return
    found = {name: getattr(config, name) for name, neutral in _UNSUPPORTED.items()
             if getattr(config, name, None) not in neutral}
    if found:
        raise NotImplementedError(
            f"the model's generation_config sets {found}, which pipe.generate does not apply "
            f"(it applies temperature, top_k, top_p and the end-of-sequence token); reset them "
            f"on model.generation_config to generate through the pipe, or use "
            f"transformers' generate on the plain model")


def new_cache(config: Any) -> Any:
    """An empty ``DynamicCache``, as ``generate`` makes one."""
    from transformers import DynamicCache
    return DynamicCache(config=config)


def check_cache(config: Any) -> None:
    """Only caches whose layers hold the keys and values of every past token (full attention)
    pass between forwards as tensors alone; sliding-window and other layers keep more state."""
    layers = getattr(new_cache(config), "layers", None)
    if layers is None:
        raise NotImplementedError(
            "generation with a cache needs transformers' Cache with per-layer objects "
            "(transformers 4.56 or newer); upgrade transformers, or pass use_cache=False")
    other = sorted({type(layer).__name__ for layer in layers} - {"DynamicLayer"})
    if other:
        raise NotImplementedError(
            f"generation with a cache keeps each layer's keys and values as tensors, but this "
            f"model's cache has {other} layers (sliding windows or other state); pass "
            f"use_cache=False (each new token recomputes the whole sequence), or give a module "
            f"that takes and returns its cache as tensors (past_key_values)")


def cache_from(leaves: Sequence[torch.Tensor], config: Any) -> Any:
    """The ``DynamicCache`` holding ``leaves`` (keys and values, layer by layer): each layer
    takes its tensors as they are (no copy), as the cache of the previous forward held them."""
    cache = new_cache(config)
    pairs = list(zip(leaves[0::2], leaves[1::2]))
    layers = cache.layers
    if len(layers) != len(pairs):
        raise ValueError(f"the cache has {len(layers)} layers but {len(pairs)} key/value pairs "
                         f"came back: were the cached tensors of every stage kept?")
    try:
        for layer, (keys, values) in zip(layers, pairs):
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
    except (AttributeError, TypeError):  # another transformers: filled by updates (a copy)
        from transformers import DynamicCache
        return DynamicCache(ddp_cache_data=pairs, config=config)
    return cache


def cache_leaves(cache: Any) -> List[torch.Tensor]:
    """The keys and values of every layer of a ``DynamicCache``, in order."""
    out: List[torch.Tensor] = []
    for layer in cache.layers:
        out += [layer.keys, layer.values]
    return out


def output_parts(output: Any) -> Tuple[torch.Tensor, Any]:
    """The logits and the cache a ``transformers`` forward returned."""
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = getattr(output, "past_key_values", None)
    return output.logits, cache
