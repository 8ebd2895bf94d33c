"""``generate``'s arguments, checked before any work: a typed error naming the argument and the
fix. :func:`check_request` checks what every rank of a ``DistributedPipe`` is given alike;
:func:`check_prompt` the prompt, read where the first stage runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Request:
    """How to generate: checked, with the model's own settings filled in (see ``resolve``)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: Optional[int]
    top_p: float
    seed: Optional[int]
    eos: Tuple[int, ...]
    pad: Optional[int]
    chunks: Optional[int]
    use_cache: bool


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _tokens(value: Any, name: str) -> Tuple[int, ...]:
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        _int(item, name, 0)
    return tuple(items)


def check_request(max_new_tokens: Any, *, do_sample: Any, temperature: Any, top_k: Any,
                  top_p: Any, seed: Any, eos_token_id: Any, pad_token_id: Any, chunks: Any,
                  use_cache: Any) -> Request:
    """The arguments of ``generate`` but the prompt, checked (``temperature``, ``top_k`` and
    ``top_p`` as given or resolved already)."""
    _int(max_new_tokens, "max_new_tokens", 1)
    _flag(do_sample, "do_sample")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if top_k is not None:
        _int(top_k, "top_k", 0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if seed is not None:
        _int(seed, "seed", 0)
    eos = _tokens(eos_token_id, "eos_token_id")
    pad = None if pad_token_id is None else _int(pad_token_id, "pad_token_id", 0)
    if chunks is not None:
        _int(chunks, "chunks", 1)
    _flag(use_cache, "use_cache")
    if pad is None and eos:
        pad = eos[0]  # as transformers' generate pads finished sequences
    return Request(max_new_tokens, do_sample, float(temperature), top_k or None, float(top_p),
                   seed, eos, pad, chunks, use_cache)


def check_prompt(input_ids: Any, attention_mask: Any) -> Tuple[torch.Tensor,
                                                               Optional[torch.Tensor]]:
    """``input_ids``: a (batch, length) integer tensor; ``attention_mask``: ``None`` or 0s and
    1s of the same shape (left padding, as ``transformers``' decoder-only generation takes)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a (batch, length) tensor of token ids, got "
                        f"{type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be a (batch, length) tensor of int64 token ids, got "
                        f"shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); give at least one "
                         f"sequence of at least one token")
    if attention_mask is None:
        return input_ids.long(), None
    if not isinstance(attention_mask, torch.Tensor) or \
            tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape "
                         f"{tuple(input_ids.shape)}, got "
                         f"{tuple(getattr(attention_mask, 'shape', ())) or attention_mask!r}")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens) only")
    if bool((attention_mask.sum(-1) == 0).any()):
        raise ValueError("attention_mask has a sequence without any token (a row of 0s); give "
                         "every sequence at least one token")
    return input_ids.long(), attention_mask


def check_positions(length: int, max_new_tokens: int, limit: Optional[int]) -> None:
    """A prompt and its new tokens must fit the model's positions."""
    if limit is None:
        return
    if length > limit:
        raise ValueError(f"the prompt has {length} tokens but the model has {limit} positions "
                         f"(config.max_position_embeddings); shorten the prompt")
    if length + max_new_tokens > limit:
        raise ValueError(f"the prompt has {length} tokens and max_new_tokens={max_new_tokens} "
                         f"would reach position {length + max_new_tokens}, beyond the model's "
                         f"{limit} positions (config.max_position_embeddings); lower "
                         f"max_new_tokens to at most {limit - length} or shorten the prompt")


def sizes_of(batch: int, chunks: int) -> Sequence[int]:
    """The group sizes of ``batch`` sequences in ``chunks`` groups (``torch.chunk``'s)."""
    step = -(-batch // min(chunks, batch))
    sizes = [step] * (batch // step)
    if batch % step:
        sizes.append(batch % step)
    return sizes
