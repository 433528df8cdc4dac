"""hipkernel: a fused GQA flash-attention prefill kernel (HIP C++, compiled at run time by
hiprtc on AMD and NVRTC on NVIDIA) and a NumPy model of its tiled algorithm.

`hipkernel.attention` runs the kernel on NumPy arrays and returns ``(status, out)``;
`flash_prefill_v3` / `flash_prefill_v2` are the device-buffer entry points (0 or -1);
`hipkernel.model.attention` is the executable spec the kernel follows line by line;
`hipkernel.config.KernelConfig` is a tile configuration and its launch geometry.
"""

from hipkernel.api import attention, decline_reason, flash_prefill_v2, flash_prefill_v3
from hipkernel.config import KernelConfig

__all__ = ["KernelConfig", "attention", "decline_reason", "flash_prefill_v2", "flash_prefill_v3"]
