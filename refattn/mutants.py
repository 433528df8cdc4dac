"""The mutant catalogue: classic bugs of a fused flash-attention prefill kernel (docs/semantics.md, Mutant catalogue).

Each mutant is one deliberate bug, switchable in both implementations of the kernel's
algorithm: as a flag of the CPU model (``hipkernel.model.attention(..., mutants={name})``)
and as a preprocessor macro of the HIP source (``-D<macro>=1``, tested with ``#ifdef`` at
the one place the bug lives). A case matrix is only as good as the mutants it kills.

This module is pure data: it does not import ``hipkernel``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """One bug: its ``name`` (the model flag), its ``macro`` (the HIP ``-D`` switch) and
    what it ``breaks``, in one line."""

    name: str
    macro: str
    breaks: str
    # Set when the bug cannot change an fp16 output on any input (an "equivalent mutant" in
    # mutation-testing terms), with the argument. It is still built and run; a survivor
    # with this set does not fail the kill matrix, and the report shows why.
    equivalent: str | None = None


def _m(name: str, breaks: str, equivalent: str | None = None) -> Mutant:
    return Mutant(name, f"HIPKERNEL_MUTANT_{name.upper()}", breaks, equivalent)


MUTANTS: tuple[Mutant, ...] = (
    _m("no_nan_guard",
       "the all-masked-tile guard is removed: exp2(-inf - -inf) = NaN poisons a row that has seen nothing yet"),
    _m("clamp_plus_one_tile",
       "the KV loop starts one tile after kv_start's tile, skipping keys rows can see"),
    _m("clamp_from_last_row",
       "the start tile is computed from the Q tile's last row, so earlier rows lose window keys"),
    _m("window_mask_off_by_one",
       "the window mask is j >= p - W, so W + 1 keys are visible"),
    _m("sink_ignored",
       "the epilogue leaves the sink (and smooth softmax's zero logit) out of the denominator"),
    _m("sink_no_log2e",
       "the sink logit enters exp2 space without the log2(e) factor"),
    _m("sink_per_tile",
       "the sink is added to the denominator once per KV tile walked (split-KV bug), not once per row"),
    _m("smooth_ignored",
       "smooth softmax (sink_mode 2, sigma = 0) is treated as no sink"),
    _m("past_len_ignored",
       "query row i sits at position i instead of past_len + i: top-left causal alignment"),
    _m("gqa_modulo",
       "query head h reads KV head h % Hkv instead of h // G"),
    _m("tail_unmasked",
       "the last partial KV tile is loaded raw past Skv; the cache padding's NaN canaries leak into P.V"),
    _m("sink_max_skipped",
       "the final max ignores the sink, so exp2(sigma*log2e - m) overflows for large sinks",
       equivalent="m_fin only scales acc and l by a common factor unless exp2(sig2 - m) overflows "
                  "(sig2 - m >= 128); then the true output is below 2^16 * n_keys * 2^-128, far "
                  "under fp16's smallest subnormal 2^-24, so both round to 0. Not observable at "
                  "fp16 output; tests/test_model.py pins this with sinks up to 6e4."),
    _m("sink_unshifted",
       "the sink enters the denominator as exp2(sigma*log2e) without subtracting the running "
       "max: wrong weights, and inf (output 0) for large sinks"),
    _m("head_tile_crosses_group",
       "a tile of 16 query heads reads the KV head of its first head, (h & ~15) // G: wrong "
       "wherever a KV group boundary falls inside the tile (G = 12, 24; G < 16 with Hkv > 1)"),
    _m("window_skip_off",
       "the KV loop starts at key 0, not at the window's first tile, and loads what it walks: "
       "exact zeros on finite data, 0 * NaN = NaN from a non-finite V left of the window"),
    _m("max_floor",
       "the running max starts at a finite floor (-1e4 in exp2 units) instead of -inf: a row "
       "whose logits all lie far below it gets p = 0, l = 0 and output 0"),
    _m("ragged_max_diag",
       "in a ragged batch every sequence takes the longest sequence's lengths: row i sits at "
       "max_b(past_len[b]) + i and reads keys up to max_b(past_len[b] + q_len[b]), past its "
       "own cache (a diagonal from the batch's maximum)"),
    _m("padded_row_next_seq",
       "a padded row (i >= q_len[b]) is computed as a row at past_len[b] + i against the next "
       "sequence's cache (b + 1 mod B) and stored, instead of written as zeros"),
    _m("padding_not_written",
       "padded rows (i >= q_len[b]) are skipped: the output keeps what it held there"),
    _m("bf16_p_as_fp16",
       "in a bf16 kernel P is converted with the fp16 conversion and read back as bf16 by P.V: "
       "every weight's bit pattern is an fp16 one taken for a bf16 one"),
)

_BY_NAME = {m.name: m for m in MUTANTS}


def by_name(name: str) -> Mutant:
    """The mutant called ``name``; ValueError (naming ``mutant``) for an unknown name."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"mutant: unknown mutant {name!r}; known: {', '.join(_BY_NAME)}"
        ) from None
