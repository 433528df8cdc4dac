"""Ragged-batch conventions and converters.

This project describes a ragged batch by two integer arrays of shape (B,) (docs/semantics.md,
Ragged batches): ``past_len[b]``, the keys sequence b had cached before the chunk, and
``q_len[b]``, its valid query rows, right-padded to ``Sq``. Row i of sequence b sits at the
absolute position ``past_len[b] + i`` and sees keys ``j <= past_len[b] + i`` of its own cache
``k[b]`` (BNSH, ``(B, Hkv, S_cap, d)``), which holds ``past_len[b] + q_len[b]`` keys of its
own; slots past that length are not the sequence's and are never read.

Other libraries describe the same batch differently:

* ONNX Runtime ``com.microsoft::GroupQueryAttention``: ``seqlens_k`` (int32, (B,)) is each
  sequence's **total length minus one**, ``total_sequence_length`` (one int32) the longest
  total length. Right padding. ``past_key`` is BNSH ``(B, Hkv, S_past, d)``; sequence b's
  cached keys are its first ``past_len[b]`` slots and ``present_key`` (the cache after the
  chunk, this project's ``k``) receives the chunk's ``Sq`` keys at
  ``[past_len[b], past_len[b] + Sq)``. ORT derives the geometry as::

      first prompt (Sq == total_sequence_length):  past_len[b] = 0,
                                                   q_len[b] = seqlens_k[b] + 1
      otherwise:                                   past_len[b] = seqlens_k[b] + 1 - Sq,
                                                   q_len[b] = Sq

  so padded query rows exist only in a first prompt, and after it every sequence takes Sq
  rows; with ``Sq > 1`` and a past, ORT takes a batch of one.

* FlashAttention ``flash_attn_with_kvcache``: ``cache_seqlens`` (int32, (B,)) is each
  sequence's KV length, ``past_len[b]`` when the call appends the chunk's ``k, v`` itself,
  ``past_len[b] + Sq`` when the cache already holds them. Every query row is valid (no
  ``q_len``); causal masking is bottom-right, row i seeing ``j <= seqlen_k[b] - Sq + i``.
* FlashAttention varlen (``flash_attn_varlen_func``): q and k are packed without padding,
  ``(total, H, d)``, sequence b's rows ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` and keys
  ``[cu_seqlens_k[b], cu_seqlens_k[b + 1])`` (int32 prefix sums, ``cu[0] = 0``); bottom-right
  causal, so ``past_len[b] = len_k[b] - len_q[b]``. ``seqused_k`` (int32, (B,)) instead names
  how many keys of each sequence's (padded or packed) cache are used: ``past_len + q_len``.

Every converter validates its arguments and raises ``ValueError`` naming the offending one.
"""

from __future__ import annotations

import numbers

import numpy as np

from refattn.args import MAX_LENGTH, check_lengths


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _count(name: str, x, low: int = 0) -> int:
    if not _is_int(x) or int(x) < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {x!r}")
    return int(x)


def _what(x) -> str:
    return type(x).__name__ + (f" of shape {x.shape}" if isinstance(x, np.ndarray) else "")


def _batch(past_len, q_len) -> int:
    """B, from the first of ``past_len``, ``q_len`` that is a 1-D array."""
    for x in (past_len, q_len):
        if isinstance(x, np.ndarray) and x.ndim == 1:
            return len(x)
    if q_len is not None:
        raise ValueError(f"q_len: expected an integer numpy.ndarray of shape (B,), got "
                         f"{_what(q_len)}")
    alone = " (an int alone gives no batch size)" if _is_int(past_len) else ""
    raise ValueError(f"past_len: expected an integer numpy.ndarray of shape (B,){alone}, got "
                     f"{_what(past_len)}")


def _vector(name: str, x) -> np.ndarray:
    """A 1-D integer array of lengths (the converters' inputs), int64, entries >= 0."""
    if not isinstance(x, np.ndarray) or x.ndim != 1:
        raise ValueError(f"{name}: expected an integer numpy.ndarray of shape (B,), got "
                         f"{_what(x)}")
    return check_lengths(name, x, len(x))


def _int32(name: str, x: np.ndarray) -> np.ndarray:
    if x.size and int(x.max()) > MAX_LENGTH:
        raise ValueError(f"{name}: {int(x.max())} does not fit the int32 it is carried in")
    return x.astype(np.int32)


def lengths(past_len, q_len=None, Sq: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """This project's ragged description as two int64 arrays ``(past_len, q_len)`` of shape
    (B,). ``past_len``: an int (the same for every sequence) or an integer array (B,);
    ``q_len``: an integer array (B,), or None for ``Sq`` rows each (then ``Sq`` is needed and
    ``past_len`` must be an array). With ``Sq``, every ``q_len[b] <= Sq`` is checked."""
    B = _batch(past_len, q_len)
    if _is_int(past_len):
        past = np.full(B, _count("past_len", past_len), dtype=np.int64)
    else:
        past = check_lengths("past_len", past_len, B)
    if Sq is not None:
        Sq = _count("Sq", Sq, 1)
    if q_len is None:
        if Sq is None:
            raise ValueError("Sq: expected an int >= 1 when q_len is not given")
        qs = np.full(B, Sq, dtype=np.int64)
    else:
        qs = check_lengths("q_len", q_len, B)
        if Sq is not None and (qs > Sq).any():
            b = int(np.flatnonzero(qs > Sq)[0])
            raise ValueError(f"q_len: expected entries <= Sq = {Sq}, got {int(qs[b])} for "
                             f"sequence {b}")
    return past, qs


# ------------------------------------------------------------------------ ONNX Runtime


def to_ort(past_len, q_len, Sq: int) -> tuple[np.ndarray, int]:
    """``(past_len, q_len)`` over ``Sq`` query rows -> ORT's ``(seqlens_k, total_sequence_length)``.

    ``seqlens_k[b] = past_len[b] + q_len[b] - 1`` (int32) and ``total_sequence_length =
    max_b(past_len[b] + q_len[b])``. ORT can express a batch only in one of its two forms
    (module docstring): a first prompt (every ``past_len[b] = 0``, ``1 <= q_len[b] <= Sq``,
    some ``q_len[b] = Sq``), or full chunks (every ``q_len[b] = Sq``, and ``B = 1`` unless
    ``Sq = 1``). Anything else raises ``ValueError``: ORT would read it differently."""
    past, qs = lengths(past_len, q_len, Sq)
    B = len(past)
    if not past.any():
        if not qs.all():
            b = int(np.flatnonzero(qs == 0)[0])
            raise ValueError(f"q_len: ORT has no empty sequence (seqlens_k = -1) in a first "
                             f"prompt, got q_len = 0 for sequence {b}")
        if int(qs.max()) != Sq:
            raise ValueError(f"q_len: in a first prompt ORT takes Sq = total_sequence_length, "
                             f"so the longest sequence must fill Sq = {Sq}; got "
                             f"max(q_len) = {int(qs.max())}")
        return _int32("seqlens_k", qs - 1), Sq
    if (qs != Sq).any():
        b = int(np.flatnonzero(qs != Sq)[0])
        raise ValueError(f"q_len: with a past, ORT takes Sq rows of every sequence (padded "
                         f"rows exist only in a first prompt); got q_len = {int(qs[b])} != "
                         f"Sq = {Sq} for sequence {b}")
    if Sq > 1 and B != 1:
        raise ValueError(f"past_len: ORT takes a batch of one when Sq > 1 and a past is given "
                         f"(a subsequent prompt); got B = {B}, Sq = {Sq}")
    total = past + Sq
    return _int32("seqlens_k", total - 1), int(_int32("total_sequence_length", total).max())


def from_ort(seqlens_k, total_sequence_length, Sq: int) -> tuple[np.ndarray, np.ndarray]:
    """ORT's ``(seqlens_k, total_sequence_length)`` over ``Sq`` query rows -> ``(past_len,
    q_len)``, int64 (B,), as ORT reads them: a first prompt when ``Sq ==
    total_sequence_length`` (``past_len = 0``, ``q_len = seqlens_k + 1``), else full chunks
    (``past_len = seqlens_k + 1 - Sq``, ``q_len = Sq``). Every ``seqlens_k[b] + 1 <=
    total_sequence_length`` is required."""
    Sq = _count("Sq", Sq, 1)
    sk = _vector("seqlens_k", seqlens_k)
    total = _count("total_sequence_length", total_sequence_length, 1)
    if int(sk.max()) + 1 > total:
        b = int(np.argmax(sk))
        raise ValueError(f"total_sequence_length: {total} is shorter than sequence {b}'s "
                         f"seqlens_k + 1 = {int(sk[b]) + 1}")
    B = len(sk)
    if Sq == total:
        return np.zeros(B, dtype=np.int64), sk + 1
    if Sq > 1 and B != 1:
        raise ValueError(f"seqlens_k: ORT takes a batch of one when Sq = {Sq} > 1 and "
                         f"Sq != total_sequence_length = {total}; got B = {B}")
    past = sk + 1 - Sq
    if (past < 0).any():
        b = int(np.flatnonzero(past < 0)[0])
        raise ValueError(f"seqlens_k: sequence {b} has seqlens_k + 1 = {int(sk[b]) + 1} keys, "
                         f"fewer than the Sq = {Sq} rows of a chunk after the first prompt")
    return past, np.full(B, Sq, dtype=np.int64)


# ------------------------------------------------------------------------ FlashAttention


def to_cache_seqlens(past_len, Sq: int, *, appended: bool = True) -> np.ndarray:
    """``past_len`` (B,) -> FlashAttention ``flash_attn_with_kvcache``'s ``cache_seqlens``,
    int32 (B,): ``past_len + Sq`` when the cache already holds the chunk (``appended``,
    this project's ``k``), ``past_len`` when the call appends the chunk's ``k, v`` itself.
    Every query row is valid there: a batch with padded rows has no ``cache_seqlens``."""
    past, _ = lengths(past_len, None, Sq)
    return _int32("cache_seqlens", past + Sq if appended else past)


def from_cache_seqlens(cache_seqlens, Sq: int, *, appended: bool = True) -> np.ndarray:
    """FlashAttention's ``cache_seqlens`` (B,) -> ``past_len`` int64 (B,): ``cache_seqlens -
    Sq`` when the cache holds the chunk (``appended``), else ``cache_seqlens``. ``q_len`` is
    ``Sq`` for every sequence."""
    Sq = _count("Sq", Sq, 1)
    cs = _vector("cache_seqlens", cache_seqlens)
    if not appended:
        return cs
    if (cs < Sq).any():
        b = int(np.flatnonzero(cs < Sq)[0])
        raise ValueError(f"cache_seqlens: sequence {b} holds {int(cs[b])} keys, fewer than "
                         f"the chunk's Sq = {Sq} it already holds")
    return cs - Sq


def to_seqused_k(past_len, q_len) -> np.ndarray:
    """``(past_len, q_len)`` -> FlashAttention's ``seqused_k``, int32 (B,): the keys of each
    sequence's cache that are used, ``past_len + q_len``."""
    past, qs = lengths(past_len, q_len)
    return _int32("seqused_k", past + qs)


def from_seqused_k(seqused_k, q_len) -> np.ndarray:
    """FlashAttention's ``seqused_k`` (B,) and each sequence's query rows ``q_len`` (B,) (from
    ``cu_seqlens_q`` or ``seqused_q``) -> ``past_len = seqused_k - q_len``, int64 (B,)."""
    used = _vector("seqused_k", seqused_k)
    qs = check_lengths("q_len", q_len, len(used))
    if (used < qs).any():
        b = int(np.flatnonzero(used < qs)[0])
        raise ValueError(f"seqused_k: sequence {b} uses {int(used[b])} keys, fewer than its "
                         f"q_len = {int(qs[b])} rows (past_len would be negative)")
    return used - qs


def to_cu_seqlens(seqlens) -> np.ndarray:
    """Per-sequence lengths (B,) -> their prefix sums ``cu_seqlens``, int32 (B + 1,),
    ``cu[0] = 0``, ``cu[b + 1] = cu[b] + seqlens[b]``: sequence b's packed rows are
    ``[cu[b], cu[b + 1])``."""
    n = _vector("seqlens", seqlens)
    return _int32("cu_seqlens", np.concatenate([[0], np.cumsum(n)]).astype(np.int64))


def from_cu_seqlens(cu_seqlens, name: str = "cu_seqlens") -> np.ndarray:
    """Prefix sums ``cu_seqlens`` (B + 1,) -> per-sequence lengths ``cu[b + 1] - cu[b]``,
    int64 (B,). ``cu[0]`` must be 0 and the sums non-decreasing."""
    if not isinstance(cu_seqlens, np.ndarray) or cu_seqlens.ndim != 1 or len(cu_seqlens) < 2:
        raise ValueError(f"{name}: expected an integer numpy.ndarray of shape (B + 1,), B >= 1, "
                         f"got {_what(cu_seqlens)}")
    cu = check_lengths(name, cu_seqlens, len(cu_seqlens))
    if cu[0] != 0:
        raise ValueError(f"{name}: expected {name}[0] = 0, got {int(cu[0])}")
    n = np.diff(cu)
    if (n < 0).any():
        b = int(np.flatnonzero(n < 0)[0])
        raise ValueError(f"{name}: expected non-decreasing prefix sums, got {name}[{b + 1}] = "
                         f"{int(cu[b + 1])} < {name}[{b}] = {int(cu[b])}")
    return n


def to_varlen(past_len, q_len) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(past_len, q_len)`` -> FlashAttention varlen's ``(cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k)``: ``cu_seqlens_q`` the prefix sums of ``q_len``,
    ``cu_seqlens_k`` those of ``past_len + q_len`` (each sequence's packed keys, its cache
    included), and the two maxima."""
    past, qs = lengths(past_len, q_len)
    return (to_cu_seqlens(qs), to_cu_seqlens(past + qs), int(qs.max()), int((past + qs).max()))


def from_varlen(cu_seqlens_q, cu_seqlens_k) -> tuple[np.ndarray, np.ndarray]:
    """FlashAttention varlen's ``(cu_seqlens_q, cu_seqlens_k)`` -> ``(past_len, q_len)``,
    int64 (B,): ``q_len = len_q``, ``past_len = len_k - len_q`` (bottom-right causal
    alignment). A sequence with fewer keys than rows has no ``past_len >= 0`` and is refused."""
    qs = from_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    ks = from_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if len(ks) != len(qs):
        raise ValueError(f"cu_seqlens_k: expected shape ({len(qs) + 1},) like cu_seqlens_q, "
                         f"got ({len(ks) + 1},)")
    if (ks < qs).any():
        b = int(np.flatnonzero(ks < qs)[0])
        raise ValueError(f"cu_seqlens_k: sequence {b} has {int(ks[b])} keys, fewer than its "
                         f"{int(qs[b])} query rows (past_len would be negative)")
    return ks - qs, qs


# ------------------------------------------------------------------------ pack / unpack


def _array(name: str, x, min_rank: int) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim < min_rank:
        raise ValueError(f"{name}: expected a numpy.ndarray of rank >= {min_rank}, got "
                         f"{_what(x)}")
    return x


def pack_rows(x, q_len) -> np.ndarray:
    """Padded ``x: (B, Sq, ...)`` (q or an output) -> packed ``(sum(q_len), ...)``: sequence
    b's rows ``x[b, :q_len[b]]`` at ``[cu[b], cu[b + 1])``, ``cu = to_cu_seqlens(q_len)``;
    padded rows are dropped."""
    x = _array("x", x, 2)
    B, Sq = x.shape[:2]
    _, qs = lengths(np.zeros(B, np.int64), q_len, Sq)
    return np.concatenate([x[b, :qs[b]] for b in range(B)], axis=0)


def unpack_rows(packed, q_len, Sq: int, fill: float = 0.0) -> np.ndarray:
    """Packed ``(sum(q_len), ...)`` -> padded ``(B, Sq, ...)``, the inverse of
    :func:`pack_rows`; padded rows (``i >= q_len[b]``) hold ``fill``."""
    packed = _array("packed", packed, 1)
    qs = _vector("q_len", q_len)
    _, qs = lengths(np.zeros(len(qs), np.int64), qs, Sq)
    if packed.shape[0] != int(qs.sum()):
        raise ValueError(f"packed: expected sum(q_len) = {int(qs.sum())} rows, got "
                         f"{packed.shape[0]}")
    out = np.full((len(qs), Sq) + packed.shape[1:], fill, dtype=packed.dtype)
    cu = to_cu_seqlens(qs)
    for b in range(len(qs)):
        out[b, :qs[b]] = packed[cu[b]:cu[b + 1]]
    return out


def pack_kv(k, seqlens) -> np.ndarray:
    """A BNSH cache ``k: (B, Hkv, S_cap, d)`` -> FlashAttention varlen's packed ``(sum(seqlens),
    Hkv, d)``: sequence b's first ``seqlens[b]`` keys (``past_len[b] + q_len[b]``) at
    ``[cu[b], cu[b + 1])``, ``cu = to_cu_seqlens(seqlens)``; slots past a sequence's length
    are dropped."""
    k = _array("k", k, 4)
    if k.ndim != 4:
        raise ValueError(f"k: expected rank 4 (B, Hkv, S_cap, d), got shape {k.shape}")
    B, _, S_cap, _ = k.shape
    n = check_lengths("seqlens", seqlens, B)
    if (n > S_cap).any():
        b = int(np.flatnonzero(n > S_cap)[0])
        raise ValueError(f"seqlens: sequence {b} has {int(n[b])} keys, more than "
                         f"k.shape[2] = {S_cap}")
    return np.concatenate([k[b, :, :n[b]].transpose(1, 0, 2) for b in range(B)], axis=0)


def unpack_kv(packed, seqlens, S_cap: int, fill: float = 0.0) -> np.ndarray:
    """Packed ``(sum(seqlens), Hkv, d)`` -> a BNSH cache ``(B, Hkv, S_cap, d)``, the inverse
    of :func:`pack_kv`; slots at or past a sequence's length hold ``fill`` (NaN makes them
    canaries)."""
    packed = _array("packed", packed, 3)
    if packed.ndim != 3:
        raise ValueError(f"packed: expected rank 3 (total, Hkv, d), got shape {packed.shape}")
    n = _vector("seqlens", seqlens)
    S_cap = _count("S_cap", S_cap, 1)
    if (n > S_cap).any():
        b = int(np.flatnonzero(n > S_cap)[0])
        raise ValueError(f"S_cap: {S_cap} is shorter than sequence {b}'s {int(n[b])} keys")
    if packed.shape[0] != int(n.sum()):
        raise ValueError(f"packed: expected sum(seqlens) = {int(n.sum())} keys, got "
                         f"{packed.shape[0]}")
    _, Hkv, d = packed.shape
    out = np.full((len(n), Hkv, S_cap, d), fill, dtype=packed.dtype)
    cu = to_cu_seqlens(n)
    for b in range(len(n)):
        out[b, :, :n[b]] = packed[cu[b]:cu[b + 1]].transpose(1, 0, 2)
    return out


class PerSequence:
    """The per-sequence lengths of a batch described by ``B``, ``sq``, ``past_len`` (an int,
    or a tuple of B ints) and ``q_len`` (None, or a tuple of B ints): the properties that
    ``refattn.cases.Case`` and ``refattn.bench.Shape`` share."""

    @property
    def ragged(self) -> bool:
        """True when the sequences have their own lengths (``past_len`` a tuple, or ``q_len``)."""
        return isinstance(self.past_len, tuple) or self.q_len is not None

    @property
    def past_lens(self) -> tuple[int, ...]:
        """Each sequence's ``past_len`` (B entries; all equal in a uniform batch)."""
        return self.past_len if isinstance(self.past_len, tuple) else (self.past_len,) * self.B

    @property
    def q_lens(self) -> tuple[int, ...]:
        """Each sequence's valid query rows (B entries; ``sq`` each unless ``q_len`` is given)."""
        return self.q_len if self.q_len is not None else (self.sq,) * self.B
