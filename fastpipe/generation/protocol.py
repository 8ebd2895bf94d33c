"""How generation calls a model: the inputs its forward takes, where its cache goes in and comes
out, and what generation cannot do with it (each a typed error naming the alternative).

Three families of models generate:

- ``'hf'``: a ``transformers`` causal language model (``GPT2LMHeadModel``,
  ``LlamaForCausalLM``, ...), called as its own ``generate`` calls it (``input_ids``,
  ``position_ids``, ``attention_mask``, its ``DynamicCache``, ``logits_to_keep=1``);
- ``'module'``: any module whose ``forward(input_ids, past_key_values=None, ...)`` returns
  ``(logits, past_key_values)`` (or an object with ``.logits`` and ``.past_key_values``), the
  cache being any pytree of tensors (``None`` on the first call); it also gets
  ``attention_mask`` and ``position_ids`` when its forward takes them;
- ``'sequential'``: an ``nn.Sequential`` mapping ``input_ids`` to logits, without a cache.

Without a cache (``use_cache=False``) every forward reads the whole sequence so far.
:class:`StepModule` is the model as one forward of generation sees it, the module that is
traced: ``(inputs, cache tensors) -> (logits, cache tensors)``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import hf

CACHE_NAMES = ("cache", "past_key_values")  # transformers 5 names it cache, earlier ones
INPUT_ORDER = ("input_ids", "position_ids", "attention_mask")


@dataclass(frozen=True, eq=False)
class Protocol:
    """How generation calls one model (see the module docstring for the families)."""

    family: str  # 'hf', 'module' or 'sequential'
    cached: bool  # whether forwards pass a cache (else each reads the whole sequence)
    cache_name: Optional[str]
    takes_mask: bool
    takes_positions: bool
    keeps_logits: bool  # takes logits_to_keep: only the last position's logits are computed
    takes_use_cache: bool
    max_positions: Optional[int]
    config: Any = None  # a transformers model's config (its cache is built from it)

    def names(self, with_mask: bool) -> Tuple[str, ...]:
        """The model inputs a forward passes, in the order of a step's ``inputs``."""
        wanted = {"input_ids": True, "position_ids": self.takes_positions,
                  "attention_mask": with_mask and self.takes_mask}
        return tuple(name for name in INPUT_ORDER if wanted[name])


def protocol_of(module: nn.Module, traced: bool, use_cache: bool) -> Protocol:
    """The protocol of ``module`` (``traced``: the pipe cut it by tracing; else it is an
    ``nn.Sequential`` of layers), checked: a typed error, before any work, for a model that
    cannot generate as asked."""
    if not traced:
        if use_cache:
            raise TypeError(
                "generate with a cache needs a model that passes one: this pipe holds an "
                "nn.Sequential of layers, which has no KV cache; pass use_cache=False (each new "
                "token recomputes the whole sequence), or build the pipe from a module whose "
                "forward takes and returns past_key_values (or a transformers causal LM) with "
                "example_inputs=...")
        return Protocol("sequential", False, None, False, False, False, False, None)
    family = "hf" if hf.is_hf(module) else "module"
    if family == "hf":
        hf.check_head(module)
        hf.check_settings(module)
    params = inspect.signature(module.forward).parameters
    cache_name = next((name for name in CACHE_NAMES if name in params), None)
    if use_cache and cache_name is None:
        raise TypeError(
            f"generate with a cache needs a model whose forward takes its cache, but "
            f"{type(module).__name__}.forward takes no {' or '.join(CACHE_NAMES)}; pass "
            f"use_cache=False (each new token recomputes the whole sequence), or give a module "
            f"whose forward(input_ids, past_key_values=None) returns (logits, past_key_values)")
    if use_cache and family == "hf":
        hf.check_cache(module.config)
    return Protocol(family, use_cache, cache_name, "attention_mask" in params,
                    "position_ids" in params, "logits_to_keep" in params, "use_cache" in params,
                    hf.max_positions(module), getattr(module, "config", None))


class StepModule(nn.Module):
    """One forward of generation, the module that is traced: ``forward(inputs, cache)`` with
    ``inputs`` the model's inputs of this forward (``Protocol.names`` order) and ``cache`` the
    cache's tensors (``None`` on the first forward): a ``transformers`` cache as the flat tuple
    of its keys and values, a module's own cache as its pytree; returns the logits and the new
    cache in the same form (an empty tuple without a cache). Traced, the cache's tensors are the
    graph's last inputs and outputs, in pytree order."""

    def __init__(self, model: nn.Module, protocol: Protocol, names: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.protocol = protocol
        self.names = tuple(names)

    def forward(self, inputs: Tuple[torch.Tensor, ...], cache: Any = None
                ) -> Tuple[torch.Tensor, Any]:
        p = self.protocol
        kwargs = dict(zip(self.names[1:], inputs[1:]))
        if p.keeps_logits:
            kwargs["logits_to_keep"] = 1
        if p.takes_use_cache:
            kwargs["use_cache"] = p.cached
        if p.family == "hf":
            kwargs["return_dict"] = True
        if p.cached:
            kwargs[p.cache_name] = self._cache_in(cache)
        output = self.model(inputs[0], **kwargs)
        logits, past = self._parts(output)
        return logits, self._cache_out(past) if p.cached else ()

    def _cache_in(self, cache: Any) -> Any:
        if self.protocol.family == "hf":
            return (hf.new_cache(self.protocol.config) if cache is None
                    else hf.cache_from(cache, self.protocol.config))
        return cache

    def _parts(self, output: Any) -> Tuple[torch.Tensor, Any]:
        if self.protocol.family == "hf":
            return hf.output_parts(output)
        if hasattr(output, "logits"):
            return output.logits, getattr(output, "past_key_values", None)
        if isinstance(output, (tuple, list)) and output:
            return output[0], (output[1] if len(output) > 1 else None)
        if isinstance(output, torch.Tensor) and not self.protocol.cached:
            return output, None
        raise TypeError(f"{type(self.model).__name__} returned {type(output).__name__}; "
                        f"generate needs (logits, past_key_values) or an object with .logits"
                        f"{' and .past_key_values' if self.protocol.cached else ''}")

    def _cache_out(self, past: Any) -> Any:
        """The cache as tensors: a transformers cache's keys and values, layer by layer; a
        module's own pytree as it is (its leaves are the tensors, in pytree order)."""
        if self.protocol.family == "hf":
            return tuple(hf.cache_leaves(past))
        if past is None:
            raise TypeError(f"{type(self.model).__name__} returned no past_key_values; a module "
                            f"that generates with a cache returns (logits, past_key_values)")
        leaves = pytree.tree_leaves(past)
        if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError(f"{type(self.model).__name__} returned past_key_values with "
                            f"non-tensor leaves ({type(past).__name__}); its cache must be a "
                            f"pytree (tuples, lists, dicts) of tensors")
        return past
