"""The native library: it builds and loads, and the loader degrades gracefully when it cannot."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings

import pytest
import torch

from fastpipe import _native
from fastpipe.apps.info import format_info, info

# The package re-exports the function `transfer`, which shadows the submodule attribute.
transfer_mod = importlib.import_module("fastpipe.ops.transfer")

SCHEMA = "fastpipe::transfer(Tensor[] tensors, Device device, bool non_blocking=False) -> Tensor[]"


def _native_skip_reason() -> str | None:
    """Why native tests cannot run in this environment (None: they must run and pass)."""
    if os.environ.get("FASTPIPE_NO_NATIVE", "") == "1":
        return "installed with FASTPIPE_NO_NATIVE=1 (pure-Python build)"
    if os.environ.get(_native.DISABLE_ENV, "") == "1":
        return f"native library disabled by {_native.DISABLE_ENV}=1"
    return None


needs_native = pytest.mark.skipif(_native_skip_reason() is not None,
                                  reason=_native_skip_reason() or "")


@pytest.fixture
def fresh_loader(monkeypatch):
    """A loader that has not tried to import fastpipe._C yet (state restored afterwards)."""
    for name, value in (("_attempted", False), ("_done", False), ("_module", None),
                        ("_error", None)):
        monkeypatch.setattr(_native, name, value)
    monkeypatch.delenv(_native.DISABLE_ENV, raising=False)
    return _native


@needs_native
def test_native_library_loads():
    assert _native.load(), f"fastpipe._C failed to load: {_native.load_error()}"
    assert _native.available()
    assert _native.load_error() is None
    import fastpipe._C as C

    assert C.torch_version == torch.__version__.split("+")[0]
    assert isinstance(C.built_with_cuda, bool)


@needs_native
def test_schema():
    assert _native.load()
    assert str(torch.ops.fastpipe.transfer.default._schema) == SCHEMA


@needs_native
def test_kernels_registered_for_the_build():
    assert _native.load()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("fastpipe::transfer", "CPU")
    assert has("fastpipe::transfer", "CUDA") == _native.module().built_with_cuda
    assert transfer_mod.register_python_impls()


def test_failed_import_warns_once_and_falls_back(fresh_loader, monkeypatch):
    calls = []

    def broken_import():
        calls.append(1)
        raise ImportError("simulated: undefined symbol")

    monkeypatch.setattr(fresh_loader, "_import", broken_import)
    with pytest.warns(fresh_loader.FastpipeNativeWarning, match="simulated"):
        assert fresh_loader.load() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail the test
        assert fresh_loader.load() is False
        assert fresh_loader.available() is False
        x = torch.arange(4.0)
        out = transfer_mod.transfer([x], "meta")
    assert calls == [1], "the import must not be retried"
    assert "simulated" in fresh_loader.load_error()
    assert out[0].device.type == "meta" and out[0].shape == x.shape


def test_failed_import_uses_reference_path(fresh_loader, monkeypatch):
    monkeypatch.setattr(fresh_loader, "_import", lambda: (_ for _ in ()).throw(OSError("gone")))
    with pytest.warns(fresh_loader.FastpipeNativeWarning):
        fresh_loader.load()
    x = torch.randn(3, requires_grad=True)
    (y,) = transfer_mod.transfer([x], "meta")
    assert type(y.grad_fn).__name__ == "ToCopyBackward0"
    with pytest.raises(RuntimeError, match="gone"):
        transfer_mod.transfer([x], "meta", use_native=True)


@pytest.mark.parametrize("with_cuda", [False, True])
def test_a_library_without_cuda_paths_beside_a_gpu_warns(fresh_loader, monkeypatch, with_cuda):
    library = type(sys)("fastpipe._C")
    library.built_with_cuda = with_cuda
    monkeypatch.setattr(fresh_loader, "_import", lambda: library)
    monkeypatch.setattr(fresh_loader, "_hooks", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh_loader.load()
    said = [str(w.message) for w in caught if w.category is fresh_loader.FastpipeNativeWarning]
    assert len(said) == (0 if with_cuda else 1)
    assert with_cuda or "built without its CUDA paths" in said[0]


def test_disable_env_is_reported_without_warning(fresh_loader, monkeypatch):
    monkeypatch.setenv(_native.DISABLE_ENV, "1")
    monkeypatch.setattr(fresh_loader, "_import", lambda: pytest.fail("import attempted"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh_loader.load() is False
    assert _native.DISABLE_ENV in fresh_loader.load_error()


def test_importing_the_package_does_not_load_the_library():
    code = ("import sys, fastpipe._native as n; "
            "assert 'fastpipe._C' not in sys.modules and not n._attempted")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_format_info_mentions_torch_and_native_status():
    text = format_info()
    assert torch.__version__ in text
    assert "native library:" in text
    status = "loaded (" if _native.load() else "not loaded ("
    assert status in text
    facts = info()
    assert facts["native"]["loaded"] == _native.load()
    assert facts["cpu_threads"] >= 1
    assert facts["cuda"]["available"] == torch.cuda.is_available()
    assert set(facts) >= {"fastpipe", "torch", "python", "native", "cuda", "triton"}


def test_format_info_reports_why_native_is_missing(fresh_loader, monkeypatch):
    monkeypatch.setenv(_native.DISABLE_ENV, "1")
    assert f"not loaded (disabled by {_native.DISABLE_ENV}=1)" in format_info()
