"""Sliding-window conventions and converters.

This project uses ONNX Runtime's convention (GroupQueryAttention ``local_window_size``):
``W`` keys are visible, the query's own key included::

    visible(p, j) = p - W + 1 <= j <= p        (W = -1: causal only, j <= p)

Other libraries count the window differently:

* FlashAttention ``window_size=(left, right)``: ``p - left <= j <= p + right``; ``left = -1``
  means unbounded. Causal attention has ``right = 0``, so it sees ``left + 1`` keys::

      W = left + 1            (left = -1  ->  W = -1)
      (left, right) = (W - 1, 0)

* FlashInfer ``window_left``: ``p - window_left <= j <= p``, ``-1`` = no window::

      W = window_left + 1     (window_left = -1  ->  W = -1)
      window_left = W - 1

Only causal windows exist here (``right = 0``); a look-ahead window raises ``ValueError``.
"""

from __future__ import annotations

import numbers


def _int(name: str, x) -> int:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool):
        raise ValueError(f"{name}: expected an int, got {x!r}")
    return int(x)


def check_window(window) -> int:
    """Validate an ORT window: -1 (none) or W >= 1."""
    w = _int("window", window)
    if w == 0 or w < -1:
        raise ValueError(f"window: expected -1 (no window) or W >= 1 keys, got {w}")
    return w


def from_flash_attention(window_size) -> int:
    """FlashAttention ``(left, right)`` -> ORT ``W``."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a (left, right) pair, got {window_size!r}") from None
    left, right = _int("window_size", left), _int("window_size", right)
    if left < -1:
        raise ValueError(f"window_size: left must be -1 (unbounded) or >= 0, got {left}")
    if right != 0:
        raise ValueError(f"window_size: right must be 0 (causal; no look-ahead here), got {right}")
    return -1 if left == -1 else left + 1


def to_flash_attention(window) -> tuple[int, int]:
    """ORT ``W`` -> FlashAttention ``(left, right)``."""
    w = check_window(window)
    return (-1, 0) if w == -1 else (w - 1, 0)


def from_flashinfer(window_left) -> int:
    """FlashInfer ``window_left`` -> ORT ``W``."""
    left = _int("window_left", window_left)
    if left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or >= 0, got {left}")
    return -1 if left == -1 else left + 1


def to_flashinfer(window) -> int:
    """ORT ``W`` -> FlashInfer ``window_left``."""
    w = check_window(window)
    return -1 if w == -1 else w - 1
