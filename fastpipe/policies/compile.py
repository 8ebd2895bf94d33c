"""Compiled stages: ``compile=`` of the front doors, and models handed over in ``torch.compile``.

A stage is compiled in place, the way ``nn.Module.compile`` does it: its ``__call__`` runs through
``torch.compile``, while the module, its submodules and their names stay what they were. So the
pipe's parameter and state-dict names stay the plain model's, and every wrapper that runs a
stage's layers (tied weights, skip connections, tensor-parallel boundaries) runs the compiled code.

A model wrapped in ``torch.compile`` (an ``OptimizedModule``) is taken apart (``_orig_mod``), the
model itself and any of its submodules, before the pipe looks at it, so names never hold
``_orig_mod``:

- a model compiled as a whole is compiled again stage by stage, with the options it was
  compiled with;
- a compiled submodule, when the pipe compiles its stages anyway, is compiled as part of its
  stage; otherwise it is compiled in place again, alone, with its own options.

The wrappers are put back if the front door's construction fails.

Exactness: the stages compute with the compiler's kernels, so losses and gradients equal the
plain model's up to rounding (``backend='aot_eager'`` runs eager kernels: identical). Random
numbers are replayed for recomputation as in eager stages; compiled code draws them
differently from eager code, except with ``aot_eager`` or inductor's ``fallback_random``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
import threading
import types
from typing import Any, Callable, ContextManager, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

__all__ = ["Compiler", "Unwrapped", "check", "check_modes", "compile_module", "outside_compiles",
           "takes_compiled", "unwrap", "without_donated_buffers"]

ARGUMENT = "compile"
_SELECTIVE = "selective"


def _option_names() -> Tuple[str, ...]:
    """The keyword arguments this torch's ``torch.compile`` takes (they vary by version)."""
    names = [name for name, p in inspect.signature(torch.compile).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return tuple(sorted(names))


OPTION_NAMES = _option_names()


class Compiler:
    """How stages are compiled: ``torch.compile`` keyword options, or the context a model's own
    ``torch.compile`` wrapper holds (so its options are kept exactly as the user gave them)."""

    def __init__(self, options: Optional[Mapping[str, Any]] = None,
                 context: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None
                 ) -> None:
        self.options: Dict[str, Any] = dict(options or {})
        self.context = context

    @classmethod
    def of(cls, wrapper: nn.Module) -> "Compiler":
        """The compiler of a ``torch.compile`` wrapper: its own context when it has one."""
        context = getattr(wrapper, "dynamo_ctx", None)
        return cls(context=context) if callable(context) else cls()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` compiled (lazily: on its first call, like ``torch.compile``)."""
        if self.context is not None:
            return self.context(fn)
        return torch.compile(fn, **_copied(self.options))

    def __repr__(self) -> str:
        return f"Compiler({self.options!r})" if self.context is None else "Compiler(<the model's>)"


def _copied(options: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy torch.compile may change (it pops entries of the ``options`` dict it is given)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in options.items()}


def _probe(x: Any) -> Any:  # what the options are tried on: nothing is compiled until called
    return x


def check(value: Any) -> Optional[Compiler]:
    """``compile``: ``False`` (no compilation), ``True`` (``torch.compile``'s defaults) or a dict
    of ``torch.compile`` keyword options, checked by ``torch.compile`` itself before any work
    (``TypeError`` / ``ValueError`` naming the argument). Returns ``None`` for ``False``."""
    if isinstance(value, Compiler) or value is None:
        return value
    if value is False:
        return None
    if value is True:
        return Compiler()
    if not isinstance(value, Mapping):
        raise TypeError(f"{ARGUMENT} must be True, False or a dict of torch.compile options "
                        f"(e.g. {{'backend': 'aot_eager'}}), got {value!r}")
    unknown = [k for k in value if k not in OPTION_NAMES]
    if unknown:
        raise TypeError(f"{ARGUMENT}={dict(value)!r} has {unknown[0]!r}, which is not an "
                        f"option of torch.compile; use {', '.join(OPTION_NAMES)}")
    try:
        torch.compile(_probe, **_copied(value))
    except Exception as error:  # unknown backend, mode, inductor option, ...
        raise ValueError(f"{ARGUMENT}={dict(value)!r} is refused by torch.compile: "
                         f"{type(error).__name__}: {error}") from None
    return Compiler(value)


def check_modes(compiler: Optional[Compiler], *, checkpoint: str, cuda_graphs: bool = False,
                sharded: bool = False) -> None:
    """Combinations a compiled stage cannot run, refused before any work."""
    if compiler is None:
        return
    if checkpoint == _SELECTIVE:
        raise NotImplementedError(
            "compile with checkpoint='selective' is not supported: the selective policy runs a "
            "stage under a dispatch mode that torch.compile does not trace, so nothing would be "
            "compiled; use checkpoint='always' or 'except_last' (the compiled stage is "
            "recomputed), or 'never' (the compiler's partitioner picks what to recompute)")
    if cuda_graphs:
        raise NotImplementedError(
            "compile with cuda_graphs=True is not supported; compile={'mode': "
            "'reduce-overhead'} has the compiled stages captured as CUDA graphs instead")
    if sharded:
        raise NotImplementedError(
            "compile with tensor_parallel or data_parallel='fsdp' is not supported; compile "
            "the layers inside the stages yourself (their DTensor parameters are the "
            "compiler's concern), or use a pipeline without 3-D parallelism")


# ------------------------------------------------------------------------ compiling in place
def compile_module(module: nn.Module, compiler: Compiler, name: str) -> None:
    """Compile ``module``'s ``__call__`` in place (hooks included, names unchanged), as
    ``nn.Module.compile`` does. ``name`` names the compiled code (in logs and caches)."""
    if not hasattr(module, "_compiled_call_impl"):  # pragma: no cover - torch < 2.2
        raise NotImplementedError("compiling a stage in place needs torch >= 2.2 "
                                  "(nn.Module.compile)")
    module._compiled_call_impl = compiler.wrap(_entry(module, name))
    _COMPILED_STAGES.set()


def _entry(module: nn.Module, name: str) -> Callable[..., Any]:
    """A function running ``module`` (hooks included), with a code object of its own.

    ``nn.Module.compile`` compiles the bound ``_call_impl``, whose frame the compiler skips for
    torch's own modules (an ``nn.Sequential`` would run eagerly); it traces this function and
    inlines the module. The compiler keeps its cache, and its recompile limit, per code object:
    with one each, stages of different layers, grad modes and micro-batch shapes never exhaust
    a shared limit (past which the compiler would run a stage eagerly, with a warning).
    """
    def run(*args: Any, **kwargs: Any) -> Any:
        return module._call_impl(*args, **kwargs)

    code = run.__code__.replace(co_name=name)
    entry = types.FunctionType(code, run.__globals__, name, run.__defaults__, run.__closure__)
    entry.__qualname__ = name
    return entry


# ------------------------------------------------------------------------ unwrapping
def _wrapper_type() -> Optional[type]:
    """``OptimizedModule``, if ``torch._dynamo`` was ever imported (else no model holds one, and
    importing it, seconds long, is not needed)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None


class Unwrapped:
    """A model without its ``torch.compile`` wrappers, and what it takes to put them back."""

    def __init__(self, module: Any, compiler: Optional[Compiler],
                 inner: List[Tuple[nn.Module, str, nn.Module]]) -> None:
        self.module = module  # the model, unwrapped (the same object when it was not wrapped)
        self.compiler = compiler  # the model's own torch.compile, when it was compiled whole
        self.inner = inner  # (parent, name, wrapper) of each compiled submodule, unwrapped

    def restore(self) -> None:
        """Put the submodules' wrappers back (the construction failed)."""
        for parent, name, wrapper in reversed(self.inner):
            parent._modules[name] = wrapper

    def settle(self, stages_compiled: bool) -> None:
        """When the stages are not compiled, compile each unwrapped submodule again, in place,
        with its own wrapper's options (so it runs as compiled as the user asked)."""
        if stages_compiled:
            return
        for parent, name, wrapper in self.inner:
            compile_module(parent._modules[name], Compiler.of(wrapper), f"compiled_{name}")


def unwrap(module: Any) -> Unwrapped:
    """Take off ``torch.compile`` wrappers: the model's own (the model is then its
    ``_orig_mod``) and its submodules' (replaced in their parents by the module they wrap)."""
    wrapper = _wrapper_type()
    if wrapper is None or not isinstance(module, nn.Module):
        return Unwrapped(module, None, [])
    compiler = Compiler.of(module) if isinstance(module, wrapper) else None
    while isinstance(module, wrapper):
        module = module._orig_mod
    inner: List[Tuple[nn.Module, str, nn.Module]] = []
    seen, todo = set(), [module]
    while todo:
        parent = todo.pop()
        if id(parent) in seen:
            continue
        seen.add(id(parent))
        for name, child in list(parent._modules.items()):
            plain = child
            while isinstance(plain, wrapper):
                plain = plain._orig_mod
            if plain is not child:
                parent._modules[name] = plain
                inner.append((parent, name, child))
            if plain is not None:
                todo.append(plain)
    return Unwrapped(module, compiler, inner)


def takes_compiled(init: Callable[..., None]) -> Callable[..., None]:
    """For a front door's constructor ``__init__(self, module, ..., compile=False, ...)``: check
    ``compile`` first, hand the constructor the model without ``torch.compile`` wrappers and the
    resolved :class:`Compiler` (``compile=`` wins over the model's own), and put the wrappers
    back if the constructor raises."""
    @functools.wraps(init)
    def construct(self: Any, module: Any, *args: Any, compile: Any = False,
                  **kwargs: Any) -> None:
        compiler = check(compile)
        taken = unwrap(module)
        compiler = compiler if compiler is not None else taken.compiler
        try:
            init(self, taken.module, *args, compile=compiler, **kwargs)
        except BaseException:
            taken.restore()
            raise
        taken.settle(stages_compiled=compiler is not None)
    return construct


# ------------------------------------------------------------------------ random numbers
_NOTHING = contextlib.nullcontext()
_COMPILED_STAGES = threading.Event()  # set once this process compiles a stage or submodule


def outside_compiles() -> ContextManager[Any]:
    """A region no compilation runs alongside (held by one thread at a time).

    While it compiles, ``torch.compile`` saves the global random generator's state and restores
    it at the end. A stage replaying its random numbers seeds that generator for its forward
    (``fastpipe.policies.checkpoint``); a compile on another thread in the meantime would
    restore a state under it (other dropout masks than the recomputation draws) or leave the
    stage's seeded state behind. The region is the compiler's own lock, so compiles and seeded
    forwards take turns (and seeded stages of a pipe with compiled stages run one at a time);
    a no-op in a process that has compiled no stage, whose forwards keep running side by
    side.
    """
    if not _COMPILED_STAGES.is_set():  # no stage compiles: seeded forwards run side by side
        return _NOTHING
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else _NOTHING


# ------------------------------------------------------------------------ donated buffers
class _WithoutDonatedBuffers:
    """While a compiled stage runs an action, AOTAutograd's donated buffers are off.

    A zero-bubble schedule backpropagates a stage twice (B for the input gradient, keeping the
    graph, then W for the weights); a compiled backward whose saved buffers were donated refuses
    a kept graph, both where it is compiled and where it runs. The setting is per thread in
    recent torch (then each thread switches its own and puts it back) and process-wide in older
    ones (then a count shared by all threads keeps it off while any compiled stage is busy and
    the last one out puts it back). Its only cost is the memory donation saves; no result
    depends on it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._depth = 0  # actions running, in all threads
        self._saved: Any = None

    def __enter__(self) -> None:
        config = _functorch_config()
        if config is None:
            return
        local = self._local
        with self._lock:
            if self._depth == 0:
                self._saved = config.donated_buffer
            self._depth += 1
            depth = getattr(local, "depth", 0)
            if depth == 0:
                local.saved = config.donated_buffer
            local.depth = depth + 1
            config.donated_buffer = False

    def __exit__(self, *exc: Any) -> None:
        config = _functorch_config()
        if config is None:
            return
        local = self._local
        with self._lock:
            self._depth -= 1
            local.depth -= 1
            if _per_thread(config):
                if local.depth == 0:
                    config.donated_buffer = local.saved
            elif self._depth == 0:
                config.donated_buffer = self._saved


@functools.lru_cache(maxsize=None)
def _functorch_config() -> Any:
    """AOTAutograd's settings (imported here: the compiler may not be loaded yet), or ``None``
    on a torch without donated buffers."""
    try:
        from torch._functorch import config
    except ImportError:  # pragma: no cover
        return None
    return config if hasattr(config, "donated_buffer") else None


@functools.lru_cache(maxsize=None)
def _per_thread(config: Any) -> bool:
    """Whether this torch keeps a setting's overrides per thread (``ContextVar`` s)."""
    entry = getattr(config, "_config", {}).get("donated_buffer")
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


without_donated_buffers = _WithoutDonatedBuffers()
"""The context every action of a compiled stage runs in (one object, entered by any thread)."""
