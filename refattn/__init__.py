"""refattn: a numerical verification harness for fused GQA flash-attention prefill kernels.

`refattn.attention` is the fp32/fp64 reference (sinks, smooth softmax, sliding windows,
chunked prefill over a KV cache); `refattn.oracle` validates it in mpmath; the rest of the
package turns it into a case matrix that runs any kernel against it.
"""

from refattn.reference import attention, attention_lowp, attention_with_baseline, visible

__all__ = ["attention", "attention_lowp", "attention_with_baseline", "visible"]
__version__ = "0.1.0"
