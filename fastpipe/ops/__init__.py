"""fastpipe's operators: native (``torch.ops.fastpipe``) where built, pure PyTorch otherwise."""
from .dropout import bias_dropout_add
from .gelu import bias_gelu
from .norms import layer_norm, rms_norm
from .swiglu import swiglu
from .transfer import reference_transfer, transfer

__all__ = ["bias_dropout_add", "bias_gelu", "layer_norm", "reference_transfer", "rms_norm",
           "swiglu", "transfer"]
