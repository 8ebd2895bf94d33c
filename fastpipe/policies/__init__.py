"""Stage policies: how a stage keeps, recomputes, offloads, scales or shares what it computes.

``checkpoint`` (modes, recompute, RNG replay), ``selective`` (selective recompute), ``offload``
(saved tensors in host memory), ``amp`` (autocast across threads, loss scaling), ``batchnorm``
(deferred batch norm), ``tied`` (tied weights across stages) and ``compile`` (stages compiled
with ``torch.compile`` in place, compiled models unwrapped to their plain names). They depend
on torch and the native ops only, never on the runtime or the front doors that apply them.
"""
