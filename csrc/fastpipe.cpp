// Operator schemas of the fastpipe library and the entry point of the
// `fastpipe._C` Python module. Importing the module loads this shared library,
// which registers the schemas and the kernels (csrc/cpu, csrc/cuda) statically.
#include <Python.h>

#include <torch/library.h>
#include <torch/version.h>

#ifdef FASTPIPE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

TORCH_LIBRARY(fastpipe, m) {
  // Fake (meta) implementations of every op are registered from this Python module.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  m.set_python_module("fastpipe.ops.registry");
#else
  m.impl_abstract_pystub("fastpipe.ops.registry");
#endif
  // Copies every tensor to `device` and returns new tensors (never aliases of
  // the inputs). All inputs of one call must share a device type.
  m.def("transfer(Tensor[] tensors, Device device, bool non_blocking=False) -> Tensor[]");
  // Fused recompute ops (csrc/cpu/fused_*.cpp): each backward takes the forward's inputs,
  // never its outputs or masks. Dropout masks are a pure function of (seed, offset, index).
  m.def("bias_gelu(Tensor x, Tensor bias, str approximate='none') -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias, str approximate='none') -> Tensor");
  m.def("bias_dropout_add(Tensor x, Tensor bias, Tensor residual, float p, int seed, int offset=0) -> Tensor");
  m.def("bias_dropout_add_backward(Tensor grad, float p, int seed, int offset=0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.def("layer_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
}

namespace {

#ifdef FASTPIPE_WITH_CUDA
constexpr bool kWithCuda = true;
constexpr int kCudaVersion = CUDART_VERSION;
#else
constexpr bool kWithCuda = false;
constexpr int kCudaVersion = 0;
#endif

struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "fastpipe._C",
    "Native operators of fastpipe (registered under torch.ops.fastpipe).",
    -1, // no per-interpreter state
    nullptr, // methods
    nullptr, // slots
    nullptr, // traverse
    nullptr, // clear
    nullptr, // free
};

// Sets `module.name = value`, consuming the new reference `value`.
bool add_attr(PyObject* module, const char* name, PyObject* value) {
  if (value == nullptr) {
    return false;
  }
  const int rc = PyModule_AddObjectRef(module, name, value);
  Py_DECREF(value);
  return rc == 0;
}

// Adds build facts as module attributes; returns false with an exception set on failure.
bool add_build_info(PyObject* module) {
  return add_attr(module, "built_with_cuda", PyBool_FromLong(kWithCuda)) &&
      add_attr(module, "cuda_version", PyLong_FromLong(kCudaVersion)) &&
      add_attr(
             module,
             "torch_version",
             PyUnicode_FromFormat(
                 "%d.%d.%d", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH));
}

} // namespace

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) {
    return nullptr;
  }
  if (!add_build_info(module)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
