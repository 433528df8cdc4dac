"""Window-convention converters agree with the visibility predicate they translate."""

import numpy as np
import pytest

from refattn import windows
from refattn.reference import visible


@pytest.mark.parametrize("W", [-1, 1, 2, 7, 128, 4096])
def test_round_trips(W):
    assert windows.from_flash_attention(windows.to_flash_attention(W)) == W
    assert windows.from_flashinfer(windows.to_flashinfer(W)) == W


@pytest.mark.parametrize("left", [-1, 0, 1, 5, 99])
def test_flash_attention_keys_match_ort(left):
    """FA sees p-left <= j <= p; the converted W must show exactly those keys."""
    W = windows.from_flash_attention((left, 0))
    p = np.arange(0, 300)[:, None]
    j = np.arange(0, 300)[None, :]
    fa = (j <= p) & ((left == -1) | (j >= p - left))
    assert np.array_equal(visible(p, j, W), fa)


@pytest.mark.parametrize("window_left", [-1, 0, 3, 127])
def test_flashinfer_keys_match_ort(window_left):
    W = windows.from_flashinfer(window_left)
    p = np.arange(0, 300)[:, None]
    j = np.arange(0, 300)[None, :]
    fi = (j <= p) & ((window_left == -1) | (j >= p - window_left))
    assert np.array_equal(visible(p, j, W), fi)


@pytest.mark.parametrize(
    "call, arg, name",
    [
        (windows.from_flash_attention, (3, 2), "window_size"),
        (windows.from_flash_attention, (-2, 0), "window_size"),
        (windows.from_flash_attention, 5, "window_size"),
        (windows.from_flashinfer, -3, "window_left"),
        (windows.from_flashinfer, 2.5, "window_left"),
        (windows.to_flash_attention, 0, "window"),
        (windows.to_flashinfer, -2, "window"),
    ],
)
def test_bad_input_names_argument(call, arg, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        call(arg)
