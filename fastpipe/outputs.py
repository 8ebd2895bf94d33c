"""How a model's outputs come back together from micro-batches.

A leaf with one row per sample (dim 0 the micro-batch's size) is concatenated along the batch.
Any other leaf, such as the loss a model returns inside its output, combines by a *rule* that
makes the result the plain model's on the whole batch: ``'sum'``, or a mean weighted by what each
micro-batch's mean is over (its samples, or its labels that are not ``-100``); a statistic of the
micro-batch itself (a router's load-balancing loss) is averaged over micro-batches
(``'microbatch_mean'``, and inside a loss that adds it: :class:`WithAuxiliary`). A leaf whose rule
is not known is an :class:`OutputReductionError` naming it and the ``output_reduction`` option,
never a guess. Leaves are named as ``output_reduction`` names them: ``'loss'``, ``'logits'``,
``'hidden_states[0]'``, ``'[1]'`` (a tuple's element), ``'output'`` (an output that is one
tensor).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.utils import _pytree as pytree

IGNORE_INDEX = -100  # the label PyTorch's and Hugging Face's cross-entropy losses skip
ROOT_NAME = "output"  # the name of an output that is a single leaf

Count = Callable[[Dict[str, Any]], Any]
RuleSpec = Union[str, Count]


class OutputReductionError(ValueError):
    """An output leaf cannot be combined over micro-batches (or ``output_reduction`` is
    malformed); the message names the leaf and the ``output_reduction`` entry that resolves it."""


# ------------------------------------------------------------------------------ rules
class Rule:
    """How one non-per-sample leaf combines: ``weight`` gives each micro-batch's weight and
    whether the weighted sum is divided by the weights' total (a mean) or not (a sum)."""

    label = "rule"
    reads: Tuple[str, ...] = ()  # the named inputs the weight reads ('*': all of them)

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        """(this micro-batch's weight, whether the result is divided by the total weight)."""
        raise NotImplementedError  # pragma: no cover - every rule says

    def __repr__(self) -> str:
        return self.label


class Cat(Rule):
    """Concatenate along dim 0 (the default for per-sample leaves)."""

    label = "'cat'"


class Sum(Rule):
    """Add the micro-batch values (a loss summed over samples or tokens, a count)."""

    label = "'sum'"

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        return 1.0, False


class Mean(Rule):
    """A mean over samples: each micro-batch weighted by its number of samples."""

    label = "'mean'"

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        return float(size), True


class TokenMean(Rule):
    """A mean over the labels that are not ``-100`` (cross-entropy's ``ignore_index``), each
    micro-batch weighted by its count of them; ``shifted``: over ``labels[..., 1:]`` (a causal
    LM predicts token t + 1 from the tokens up to t, so the first label of a row is never
    predicted)."""

    def __init__(self, shifted: bool) -> None:
        self.shifted = shifted
        self.label = "'shifted_token_mean'" if shifted else "'token_mean'"
        self.reads = ("labels",)

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        labels = require(inputs, "labels", self)
        if self.shifted:
            labels = labels[..., 1:]
        return float((labels != IGNORE_INDEX).sum()), True


class Counted(Rule):
    """A mean over what ``count(inputs)`` counts in a micro-batch (``inputs``: its named
    inputs), each micro-batch weighted by that count."""

    reads = ("*",)

    def __init__(self, count: Count) -> None:
        self.count = count
        self.label = f"the count {getattr(count, '__name__', repr(count))}"

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        value = self.count(dict(inputs))
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else math.nan
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not value >= 0 or not math.isfinite(value):
            raise OutputReductionError(
                f"output_reduction's {self.label} returned {value!r}; return the number of "
                f"elements (samples, tokens) the micro-batch's mean is over, a non-negative "
                f"number")
        return float(value), True


class MicrobatchMean(Rule):
    """A mean over micro-batches, each counting alike: a term computed per micro-batch and
    averaged, as Megatron-core averages a mixture-of-experts router's load-balancing loss (its
    statistics are over the micro-batch's tokens, so no weighting makes it the whole batch's)."""

    label = "'microbatch_mean'"

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        return 1.0, True


class WithAuxiliary(Rule):
    """A loss that is a main loss plus ``coefficient`` times an auxiliary term the output also
    holds as the leaf ``auxiliary`` (a mixture-of-experts LM's loss: cross-entropy plus the
    router's load-balancing loss). Over micro-batches the main loss (the leaf minus the
    auxiliary term) combines by ``main`` and the auxiliary term by :class:`MicrobatchMean`.
    Without the auxiliary leaf (the model asked for no router statistics) the loss is the main
    loss alone."""

    def __init__(self, main: Rule, auxiliary: str, coefficient: float) -> None:
        self.main, self.auxiliary, self.coefficient = main, auxiliary, float(coefficient)
        self.reads = main.reads
        self.label = (f"{main} plus {self.coefficient:g} x {auxiliary!r} averaged over "
                      f"micro-batches")

    def weight(self, inputs: Mapping[str, Any], size: int) -> Tuple[float, bool]:
        return self.main.weight(inputs, size)


NAMED_RULES: Dict[str, Callable[[], Rule]] = {
    "cat": Cat, "sum": Sum, "mean": Mean, "microbatch_mean": MicrobatchMean,
    "token_mean": lambda: TokenMean(shifted=False),
    "shifted_token_mean": lambda: TokenMean(shifted=True),
}
CHOICES = "'mean', 'sum', 'token_mean', 'shifted_token_mean', 'microbatch_mean', 'cat'"


def require(inputs: Mapping[str, Any], name: str, rule: Rule) -> Any:
    """The named input a rule reads; an error saying so when the batch lacks it."""
    if name not in inputs or inputs[name] is None:
        raise OutputReductionError(
            f"{rule} weighs each micro-batch by its {name!r} input, but the batch has none "
            f"(its named inputs: {sorted(inputs) or 'none'}); pass {name}=... as a keyword "
            f"input, or choose another output_reduction")
    return inputs[name]


def check_output_reduction(value: Any) -> Dict[str, Rule]:
    """``output_reduction``, checked: ``None`` or a dict from leaf names to a rule name of
    ``NAMED_RULES`` or a function ``count(inputs)``. Raises before any work."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"output_reduction must be a dict from output leaf names to rules, e.g. "
                        f"{{'loss': 'mean'}}, got {type(value).__name__}")
    rules: Dict[str, Rule] = {}
    for name, spec in value.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"output_reduction's keys are output leaf names ('loss', "
                            f"'hidden_states[0]', 'output' for a single tensor), got {name!r}")
        if isinstance(spec, str) and spec in NAMED_RULES:
            rules[name] = NAMED_RULES[spec]()
        elif callable(spec) and not isinstance(spec, str):
            rules[name] = Counted(spec)
        else:
            raise ValueError(f"output_reduction[{name!r}]={spec!r}; use one of {CHOICES}, or a "
                             f"function of a micro-batch's named inputs returning the count its "
                             f"mean is over")
    return rules


# ------------------------------------------------------------------------------ the pipe's rules
@dataclass(frozen=True)
class OutputRules:
    """A pipe's rules: those the user gave (``output_reduction``, by leaf name or by a name
    above the leaf), those known for the model (its own loss), and the model's signature, which
    names its positional inputs."""

    given: Mapping[str, Rule]
    known: Mapping[str, Rule]
    signature: Optional[inspect.Signature] = None
    model: str = ""  # the model's class, for messages

    def rule_for(self, name: str) -> Optional[Rule]:
        """The rule of the leaf ``name``: given for it or for a name above it (the longest),
        else known for it or for a name above it, else ``None``."""
        for rules in (self.given, self.known):
            if name in rules:
                return rules[name]
            above = [key for key in rules if name.startswith(key) and name[len(key)] in ".["]
            if above:
                return rules[max(above, key=len)]
        return None

    def named(self, inputs: Any) -> Dict[str, Any]:
        """The model's inputs by name: keyword inputs, and positional ones named by the
        signature of a traced model's forward (which takes a tuple as positional inputs and
        anything else but a dict as its one positional input)."""
        args, kwargs = as_arguments(inputs, positional=self.signature is not None)
        if self.signature is None or not args:
            return dict(kwargs)
        try:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return dict(kwargs)
        named: Dict[str, Any] = {}
        for key, value in bound.items():
            kind = self.signature.parameters[key].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is not inspect.Parameter.VAR_POSITIONAL:
                named[key] = value
        return named


def as_arguments(inputs: Any, positional: bool) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Positional and keyword inputs of a call (``fastpipe.tracing.Call``, a dict of keyword
    inputs, and with ``positional`` a tuple of positional inputs or a single one)."""
    if isinstance(inputs, tuple) and hasattr(inputs, "_fields") and \
            tuple(inputs._fields) == ("args", "kwargs"):
        return tuple(inputs.args), dict(inputs.kwargs)
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if not positional or inputs is None:
        return (), {}
    return (tuple(inputs) if isinstance(inputs, tuple) else (inputs,)), {}


def signature_of(module: Any) -> Optional[inspect.Signature]:
    """The signature of a module's forward, when it has one Python can read."""
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError, AttributeError):
        return None


# ------------------------------------------------------------------------------ leaf names
def leaf_name(path: Sequence[Any]) -> str:
    """A leaf's name from its pytree path: keys joined by dots, indices in brackets."""
    name = ""
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            name += f"[{key.idx}]"
            continue
        part = str(getattr(key, "key", getattr(key, "name", key)))
        name += f".{part}" if name else part
    return name or ROOT_NAME


def leaves_by_name(value: Any) -> Dict[str, Any]:
    """Every leaf of an output, by name."""
    leaves, _ = pytree.tree_flatten_with_path(value)
    return {leaf_name(path): leaf for path, leaf in leaves}


def describe(value: Any) -> str:
    """A leaf's type and shape, for messages."""
    if isinstance(value, torch.Tensor):
        return "a 0-dim tensor" if value.dim() == 0 else \
            f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


# ------------------------------------------------------------------------------ combining
Contexts = Callable[[], List[Dict[str, Any]]]


def combine(outputs: Sequence[Any], sizes: Optional[Sequence[int]] = None,
            rules: Optional[OutputRules] = None, inputs: Optional[Contexts] = None) -> Any:
    """The batch's output from its micro-batches' (same structure each): per-sample leaves
    concatenated, the others combined by their rule. ``sizes``: the micro-batches' sample
    counts; ``inputs()``: each micro-batch's named inputs, read only when a rule needs them.
    Raises :class:`OutputReductionError` for a leaf it cannot combine."""
    flat = [pytree.tree_flatten_with_path(out) for out in outputs]
    spec = pytree.tree_structure(outputs[0])
    for out in outputs[1:]:
        other = pytree.tree_structure(out)
        if other != spec:
            raise ValueError(f"micro-batch outputs differ in structure: {spec} vs {other}")
    named: Dict[str, List[Dict[str, Any]]] = {}

    def contexts() -> List[Dict[str, Any]]:
        if "all" not in named:
            named["all"] = inputs() if inputs is not None else [{} for _ in outputs]
        return named["all"]

    names = [leaf_name(path) for path, _ in flat[0][0]]
    columns = {name: [leaves[index][1] for leaves, _ in flat]
               for index, name in enumerate(names)}
    merged = []
    for name in names:
        rule = rules.rule_for(name) if rules is not None else None
        if isinstance(rule, WithAuxiliary):
            merged.append(with_auxiliary(name, columns, rule, sizes, contexts))
        else:
            merged.append(merge(name, columns[name], rule, sizes, contexts))
    return pytree.tree_unflatten(merged, spec)


def with_auxiliary(name: str, columns: Mapping[str, Sequence[Any]], rule: WithAuxiliary,
                   sizes: Optional[Sequence[int]], contexts: Contexts) -> Any:
    """A loss with an auxiliary term: its main part weighed by the main rule, the auxiliary
    term averaged over micro-batches; the main rule alone when the output has no auxiliary
    leaf."""
    column = columns[name]
    auxiliary = columns.get(rule.auxiliary)
    if auxiliary is None:
        return weighted(name, column, rule.main, sizes, contexts)
    c = rule.coefficient
    main = weighted(name, [x - c * a for x, a in zip(column, auxiliary)], rule.main, sizes,
                    contexts)
    return main + c * weighted(rule.auxiliary, auxiliary, MicrobatchMean(), sizes, contexts)


def merge(name: str, column: Sequence[Any], rule: Optional[Rule],
          sizes: Optional[Sequence[int]], contexts: Contexts) -> Any:
    """One leaf of the batch's output from its micro-batch values."""
    first = column[0]
    if isinstance(rule, Cat) or (rule is None and per_sample(column, sizes)):
        if not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in column):
            raise OutputReductionError(f"output leaf {name!r} is {describe(first)}, which "
                                       f"output_reduction={{{name!r}: 'cat'}} cannot "
                                       f"concatenate along the batch")
        return torch.cat(list(column)) if len(column) > 1 else first
    if rule is not None:
        return weighted(name, column, rule, sizes, contexts)
    if not isinstance(first, torch.Tensor) and all(_same(x, first) for x in column[1:]):
        return first  # a constant every micro-batch returns alike (None, a flag, a name)
    raise unknown_leaf(name, column, sizes)


def per_sample(column: Sequence[Any], sizes: Optional[Sequence[int]]) -> bool:
    """Whether every micro-batch's value is a tensor with one row per sample."""
    if not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in column):
        return False
    return sizes is None or all(x.shape[0] == n for x, n in zip(column, sizes))


def _same(value: Any, other: Any) -> bool:
    try:
        return bool(value == other)
    except Exception:  # noqa: BLE001 - values that cannot say whether they are equal differ
        return False


def weighted(name: str, column: Sequence[Any], rule: Rule, sizes: Optional[Sequence[int]],
             contexts: Contexts) -> Any:
    """``sum(w_i x_i) / sum(w_i)`` (a mean) or ``sum(x_i)`` (a sum) over the micro-batches;
    a micro-batch with weight 0 (no counted element: its own mean is 0/0) adds nothing."""
    if not all(isinstance(x, (torch.Tensor, int, float)) and not isinstance(x, bool)
               for x in column):
        raise OutputReductionError(f"output leaf {name!r} is {describe(column[0])}; {rule} "
                                   f"combines numbers and tensors only")
    if sizes is None:
        raise OutputReductionError(f"output leaf {name!r}: {rule} needs the micro-batch sizes")
    found = contexts() if rule.reads else [{} for _ in column]
    pairs = [rule.weight(found[i], sizes[i]) for i in range(len(column))]
    if not all(normalised for _, normalised in pairs):
        return _total(list(column))
    total = math.fsum(w for w, _ in pairs)
    if total == 0:  # nothing counted anywhere: the plain model's mean is 0/0 as well
        return column[0] * 0.0 + math.nan
    return _total([x * (w / total) for x, (w, _) in zip(column, pairs) if w > 0])


def _total(values: List[Any]) -> Any:
    result = values[0]
    for value in values[1:]:
        result = result + value
    return result


def unknown_leaf(name: str, column: Sequence[Any], sizes: Optional[Sequence[int]]
                 ) -> OutputReductionError:
    """The error for a leaf that is not per-sample and has no rule: it names the leaf and the
    option."""
    what = describe(column[0])
    if isinstance(column[0], torch.Tensor) and column[0].dim() >= 1 and sizes is not None:
        what += f" (micro-batches of {list(sizes)} samples gave dim 0 of " \
                f"{[x.shape[0] for x in column]})"
    elif not isinstance(column[0], torch.Tensor):
        what += " that differs between micro-batches"
    return OutputReductionError(
        f"output leaf {name!r} is {what}, not one row per sample, so it cannot be gathered "
        f"along the batch, and how it combines over micro-batches is not known (a loss may be "
        f"a mean over samples, a mean over tokens or a sum: each weighs micro-batches "
        f"differently); say how with output_reduction={{{name!r}: ...}} on the pipe's "
        f"constructor: one of {CHOICES}, or a function of a micro-batch's named inputs "
        f"returning the count its mean is over")
