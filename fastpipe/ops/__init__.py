"""fastpipe's operators: native (``torch.ops.fastpipe``) where built, pure PyTorch otherwise."""
from .. import _native
from . import registry
from .dropout import bias_dropout_add
from .gelu import bias_gelu
from .norms import layer_norm, rms_norm
from .swiglu import swiglu
from . import transfer as transfer_module
from .transfer import reference_transfer, transfer

# fake and autograd implementations, in Python, once the native library has loaded
_native.when_loaded(registry.register_all)
_native.when_loaded(transfer_module.register_python_impls)

__all__ = ["bias_dropout_add", "bias_gelu", "layer_norm", "reference_transfer", "rms_norm",
           "swiglu", "transfer"]
