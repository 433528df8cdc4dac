"""Writing results so that none is lost: output paths checked before the work, atomic writes,
JSON without non-finite numbers.

* :func:`check_output_file` / :func:`check_output_dir` are called by every command before it
  runs anything: a path that cannot be written (a directory given as a file, a parent that is
  a file, a directory without write permission) is a usage error naming the argument, not a
  traceback after an hour of cases. A missing parent directory is created then, not later.
* :func:`atomic_write_text` writes a temporary file in the target's own directory and renames
  it over the target (``os.replace``, atomic on POSIX and Windows), so a reader polling the
  file sees the old content or the new one, never a half-written or empty file.
* :func:`json_text` is ``json.dumps(..., allow_nan=False)`` that cannot fail on a float: a
  non-finite float (a relL2 of inf from a kernel that returned 1e38) becomes ``null`` and the
  path of every such value is listed under the top-level key ``"nonfinite"`` with what it was,
  so a reader sees why the number is missing.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path that cannot be written; the message starts with the argument's name."""


def _writable_dir(name: str, d: Path, create: bool) -> None:
    if d.exists():
        if not d.is_dir():
            raise OutputPathError(f"{name}: {d} is not a directory")
    else:
        # the nearest existing ancestor must be a writable directory
        anc = d
        while not anc.exists():
            if anc.parent == anc:
                break
            anc = anc.parent
        if not anc.is_dir():
            raise OutputPathError(f"{name}: cannot create {d}: {anc} is not a directory")
        if not create:
            return
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputPathError(f"{name}: cannot create directory {d}: {e.strerror or e}") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise OutputPathError(f"{name}: directory {d} is not writable")


def check_output_file(name: str, path) -> Path:
    """``path`` as a file that can be written (its parent created if missing); else
    :class:`OutputPathError` naming ``name``. ``-`` (standard output) is returned as is."""
    if str(path) == "-":
        return Path("-")
    p = Path(path)
    if str(path).endswith(os.sep) or p.is_dir():
        raise OutputPathError(f"{name}: {p} is a directory, expected a file path")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputPathError(f"{name}: {p} is not writable")
    anc = p.parent
    while not anc.exists() and anc.parent != anc:
        anc = anc.parent
    if anc.exists() and not anc.is_dir():
        raise OutputPathError(f"{name}: cannot write {p}: {anc} is not a directory")
    _writable_dir(name, p.parent, create=True)
    return p


def check_output_dir(name: str, path) -> Path:
    """``path`` as a directory that can be written into (created if missing); else
    :class:`OutputPathError` naming ``name``."""
    p = Path(path)
    _writable_dir(name, p, create=True)
    return p


def atomic_write_text(path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same directory and a
    rename. The temporary file is removed if anything fails."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path, data: bytes, *, prefix: str | None = None) -> Path:
    """:func:`atomic_write_text` for bytes; ``prefix`` names the temporary file (default
    ``.<name>.``)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = p.stat().st_mode & 0o777 if p.exists() else 0o666 & ~_umask()
            os.chmod(tmp, mode)
        except OSError:
            pass
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _finite_copy(obj, where: str, found: dict):
    if isinstance(obj, float) and not math.isfinite(obj):
        found[where or "$"] = "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
        return None
    if isinstance(obj, dict):
        return {k: _finite_copy(v, f"{where}.{k}" if where else str(k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_copy(v, f"{where}[{i}]", found) for i, v in enumerate(obj)]
    return obj


def finite_json(doc):
    """``doc`` with every non-finite float replaced by ``None``, and a dict ``{path: "inf" |
    "-inf" | "nan"}`` of what was replaced (paths like ``results[3].rel_l2``)."""
    found: dict[str, str] = {}
    return _finite_copy(doc, "", found), found


def json_text(doc: dict, indent: int | None = 2) -> str:
    """``doc`` as JSON text with no NaN or Infinity: each non-finite float is written as
    ``null`` and listed under ``"nonfinite"`` (``{path: "inf"}``) with the reason."""
    clean, found = finite_json(doc)
    if found and isinstance(clean, dict):
        clean["nonfinite"] = {"why": "JSON has no NaN or Infinity: these values are null here",
                              "values": found}
    return json.dumps(clean, indent=indent, allow_nan=False) + "\n"


__all__ = ["OutputPathError", "atomic_write_bytes", "atomic_write_text", "check_output_dir", "check_output_file",
           "finite_json", "json_text"]
