"""Adapters for the attention implementations others ship, built into the harness.

Each module wraps one family behind the adapter protocol of :mod:`refattn.kernels`, so the
matrix, the fuzzer and the bench check it like any other kernel:

* :mod:`refattn.adapters.ort`: ONNX Runtime's ``com.microsoft::GroupQueryAttention`` on any
  execution provider (``ort:cpu``, ``ort:cuda``, a provider's name, a plugin EP library);
* :mod:`refattn.adapters.cabi`: a C entry point with the ``_v3`` ABI, through ctypes, on host
  or device memory (docs/c-abi.md);
* :mod:`refattn.adapters.torch_peers`: torch's SDPA (flash and cuDNN backends), FlexAttention
  with the sink folded in through the LSE, and FlashAttention-4's ``learnable_sink``; the
  peers ``refattn bench`` times a kernel against.

Each is registered under a short name in the entry-point group ``refattn.kernels``
(``refattn kernels`` lists them) and imports its third-party package only when first used.
"""
