"""Atomic writes and resumable JSONL record files: one implementation for every package and benchmark.

Every file or folder litctx writes for later reading goes through :func:`atomic_path` (or :func:`atomic_open`,
built on it): the new content is written inside a private staging folder next to the target, on the same file
system, and renamed into place only when complete. A reader (or a rerun after a kill) sees the old content or
the new content, never a part of it. The staging folder is hidden (``.<name>.<random>.tmp``) and removed on
every exit Python sees (a clean one or an exception); a process killed by SIGKILL leaves it behind, hidden,
where readers pass over it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Tuple

from litctx_common.errors import DataError

__all__ = ["section_markers", "write_markdown_section", "read_text_file", "looks_binary", "TextFileError",
           "encoding_problem", "atomic_path", "atomic_open", "atomic_write_text", "atomic_write_bytes", "append_jsonl",
           "read_jsonl", "jsonl_lines"]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, target: Path, keep_existing: bool, aside: Path) -> None:
    """Move the finished ``tmp`` (a file or a folder) to ``target``."""
    if tmp.is_file() and not tmp.is_symlink():
        _fsync_file(tmp)
    try:
        os.replace(tmp, target)  # atomic: a file over a file, or anything onto a free name or an empty folder
        return
    except OSError:
        if not (target.exists() or target.is_symlink()):
            raise
        if keep_existing:  # another writer finished the same entry first; its content stays
            return
    # rename() cannot replace a non-empty folder (or a folder by a file): move the old one aside, into the
    # staging folder that is removed afterwards, then rename the new one in. A reader can find nothing at
    # ``target`` for an instant, never a partly written entry.
    os.replace(target, aside)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(aside, target)  # put the old entry back: the staging folder (with ``aside``) is removed next
        raise


@contextlib.contextmanager
def atomic_path(path: Any, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a fresh path with the same name as ``path`` for a writer that takes a path (``fig.savefig``,
    ``np.save``, ``raw.save``, ``save_pretrained``, ``to_zarr``); on a clean exit it is moved over ``path``.

    The yielded path does not exist yet; the caller creates a file or a folder there (the full name, suffixes
    included, is kept, for writers that choose a format by the name). On a clean exit a file is synced and
    renamed over ``path`` (atomic); a folder is renamed into place (atomic when ``path`` does not exist; an
    existing folder is moved aside first and deleted). On an exception nothing changes at ``path``.

    Args:
        path: the target file or folder; its parent folders are created.
        keep_existing: when a folder that the rename cannot replace already stands at ``path`` (another
            process finished the same entry first), keep it and discard what was written here.

    Raises:
        FileNotFoundError: the block exited cleanly without creating anything at the yielded path.
    """
    target = Path(os.fspath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    tmp = staging / target.name
    try:
        yield tmp
        if not (tmp.exists() or tmp.is_symlink()):
            raise FileNotFoundError(f"atomic_path({target}): the block wrote nothing at {tmp}")
        _commit(tmp, target, keep_existing, staging / f"{target.name}.old")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def atomic_open(path: Any, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """``open(path, mode, **kwargs)`` for writing, atomically: the file object writes a temporary file next to
    ``path``, which on a clean exit is flushed, synced and renamed over ``path``; on an exception it is removed.

    ``mode`` is a write mode (``"w"``, ``"wb"``, ``"w+"``, ...; ``"x"`` modes too, which still replace an
    existing file at the end); ``kwargs`` go to :func:`open` (``encoding``, ``newline``).
    """
    if not mode or mode[0] not in "wx" or "a" in mode:
        raise ValueError(f"atomic_open(mode={mode!r}): expected a write mode such as 'w', 'wb', 'w+' or 'x' "
                         "(an atomic write always writes the whole file)")
    with atomic_path(path) as tmp:
        with open(tmp, mode, **kwargs) as f:
            yield f
        # closed (hence flushed); atomic_path's commit syncs it once before the rename


def atomic_write_text(path: Any, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


def atomic_write_bytes(path: Any, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def section_markers(name: str) -> tuple:
    """The start and end markers of a generated section of a markdown page (``docs/results.md``)."""
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def write_markdown_section(path: Any, name: str, body: str, heading: str) -> str:
    """Replace the text between ``name``'s markers in the page at ``path`` (or append a new ``## heading``
    section holding them), atomically; returns the section."""
    start, end = section_markers(name)
    section = f"{start}\n{body.strip()}\n{end}"
    path = Path(path)
    current = path.read_text() if path.exists() else "# Results\n"
    if start in current and end in current:
        head, rest = current.split(start, 1)
        new = head + section + rest.split(end, 1)[1]
    else:
        new = current.rstrip() + f"\n\n## {heading}\n\n{section}\n"
    atomic_write_text(path, new)
    return section


def append_jsonl(path: Any, records: Iterable[Any]) -> None:
    """Append one JSON line per record to ``path`` (created with its folder) and sync it: a kill loses at
    most the line being written, which :func:`read_jsonl` skips (resumable result files). A line cut by an
    earlier kill is ended first, so the first new record starts a line of its own."""
    target = Path(os.fspath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    cut = False
    if target.is_file() and target.stat().st_size:
        with open(target, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with open(target, "a", encoding="utf-8") as f:
        if cut:
            f.write("\n")
        for rec in records:
            f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Any, key: Optional[Callable[[Dict[str, Any]], Hashable]] = None) -> List[Dict[str, Any]]:
    """Records of a file written by :func:`append_jsonl` (none when it does not exist), skipping a line cut by a
    kill. With ``key``, one record per key: the last written (a rerun supersedes an earlier record), in the
    order each key was first written."""
    target = Path(os.fspath(path))
    if not target.is_file():
        return []
    records = []
    for line in target.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if key is None:
        return records
    return list({key(r): r for r in records}.values())


_TEXT_CONTROLS = set(range(32)) - {9, 10, 12, 13}  # control bytes that plain text does not hold (tab, newlines, form feed do)


def looks_binary(data: bytes) -> bool:
    """Whether ``data`` (a file's first bytes) is binary rather than text: a NUL byte, or more than 10% control
    bytes other than tab, newlines and form feed."""
    head = data[:8192]
    if b"\x00" in head:
        return True
    return bool(head) and sum(b in _TEXT_CONTROLS for b in head) > 0.1 * len(head)


class TextFileError(DataError):
    """A file that is not the text it should be (binary, or not in the expected encoding); the message names the
    file and, for a decoding error, the byte offset and the way out (a :class:`~litctx_common.errors.DataError`:
    the command line prints it in one line with "fix the data")."""


def encoding_problem(encoding: Any, key: str) -> Optional[str]:
    """A config check of a text ``encoding`` setting: None when Python knows it, else a line naming ``key`` (for a
    config's problem list, so a typo stops the run before any model loads)."""
    import codecs

    try:
        if isinstance(encoding, str) and codecs.lookup(encoding):
            return None
    except LookupError:
        pass
    return f"{key}={encoding!r}: not a text encoding Python knows (e.g. utf-8, latin-1, cp1252)"


def read_text_file(path: Any, encoding: str = "utf-8", binary: str = "refuse") -> Optional[str]:
    """The text of a file someone gave (documents, questions, samples): decoded strictly in ``encoding``.

    Args:
        binary: what a binary file (:func:`looks_binary`) gets: ``refuse`` (:class:`TextFileError`) or ``skip``
            (None, and the caller warns: a folder of documents may hold a stray binary file).

    Raises:
        TextFileError: binary content (with ``binary="refuse"``), or bytes that are not ``encoding``: the message
            names the file, the byte and its offset, and the ``encoding`` option (e.g. ``latin-1``).
    """
    target = Path(os.fspath(path))
    data = target.read_bytes()
    if looks_binary(data):
        if binary == "skip":
            return None
        raise TextFileError(f"{target}: binary content, not text (a NUL or control bytes in its first 8 KiB)")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as err:
        raise TextFileError(f"{target}: not {encoding} text: byte 0x{data[err.start]:02x} at offset {err.start} "
                            f"({err.reason}); if the collection is in another encoding, set encoding (e.g. "
                            f"latin-1)") from None
    except LookupError:
        raise TextFileError(f"{target}: unknown encoding {encoding!r} (e.g. utf-8, latin-1, cp1252)") from None


def jsonl_lines(path: Any, error: Callable[[str], Exception] = ValueError,
                encoding: str = "utf-8") -> Iterator[Tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line of a JSONL file someone wrote (data, questions, samples):
    the strict reader. Binary content or bytes not in ``encoding`` raise :class:`TextFileError` naming the file and
    the byte offset; a line that is not JSON raises ``error("<path>:<line>: not valid JSON (<why>)")`` (a result
    file this package appends to is read with :func:`read_jsonl`, which skips a line cut by a kill instead)."""
    target = Path(os.fspath(path))
    text = read_text_file(target, encoding)
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as err:
            raise error(f"{target}:{line_no}: not valid JSON ({err.msg})") from None
        except RecursionError:
            raise error(f"{target}:{line_no}: not valid JSON (nested too deeply)") from None

