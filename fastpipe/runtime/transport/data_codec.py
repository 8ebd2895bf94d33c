"""Values and pytree structures as JSON data, so that decoding what a peer sent builds data and
runs nothing.

What a message's metadata holds (non-tensor leaves, the pytree structure, dtypes and shapes)
is encoded here as strict JSON: ``None``, bools, ints, strings and finite floats as themselves,
everything else as a tagged object (``{"$": tag, ...}``): non-finite floats, complex numbers,
tuples, dicts (any keys), dtypes (by name, from a fixed table), devices, ``torch.Size``. A pytree
node names its container type by the name it was registered under with
``torch.utils._pytree`` (``serialized_type_name``, e.g. a ``transformers`` ``ModelOutput``
class), or by its qualified name among the registered types when it has none; decoding looks
the name up in torch's registry and nowhere else (no import, no attribute lookup by a received
name). A value of any other type cannot cross ranks: encoding it raises ``TypeError`` naming
the type.

Decoding raises :class:`Undecodable` for anything that is not such JSON.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict, namedtuple
from typing import Any, Dict, List, Optional

import torch
from torch.utils import _pytree as pytree

TAG = "$"
_FACTORIES = {t.__name__: t for t in (list, dict, int, float, str, tuple, set, bool)}
_DTYPES: Dict[str, torch.dtype] = {}


class Undecodable(ValueError):
    """Bytes that are not the JSON data this module writes."""


# ------------------------------------------------------------------------------- values
def encode_value(value: Any) -> Any:
    """``value`` as JSON-able data (``TypeError`` for a type that cannot cross ranks)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {TAG: "float", "v": repr(value)}
    if isinstance(value, torch.dtype):
        return {TAG: "dtype", "v": dtype_name(value)}
    if isinstance(value, torch.device):
        return {TAG: "device", "v": str(value)}
    if isinstance(value, torch.Size):
        return {TAG: "size", "v": [int(n) for n in value]}
    if isinstance(value, complex):
        return {TAG: "complex", "v": [encode_value(value.real), encode_value(value.imag)]}
    if type(value) is list:
        return [encode_value(v) for v in value]
    if type(value) is tuple:
        return {TAG: "tuple", "v": [encode_value(v) for v in value]}
    if type(value) is dict:
        return {TAG: "dict", "k": [encode_value(k) for k in value],
                "v": [encode_value(v) for v in value.values()]}
    if isinstance(value, type):
        return {TAG: "type", "v": _type_name(value)}
    raise TypeError(
        f"a value of type {type(value).__qualname__} in a message between pipeline ranks: "
        f"only None, bools, numbers, strings, dtypes, devices, torch.Size, and lists, tuples "
        f"and dicts of them cross ranks as data (and containers registered with "
        f"torch.utils._pytree); return tensors or such values from the stage, or keep the "
        f"object out of the stage's output")


def decode_value(data: Any) -> Any:
    """The value :func:`encode_value` encoded (``Undecodable`` for anything else)."""
    if data is None or isinstance(data, (bool, str, int, float)):
        return data
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict) or not isinstance(data.get(TAG), str):
        raise Undecodable(f"an untagged JSON object {_short(data)}")
    return _decode_tagged(data[TAG], data)


def _decode_tagged(tag: str, data: Dict[str, Any]) -> Any:
    v = data.get("v")
    if tag == "float" and v in ("nan", "inf", "-inf"):
        return float(v)
    if tag == "dtype" and isinstance(v, str):
        return dtype_of(v)
    if tag == "device" and isinstance(v, str):
        return torch.device(v)
    if tag == "size" and _ints(v):
        return torch.Size(v)
    if tag == "complex" and isinstance(v, list) and len(v) == 2:
        return complex(*(_number(decode_value(x)) for x in v))
    if tag == "tuple" and isinstance(v, list):
        return tuple(decode_value(x) for x in v)
    if tag == "dict" and isinstance(v, list) and isinstance(data.get("k"), list) \
            and len(data["k"]) == len(v):
        return {decode_value(k): decode_value(x) for k, x in zip(data["k"], v)}
    if tag == "type" and isinstance(v, str):
        return _type_of(v)
    raise Undecodable(f"an unknown or malformed tagged value {_short(data)}")


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Undecodable(f"{_short(value)} is not a number")
    return value


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


# ------------------------------------------------------------------------------- dtypes
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``'float32'``."""
    return str(dtype).rpartition(".")[2]


def dtype_of(name: str) -> torch.dtype:
    """The dtype named ``name``, from a fixed table of torch's dtypes."""
    if not _DTYPES:
        _DTYPES.update({dtype_name(v): v for v in vars(torch).values()
                        if isinstance(v, torch.dtype)})
    if name not in _DTYPES:
        raise Undecodable(f"unknown dtype {_short(name)}")
    return _DTYPES[name]


# ------------------------------------------------------------------------ container types
def _type_name(cls: type) -> str:
    """The name a registered container type (or a namedtuple or a default factory) travels
    under: its pytree ``serialized_type_name``, else its qualified name."""
    entry = pytree.SUPPORTED_SERIALIZED_TYPES.get(cls)
    if entry is not None and entry.serialized_type_name != pytree.NO_SERIALIZED_TYPE_NAME_FOUND:
        return entry.serialized_type_name
    if cls in pytree.SUPPORTED_NODES or _FACTORIES.get(cls.__name__) is cls:
        return _qualified(cls)
    raise TypeError(
        f"{_qualified(cls)} in a message between pipeline ranks is neither a container "
        f"registered with torch.utils._pytree nor a namedtuple registered with a "
        f"serialized_type_name (torch.utils._pytree._register_namedtuple): register it on "
        f"every rank, or return a dict or tuple instead")


def _type_of(name: str) -> type:
    """The registered type named ``name`` (torch's pytree registry, or a builtin factory)."""
    if name != pytree.NO_SERIALIZED_TYPE_NAME_FOUND and \
            name in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
        return pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE[name]
    found = [t for t in pytree.SUPPORTED_NODES if _qualified(t) == name]
    found += [t for t in _FACTORIES.values() if _qualified(t) == name]
    if len(found) != 1:
        raise Undecodable(f"the container type {_short(name)} is not registered with "
                          f"torch.utils._pytree in this process (every rank must import the "
                          f"same model code)")
    return found[0]


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ------------------------------------------------------------------------------ pytree specs
def encode_spec(spec: Any) -> Any:
    """A ``TreeSpec`` as data: ``None`` for a leaf, else ``[type name, context, children]``."""
    if spec.is_leaf():
        return None
    context = spec.context
    if spec.type is defaultdict:  # [default factory, keys]: the factory by name
        factory, keys = context
        context = [None if factory is None else {TAG: "type", "v": _type_name(factory)}, keys]
        return [_type_name(spec.type), [context[0], encode_value(keys)],
                [encode_spec(c) for c in spec.children()]]
    return [_type_name(spec.type), encode_value(context),
            [encode_spec(c) for c in spec.children()]]


def decode_spec(data: Any) -> Any:
    """The ``TreeSpec`` :func:`encode_spec` encoded, its types from torch's registry."""
    if data is None:
        return pytree.treespec_leaf()
    if not (isinstance(data, list) and len(data) == 3 and isinstance(data[0], str)
            and isinstance(data[2], list)):
        raise Undecodable(f"a malformed pytree node {_short(data)}")
    kind = _type_of(data[0])
    if kind not in pytree.SUPPORTED_NODES:
        raise Undecodable(f"{data[0]!r} is not a pytree container type")
    context = decode_value(data[1])
    if kind is defaultdict and not (isinstance(context, list) and len(context) == 2
                                    and context[0] in (None, *_FACTORIES.values())):
        raise Undecodable(f"a defaultdict context {_short(context)}")
    if kind is namedtuple and not (isinstance(context, type) and issubclass(context, tuple)
                                   and hasattr(context, "_fields")):
        raise Undecodable(f"a namedtuple node whose class is {_short(context)}")
    return pytree.TreeSpec(kind, context, [decode_spec(c) for c in data[2]])


# --------------------------------------------------------------------------------- JSON
def dumps(data: Any) -> bytes:
    """Strict JSON (no NaN or infinity tokens: those are tagged), UTF-8."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


def loads(raw: bytes) -> Any:
    """Strict JSON of ``raw`` (``Undecodable`` otherwise)."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise Undecodable(f"not JSON data ({type(error).__name__}: {error})"[:300]) from None


def _no_constant(token: str) -> None:
    raise Undecodable(f"the JSON token {token!r}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_list(value: Any, what: str, item: Optional[type] = None) -> List[Any]:
    """``value`` if it is a list (of ``item`` instances when given), else ``Undecodable``."""
    if not isinstance(value, list) or (item is not None and
                                       not all(type(v) is item for v in value)):
        raise Undecodable(f"{what} is not a list{'' if item is None else ' of ' + item.__name__}")
    return value
