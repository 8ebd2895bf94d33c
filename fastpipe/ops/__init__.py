"""fastpipe's operators: native (``torch.ops.fastpipe``) where built, pure PyTorch otherwise."""
from .transfer import reference_transfer, transfer

__all__ = ["reference_transfer", "transfer"]
