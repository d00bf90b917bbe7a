"""The hidden-state shard format: writer, reader, fp8 storage, index; the same for every backend.

One ``safetensors`` file per trace shard, several samples per file:

=========================  ==============================  ==========================================
tensor                     dtype, shape                    meaning
=========================  ==============================  ==========================================
``input_ids``              int64 ``[T]``                   prompt + completion ids of all samples
``loss_mask``              bool ``[T]``                    1 on completion tokens (conventions.loss_mask)
``offsets``                int64 ``[S + 1]``               sample ``i`` is rows ``offsets[i]:offsets[i+1]``
``hidden_states``          ``extraction.storage_dtype``    captured layers, in ``layer_ids`` order:
                           ``[T, L, H]``                   bfloat16 (default), float16, float32 or
                                                           float8_e4m3fn
``hidden_states_scale``    float32 ``[T, L]``              float8_e4m3fn shards only: one scale per
                                                           token and layer; the state is
                                                           ``hidden_states * scale[..., None]``
                                                           (:func:`quantize_fp8`)
=========================  ==============================  ==========================================

``layer_ids`` is ``aux_layer_ids + [n]`` (see :mod:`eagle3_pipeline.conventions`): the
first ``L - 1`` are the drafter's aux inputs, the last is the final layer before the
norm. ``T`` is the total token count of the shard, ``H`` the target's hidden size. The
file's string metadata (one key, ``eagle3_pipeline``, holding a sorted-key JSON object
with ``format``, ``layer_ids``, ``aux_layer_ids`` and ``sample_ids``: safetensors keeps
metadata in a hash map, whose key order, and so the file's bytes, would otherwise vary
from process to process) and a sidecar ``shard-NNNNN.index.json`` carry the sample
ids, offsets, layer ids and the file's SHA-256. Equal content gives equal bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .conventions import loss_mask
from .io import InputError, atomic_path, file_stat, sha256_file, write_json_atomic
from .layout import index_beside

logger = logging.getLogger(__name__)


FORMAT = "eagle3-pipeline/hidden-states/v2"


META_KEY = "eagle3_pipeline"


STORAGE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


FP8 = torch.float8_e4m3fn


#: Largest finite value of float8 e4m3fn (OCP 8-bit floating point spec, "E4M3": 1.75 x 2^8).
FP8_MAX = 448.0


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3fn with one scale per (token, layer) row: ``(q [T, L, H] fp8, scale [T, L] float32)``.

    ``scale = max_h |x| / 448`` (1 for an all-zero row), ``q = round(x / scale)`` to the
    nearest e4m3 value, so a row's largest element is exact and every element is within
    half an e4m3 step (relative 2^-4) of ``x``, or ``scale · 2^-10`` near zero
    (subnormals). Per-row scales cost ``4·L`` bytes per token against ``H·L`` saved.

    Args:
        states: ``[T, L, H]`` hidden states, any float dtype.
    """
    x = states.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


@functools.cache
def _fp8_values() -> np.ndarray:
    """float32 ``[256]``: the value of every float8 e4m3fn bit pattern (torch's own conversion)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).float().numpy()


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q · scale`` as ``dtype``: the inverse of :func:`quantize_fp8` up to its rounding.

    Args:
        q: float8 e4m3fn ``[..., H]``.
        scale: float32 ``[...]``, one per row of ``q``.
        dtype: the result's dtype.

    On the CPU, ``q`` is widened to float32 through a 256-entry table of the e4m3fn values
    (``numpy.take`` on its bytes): the same float32 values as ``q.float()``, so the same
    result, and 2.6x faster for a training sample (torch 2.13's fp8 -> float32 cast is scalar
    code; ``benchmarks/loader.py``). On a GPU, ``q.float()``.
    """
    on_cpu = q.device.type == "cpu"
    x = torch.from_numpy(np.take(_fp8_values(), q.contiguous().view(torch.uint8).numpy())) if on_cpu else q.float()
    return (x * scale[..., None]).to(dtype)


@dataclass
class Sample:
    """One training sample: ``input_ids`` int64 ``[T]`` and ``loss_mask`` bool ``[T]``."""

    id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


def sample_from_trace(trace: dict, max_seq_len: int) -> Sample:
    """Build the extraction input of a trace: prompt ids + completion ids, and its loss mask.

    Raises:
        ValueError: the sample exceeds ``max_seq_len`` tokens (generation caps
            prompt + completion at the same limit, so this means mismatched configs),
            or its completion is empty (mask sum 0). The message names the trace id.
    """
    p = trace["prompt_token_ids"]
    c = trace["completion_token_ids"]
    if len(p) + len(c) > max_seq_len:
        raise ValueError(
            f"trace {trace['id']}: {len(p) + len(c)} tokens exceed max_seq_len={max_seq_len}; regenerate with the same max_seq_len"
        )
    try:
        mask = loss_mask(len(p), len(c))
    except ValueError as e:
        raise ValueError(f"trace {trace['id']}: {e}") from e
    return Sample(trace["id"], np.asarray(p + c, dtype=np.int64), mask)


#: safetensors dtype names (the format's ``dtype`` field) of the tensors a shard holds.
SAFETENSORS_DTYPES = {
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    FP8: "F8_E4M3",
}


_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


#: The tensors a shard holds per token row and :class:`ShardWriter` fills in place, in the
#: order a row's CRC-32 takes them (:meth:`ShardWriter.write_states`).
ROW_TENSORS = ("hidden_states", "hidden_states_scale")


def row_bytes(header: dict, name: str) -> int:
    """Bytes one token row takes in tensor ``name`` of a shard's safetensors ``header``
    (:func:`read_shard_header`): its data span over the token count, ``hidden_states``' first
    dimension. Tensors in :data:`ROW_TENSORS` are stored row after row, so rows ``[r, r + n)``
    start ``r * row_bytes`` into the tensor's data. 0 for a shard of no tokens."""
    a, b = header[name]["data_offsets"]
    num_tokens = header["hidden_states"]["shape"][0]
    return (b - a) // num_tokens if num_tokens else 0


class RowsWritten(NamedTuple):
    """What one :meth:`ShardWriter.write_states` call wrote: token rows ``[row, row + rows)``,
    ``nbytes`` bytes, and ``crc32``, zlib's CRC-32 of those bytes (the states', then an fp8
    shard's scales'), which the chunk's done marker records for a resume to check."""

    row: int
    rows: int
    nbytes: int
    crc32: int


class ShardWriter:
    """A hidden-state shard preallocated on disk and filled in place, sample by sample.

    :meth:`create` writes a complete safetensors file (format: 8-byte little-endian header
    length, a JSON header of dtypes, shapes and ``data_offsets``, then the data) whose
    ``input_ids``, ``loss_mask`` and ``offsets`` are final and whose ``hidden_states``
    (and fp8 ``hidden_states_scale``) rows are still zeros (a sparse file); each sample's
    rows are then written at their offset with ``os.pwrite`` by :meth:`write_states`.
    Several processes may fill disjoint samples of one file (data-parallel replicas,
    vLLM engine writer threads: :meth:`open` attaches to a created file). The result
    reads with ``safetensors.safe_open`` like any shard (:class:`ShardReader`).

    Why not ``safetensors.torch.save_file``: it needs the whole shard in memory at once.
    A real run's shard is larger than host memory (20M tokens × 4 layers × 4096 × 2 bytes
    = 655 GB), and writing chunk files that are merged at the end copies every byte twice
    and needs twice the disk. The header is the one safetensors writes for these tensors
    (sorted keys, padded with spaces to 8 bytes); the data are stored in the order
    ``input_ids, offsets, hidden_states, hidden_states_scale, loss_mask``: the small tensors
    that are final at :meth:`create` first, then those filled row by row, so that a file's
    final bytes are a prefix of it while chunks finish in order (:class:`ShardHasher`). An fp8
    shard whose states take a byte count that is not a multiple of 4 stores its float32 scales
    before the states instead, to keep them 4-byte aligned.
    """

    def __init__(self, path: str | os.PathLike, fd: int, header: dict, data_start: int, header_bytes: bytes):
        self.path = Path(path)
        self._fd = fd
        self.header = header
        self.header_bytes = header_bytes
        self._start = data_start
        hs = header["hidden_states"]
        self.num_tokens, self.num_layers, self.hidden_size = hs["shape"]
        self.stored_dtype = _TORCH_DTYPES[hs["dtype"]]

    @staticmethod
    def layout(
        samples: Sequence[Sample], *, layer_ids: Sequence[int], aux_layer_ids: Sequence[int], hidden_size: int, storage_dtype: torch.dtype
    ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """The file's first bytes (length + header) and its small tensors, for ``samples``.

        Returns:
            ``(prefix, tensors)``: ``prefix`` is the 8-byte length plus the JSON header;
            ``tensors`` are ``input_ids`` int64 ``[T]``, ``loss_mask`` bool ``[T]``,
            ``offsets`` int64 ``[S + 1]``.

        Raises:
            ValueError: ``storage_dtype`` is not one of :data:`STORAGE_DTYPES`.
        """
        if storage_dtype not in STORAGE_DTYPES.values():
            raise ValueError(f"storage dtype {storage_dtype} is not one of {sorted(STORAGE_DTYPES)}")
        lengths = [len(s.input_ids) for s in samples]
        n, n_layers = int(sum(lengths)), len(layer_ids)
        small = {
            "input_ids": torch.from_numpy(np.concatenate([s.input_ids for s in samples]) if samples else np.zeros(0, np.int64)),
            "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros(0, bool)),
            "offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
        }
        shapes = {k: (t.dtype, list(t.shape)) for k, t in small.items()}
        shapes["hidden_states"] = (storage_dtype, [n, n_layers, hidden_size])
        if storage_dtype == FP8:
            shapes["hidden_states_scale"] = (torch.float32, [n, n_layers])
        header: dict = {
            "__metadata__": {
                META_KEY: json.dumps(
                    {
                        "format": FORMAT,
                        "layer_ids": list(layer_ids),
                        "aux_layer_ids": list(aux_layer_ids),
                        "sample_ids": [s.id for s in samples],
                    },
                    sort_keys=True,
                )
            }
        }
        filled = list(ROW_TENSORS)
        if storage_dtype == FP8 and (n * n_layers * hidden_size) % 4:
            filled.reverse()  # the float32 scales first, at an 8-byte aligned offset
        order = ["input_ids", "offsets", *filled, "loss_mask"]
        pos = 0
        for name in order:
            if name in shapes:
                dtype, shape = shapes[name]
                size = int(np.prod(shape)) * dtype.itemsize
                header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [pos, pos + size]}
                pos += size
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text, small

    @staticmethod
    def file_bytes(prefix: bytes) -> int:
        """The size of the shard whose first bytes (length + header, :meth:`layout`) are ``prefix``."""
        header = json.loads(prefix[8:])
        return len(prefix) + max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        samples: Sequence[Sample],
        *,
        layer_ids: Sequence[int],
        aux_layer_ids: Sequence[int],
        hidden_size: int,
        storage_dtype: torch.dtype,
    ) -> ShardWriter:
        """Create (or overwrite) ``path`` as the shard of ``samples`` with zero states; see :meth:`layout`.

        The file is preallocated where the filesystem can (:func:`preallocate`), else sparse.

        Raises:
            InputError: the disk or the quota has no room for the shard (names it and its size).
        """
        prefix, small = cls.layout(
            samples, layer_ids=layer_ids, aux_layer_ids=aux_layer_ids, hidden_size=hidden_size, storage_dtype=storage_dtype
        )
        header, size = json.loads(prefix[8:]), cls.file_bytes(prefix)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            try:
                allocated = preallocate(fd, size)
            except OSError as e:
                raise InputError(
                    f"{path}: no room for this hidden-state shard of {size / 1e9:.2f} GB ({e.strerror}); free space or move results/"
                ) from e
            if not allocated:
                os.ftruncate(fd, size)  # sparse: blocks are allocated as the states are written
            _pwrite_all(fd, prefix, 0)
            for name, t in small.items():
                _pwrite_all(fd, t.numpy().tobytes(), len(prefix) + header[name]["data_offsets"][0])
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, header, len(prefix), prefix)

    @classmethod
    def open(cls, path: str | os.PathLike) -> ShardWriter:
        """Attach to a shard made by :meth:`create` (e.g. from another process) to fill its states.

        Raises:
            ValueError: ``path`` is not a hidden-state shard (names the file).
        """
        prefix, header = read_shard_header(path)
        return cls(path, os.open(path, os.O_RDWR), header, len(prefix), prefix)

    def write_states(self, row: int, states: torch.Tensor) -> RowsWritten:
        """Store one sample's (or consecutive samples') states at token row ``row``.

        Args:
            row: the first token's index in the shard (``offsets[i]`` of its sample).
            states: ``[T, L, H]`` in layer_ids order, any float dtype, on CPU; cast to the
                shard's dtype (fp8: :func:`quantize_fp8`, with its per-row scales).

        Returns:
            the rows written, their bytes and their CRC-32 (:class:`RowsWritten`), for the
            chunk's done marker (:func:`mark_chunk_done`).

        Raises:
            ValueError: the rows fall outside the shard or the shape differs from ``[T, L, H]``.
        """
        import zlib

        t = states.shape[0]
        if (
            states.dim() != 3
            or tuple(states.shape[1:]) != (self.num_layers, self.hidden_size)
            or not 0 <= row <= row + t <= self.num_tokens
        ):
            raise ValueError(
                f"{self.path}: states of shape {tuple(states.shape)} at row {row} do not fit "
                f"[{self.num_tokens}, {self.num_layers}, {self.hidden_size}]"
            )
        parts = {}
        if self.stored_dtype == FP8:
            parts["hidden_states"], parts["hidden_states_scale"] = quantize_fp8(states)
        else:
            parts["hidden_states"] = states.to(self.stored_dtype)
        written = crc = 0
        for name in ROW_TENSORS:
            if name not in parts:
                continue
            buf = parts[name].contiguous().view(torch.uint8).numpy()
            _pwrite_all(self._fd, buf, self._row_span(name, row, t)[0])
            crc = zlib.crc32(buf, crc)  # zlib releases the GIL: other writer threads go on
            written += buf.nbytes
        return RowsWritten(row, t, written, crc)

    def _row_span(self, name: str, row: int, rows: int) -> tuple[int, int]:
        """``(file offset, bytes)`` of rows ``[row, row + rows)`` of the row tensor ``name``."""
        size = row_bytes(self.header, name)
        return self._start + self.header[name]["data_offsets"][0] + row * size, rows * size

    def rows_crc32(self, row: int, rows: int) -> int:
        """The CRC-32 of rows ``[row, row + rows)`` as the file holds them now, in the order
        :meth:`write_states` takes it (the states' bytes, then an fp8 shard's scales').

        Raises:
            OSError: the file ends before those rows.
        """
        import zlib

        crc = 0
        for name in ROW_TENSORS:
            if name not in self.header:
                continue
            offset, size = self._row_span(name, row, rows)
            while size:
                data = os.pread(self._fd, min(size, 8 << 20), offset)
                if not data:
                    raise OSError(f"{self.path}: ends at byte {offset}, inside the rows {row}-{row + rows - 1}")
                crc = zlib.crc32(data, crc)
                offset, size = offset + len(data), size - len(data)
        return crc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_shard_header(path: str | os.PathLike) -> tuple[bytes, dict]:
    """``(prefix, header)`` of a shard file: its first bytes (8-byte length + JSON header) and the parsed header.

    Raises:
        ValueError: ``path`` is not a hidden-state shard (names the file).
    """
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        prefix = f.read(n)
    try:
        header = json.loads(prefix)
        meta = json.loads(header.get("__metadata__", {}).get(META_KEY, "{}"))
    except ValueError:
        header, meta = {}, {}
    if meta.get("format") != FORMAT or "hidden_states" not in header:
        raise ValueError(f"{path}: not an eagle3-pipeline {FORMAT} hidden-state shard")
    return n.to_bytes(8, "little") + prefix, header


class ShardHasher:
    """The SHA-256 of a shard that is being filled in place, taken while it is filled.

    SHA-256 takes a file's bytes in order, so the hasher follows the shard's final prefix:
    the length, header, ``input_ids`` and ``offsets`` are final once :meth:`ShardWriter.create`
    wrote them; the rows of ``hidden_states`` (and of an fp8 shard's ``hidden_states_scale``)
    are final once the chunk that holds them is done (its done marker is written after its
    rows, :func:`mark_chunk_done`); ``loss_mask``, last, is final from the start. With
    :meth:`following`, a thread hashes up to the end of the first chunk not yet done, as the
    extraction's replicas and engines fill the file; :meth:`hexdigest` hashes what is left
    once every chunk is done. Extraction's chunks finish roughly in order, so the shard's
    bytes are read back (from the page cache, just written) and hashed while the target
    prefills, and the job does not read the whole shard a second time at its end.

    Args:
        path: the shard, created by :meth:`ShardWriter.create`.
        chunk_rows: ``(first, end)`` token rows of each chunk, in order, contiguous from row 0
            to the shard's token count.
        buffer_bytes: bytes read and hashed at a time.

    Raises:
        ValueError: ``path`` is not a hidden-state shard, has another size than its header gives,
            or the chunks do not cover its rows.
    """

    def __init__(self, path: str | os.PathLike, chunk_rows: Sequence[tuple[int, int]], buffer_bytes: int = 8 << 20):
        import hashlib

        prefix, header = read_shard_header(path)
        self.path = Path(path)
        self.size = ShardWriter.file_bytes(prefix)
        if os.path.getsize(path) != self.size:
            raise ValueError(f"{path}: {os.path.getsize(path)} bytes, not the {self.size} its header gives")
        self.num_tokens = header["hidden_states"]["shape"][0]
        ends = [int(b) for _, b in chunk_rows]
        if [int(a) for a, _ in chunk_rows] != [0, *ends][: len(ends)] or (ends[-1] if ends else 0) != self.num_tokens:
            raise ValueError(f"{path}: chunk rows {list(chunk_rows)[:3]}... do not cover its {self.num_tokens} rows in order")
        self._chunk_ends = ends
        # (start byte, row bytes or 0 for a tensor that is final from the start), in file order
        tensors = sorted((e["data_offsets"], name) for name, e in header.items() if name != "__metadata__")
        self._regions = [(len(prefix) + a, row_bytes(header, name) if name in ROW_TENSORS else 0) for (a, _), name in tensors]
        self._sha = hashlib.sha256()
        self._buf = memoryview(bytearray(buffer_bytes))
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 -- closed by hexdigest, or when following ends
        self.hashed = 0
        self.tail_seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def final_bytes(self, done: Iterable[int]) -> int:
        """How many of the file's first bytes are final when the chunks ``done`` are."""
        done, rows = set(done), 0
        for k, end in enumerate(self._chunk_ends):
            if k not in done:
                break
            rows = end
        for start, per_row in self._regions:
            if per_row and rows < self.num_tokens:
                return start + rows * per_row
        return self.size

    def update(self, upto: int, stop: threading.Event | None = None) -> None:
        """Hash the file's bytes up to ``upto`` (bytes already hashed are not read again), or until ``stop`` is set.

        Raises:
            OSError: the file ends before ``upto`` (it was truncated or replaced).
        """
        while self.hashed < upto and not (stop is not None and stop.is_set()):
            self._file.seek(self.hashed)
            n = self._file.readinto(self._buf[: min(len(self._buf), upto - self.hashed)])
            if not n:
                raise OSError(f"{self.path}: ends at byte {self.hashed}, before the {upto} bytes to hash")
            self._sha.update(self._buf[:n])
            self.hashed += n

    @contextlib.contextmanager
    def following(self, done: Callable[[], Iterable[int]], poll_s: float = 0.25) -> Iterator[ShardHasher]:
        """Hash the final prefix in a background thread while the block runs.

        Args:
            done: returns the indices of the chunks done so far (e.g. ``ChunkStore.finished``).
            poll_s: seconds between two looks at ``done``.

        Yields:
            this hasher; call :meth:`hexdigest` in the block once every chunk is done.
        """

        def follow() -> None:
            try:
                while not self._stop.is_set():
                    upto = self.final_bytes(done())
                    if upto > self.hashed:
                        self.update(upto, self._stop)  # no wait while behind: the tail is then the last chunk alone
                    else:
                        self._stop.wait(poll_s)
            except BaseException as e:  # noqa: BLE001 -- handed to hexdigest
                self._error = e

        self._thread = threading.Thread(target=follow, name="shard-hasher", daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
            self._file.close()

    def hexdigest(self) -> str:
        """The shard's SHA-256 (hex), once every chunk is done: stops following, hashes the rest.

        Equals :func:`eagle3_pipeline.io.sha256_file` of the finished shard.

        Raises:
            OSError: the follower failed to read the file, or the file no longer has the size its
                header gives.
        """
        t0 = time.perf_counter()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise OSError(f"{self.path}: hashing while it was filled failed: {self._error}") from self._error
        if os.path.getsize(self.path) != self.size:
            raise OSError(f"{self.path}: {os.path.getsize(self.path)} bytes, not the {self.size} its header gives")
        self.update(self.size)
        self._file.close()
        self.tail_seconds = time.perf_counter() - t0
        return self._sha.hexdigest()


@functools.cache
def _fallocate():
    """libc's ``fallocate`` with 64-bit offsets (Linux), or None where the C library has none."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        f = getattr(lib, "fallocate64", None) or lib.fallocate
    except (OSError, AttributeError, TypeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    f.restype = ctypes.c_int
    return f


def preallocate(fd: int, size: int) -> bool:
    """Allocate ``size`` bytes (zeros) to the empty file ``fd`` with Linux ``fallocate(2)``, mode 0.

    Buffered writes into allocated blocks are faster than into a sparse file: on one H100 host
    (ext4), 32.8 MB writes ran at 6.8-7.0 GB/s into a preallocated file against 5.8-5.9 GB/s
    (``benchmarks/results/vs_speculators_h100_third.json``), and the space is taken before the
    first state is written. Unlike ``os.posix_fallocate``, nothing is emulated by writing zeros
    where the filesystem has no ``fallocate`` (some network filesystems).

    Returns:
        whether the file now holds ``size`` allocated bytes; False where the C library or the
        filesystem has no ``fallocate`` or refuses it otherwise (the file as it was), so the
        caller sizes the file with ``ftruncate`` instead.

    Raises:
        OSError: ``ENOSPC`` or ``EDQUOT``: the disk or the quota has no room for ``size`` bytes
            (the file is emptied first: ext4 and XFS keep what a failed call allocated).
    """
    f = _fallocate()
    if f is None or size <= 0:
        return False
    if f(fd, 0, 0, size) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT):
        os.ftruncate(fd, 0)  # the failed call may have allocated part of the range
        raise OSError(err, os.strerror(err))
    logger.debug("fallocate of %d bytes failed (%s): the shard is sized sparse", size, os.strerror(err))
    return False


def _pwrite_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` until every byte of ``data`` is written (a write may be partial)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_shard(
    path: str | os.PathLike,
    samples: Sequence[Sample],
    states: Sequence[torch.Tensor],
    *,
    layer_ids: Sequence[int],
    aux_layer_ids: Sequence[int],
    index_path: str | os.PathLike | None,
    storage_dtype: torch.dtype | None = None,
    checksum: bool = True,
) -> dict:
    """Write one hidden-state shard (format in the module docstring) and its index, atomically.

    Args:
        states: per sample ``[T_i, L, H]``.
        storage_dtype: dtype to store (default: the states' own); ``torch.float8_e4m3fn``
            stores :func:`quantize_fp8` values plus ``hidden_states_scale`` float32 ``[T, L]``.
        checksum: put the file's SHA-256 in the index (reads the file back).

    Returns:
        the index dict (also written to ``index_path`` unless it is None).

    Raises:
        ValueError: no samples, or a sample's states have another shape than ``[T_i, L, H]``.
    """
    if not states:
        raise ValueError(f"{path}: a shard needs at least one sample")
    hidden_size = states[0].shape[-1]
    with (
        atomic_path(path, suffix=".safetensors") as tmp,
        ShardWriter.create(
            tmp,
            samples,
            layer_ids=layer_ids,
            aux_layer_ids=aux_layer_ids,
            hidden_size=hidden_size,
            storage_dtype=storage_dtype or states[0].dtype,
        ) as w,
    ):
        row = 0
        for s, x in zip(samples, states, strict=True):
            if x.shape[0] != len(s.input_ids):
                raise ValueError(f"{path}: sample {s.id} has {len(s.input_ids)} tokens but states of shape {tuple(x.shape)}")
            w.write_states(row, x)
            row += x.shape[0]
    return shard_index(path, samples, layer_ids=layer_ids, aux_layer_ids=aux_layer_ids, index_path=index_path, checksum=checksum)


#: A shard index's keys of the shard's SHA-256 and :func:`eagle3_pipeline.io.file_stat`.
INDEX_HASH_KEYS = ("sha256", "stat")


def shard_index_path(shard: str | os.PathLike) -> Path:
    """The ``.index.json`` beside a hidden-state shard (``shard-00000.safetensors`` → ``shard-00000.index.json``)."""
    return index_beside(shard)


def recorded_shard_sha256(shard: str | os.PathLike) -> str:
    """The SHA-256 of a hidden-state shard, checked against the one extraction recorded in its index
    (:func:`eagle3_pipeline.io.recorded_sha256`; hashed without a check when there is no index).

    Raises:
        InputError: the shard's bytes differ from the recorded ones.
    """
    from .io import recorded_sha256

    return recorded_sha256(shard, shard_index_path(shard), *INDEX_HASH_KEYS)


def shard_index(
    path: str | os.PathLike,
    samples: Sequence[Sample],
    *,
    layer_ids: Sequence[int],
    aux_layer_ids: Sequence[int],
    index_path: str | os.PathLike | None,
    checksum: bool = True,
    sha256: str | None = None,
) -> dict:
    """The index of a complete shard (sample ids, offsets, counts, size, SHA-256), written to ``index_path``.

    Hidden size and dtype are read from the file's header. ``sha256``: the file's SHA-256 when
    the caller took it while writing (:class:`ShardHasher`); otherwise (with ``checksum``) the file
    is read to hash it.
    """
    hs = read_shard_header(path)[1]["hidden_states"]
    hidden_size = hs["shape"][-1]
    dtype = _TORCH_DTYPES[hs["dtype"]]
    lengths = [len(s.input_ids) for s in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()
    index = {
        "format": FORMAT,
        "file": Path(path).name,
        "num_samples": len(samples),
        "num_tokens": int(offsets[-1]),
        "num_supervised_tokens": int(sum(int(s.loss_mask.sum()) for s in samples)),
        "layer_ids": list(layer_ids),
        "aux_layer_ids": list(aux_layer_ids),
        "hidden_size": int(hidden_size),
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": os.path.getsize(path),
        INDEX_HASH_KEYS[0]: (sha256 or sha256_file(path)) if checksum else None,
        # the shard as hashed: a reader trusts the hash while size, mtime and inode are these (io.checked_sha256)
        INDEX_HASH_KEYS[1]: file_stat(path) if checksum else None,
        "samples": [{"id": s.id, "offset": o, "length": n} for s, o, n in zip(samples, offsets[:-1], lengths, strict=True)],
    }
    if index_path is not None:
        write_json_atomic(index_path, index)
    return index


class ShardReader:
    """Lazy per-sample access to a hidden-state shard (memory-mapped by safetensors; the format
    is the module docstring's).

    Attributes:
        path: the shard file.
        layer_ids, aux_layer_ids: the stored layers (``aux_layer_ids + [n]``) and the aux ones.
        sample_ids: the samples' ids, in row order (``S`` of them).
        offsets: int64 ``[S + 1]``: sample ``i`` is rows ``offsets[i]:offsets[i+1]``.
        input_ids: int64 ``[T]``; loss_mask: bool ``[T]`` (1 on supervised tokens).
        fp8: whether the states are stored as float8_e4m3fn with per-row scales.
        stored_dtype: the stored states' dtype as safetensors names it (``"BF16"``, ``"F8_E4M3"``, ...).

    Raises:
        ValueError: the file is not a shard of this format (names the file and what it holds).
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        self._f = safe_open(str(path), framework="pt")
        raw = self._f.metadata() or {}
        meta = json.loads(raw[META_KEY]) if META_KEY in raw else {}
        if meta.get("format") != FORMAT:
            found = meta.get("format") or raw.get("format")
            raise ValueError(f"{path}: not an eagle3-pipeline {FORMAT} hidden-state shard (format={found!r}); re-extract it")
        self.layer_ids: list[int] = meta["layer_ids"]
        self.aux_layer_ids: list[int] = meta["aux_layer_ids"]
        self.sample_ids: list[str] = meta["sample_ids"]
        self.offsets = self._f.get_tensor("offsets")
        self.input_ids = self._f.get_tensor("input_ids")
        self.loss_mask = self._f.get_tensor("loss_mask")
        self.fp8 = "hidden_states_scale" in set(self._f.keys())
        self._scale = self._f.get_tensor("hidden_states_scale") if self.fp8 else None
        self.stored_dtype = self._f.get_slice("hidden_states").get_dtype()

    def raw(self, name: str) -> torch.Tensor:
        """A stored tensor as it is in the file (fp8 states not dequantised)."""
        return self._f.get_tensor(name)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def lengths(self) -> list[int]:
        """Each sample's token count, in row order."""
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def all_hidden_states(self) -> torch.Tensor:
        """The whole ``hidden_states`` tensor ``[T, L, H]`` (read into memory; fp8 dequantised to bf16)."""
        hs = self._f.get_tensor("hidden_states")
        return dequantize_fp8(hs, self._scale) if self.fp8 else hs

    def sample(self, i: int, layers: Sequence[int] | None = None) -> dict:
        """Sample ``i``: ``input_ids`` [T], ``loss_mask`` [T], ``hidden_states`` [T, L, H] (fp8 dequantised to bf16).

        Args:
            i: sample index in the shard.
            layers: positions (0-based, into :attr:`layer_ids`) of the layers to return, in
                this order; ``hidden_states`` is then ``[T, len(layers), H]``. fp8 rows are
                dequantised after the selection, so unused stored layers cost no work.
        """
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        hs = self._f.get_slice("hidden_states")[a:b]
        scale = self._scale[a:b] if self.fp8 else None
        if layers is not None:
            cols = list(layers)
            hs = hs[:, cols]
            scale = scale[:, cols] if scale is not None else None
        if scale is not None:
            hs = dequantize_fp8(hs, scale)
        return {
            "id": self.sample_ids[i],
            "input_ids": self.input_ids[a:b],
            "loss_mask": self.loss_mask[a:b],
            "hidden_states": hs,
        }


def read_shard(path: str | os.PathLike) -> tuple[list[Sample], list[torch.Tensor], list[int], list[int]]:
    """``(samples, per-sample states [T_i, L, H], layer_ids, aux_layer_ids)`` of a whole shard."""
    r = ShardReader(path)
    hs = r.all_hidden_states()
    samples, states = [], []
    for i, sid in enumerate(r.sample_ids):
        a, b = int(r.offsets[i]), int(r.offsets[i + 1])
        samples.append(Sample(sid, r.input_ids[a:b].numpy(), r.loss_mask[a:b].numpy()))
        states.append(hs[a:b])
    return samples, states, r.layer_ids, r.aux_layer_ids


#: Suffix of a chunk's done marker in the job's chunk store (the states live in the shard).
DONE_SUFFIX = ".done"


def mark_chunk_done(marker: str | os.PathLike, written: Iterable[RowsWritten]) -> None:
    """Write a chunk's done marker: its states are in the job's shard.

    The marker is JSON: ``samples`` and ``tokens`` (the chunk's counts) and ``rows``, one
    ``[first row, rows, CRC-32]`` per :meth:`ShardWriter.write_states` call that wrote the
    chunk (``written``, in any order), which :func:`check_done_chunks` compares with the
    shard's bytes when a killed job's rerun resumes from it. Written to ``marker`` as given:
    callers pass a temporary path that they rename into place
    (:meth:`eagle3_pipeline.resume.ChunkStore.writing`, :func:`eagle3_pipeline.io.atomic_path`).
    """
    rows = sorted([w.row, w.rows, w.crc32] for w in written)
    Path(marker).write_text(json.dumps({"samples": len(rows), "tokens": sum(r[1] for r in rows), "rows": rows}) + "\n")


def check_done_chunks(store, path: str | os.PathLike) -> dict[int, str]:
    """The done chunks of ``store`` whose rows in the partial shard ``path`` are not what was
    written: the CRC-32 of each write its marker records (:func:`mark_chunk_done`) against
    the shard's bytes now (:meth:`ShardWriter.rows_crc32`).

    Returns:
        ``{chunk index: reason}`` for each chunk to extract again: its rows differ (the
        first such write named), or its marker is unreadable or has no ``rows`` (a marker of
        an earlier version: nothing to check it against).
    """
    bad: dict[int, str] = {}
    with ShardWriter.open(path) as shard:
        for i in store.finished():
            marker = store.path(i)
            try:
                rows = json.loads(marker.read_text())["rows"]
                entries = [(int(a), int(n), int(c)) for a, n, c in rows]
            except (OSError, ValueError, KeyError, TypeError) as e:
                bad[i] = f"{marker.name} does not record its rows' CRC-32 ({type(e).__name__}: {e})"
                continue
            for a, n, crc in entries:
                if not 0 <= a <= a + n <= shard.num_tokens:
                    bad[i] = f"{marker.name} names rows {a}-{a + n - 1}, outside the shard's {shard.num_tokens}"
                    break
                now = shard.rows_crc32(a, n)
                if now != crc:
                    bad[i] = f"rows {a}-{a + n - 1} have CRC-32 {now:08x}, not the {crc:08x} written"
                    break
    return bad


def partial_shard_path(store_dir: str | os.PathLike) -> Path:
    """The shard an extraction job fills in its chunk store (``resume.ChunkStore.dir``)."""
    return Path(store_dir) / "shard.safetensors"


def allocated_bytes(path: str | os.PathLike) -> int:
    """Bytes of disk ``path`` holds (its allocated blocks; a sparse file holds fewer than its
    size, a preallocated one all of them); 0 where it does not exist."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def prepare_partial_shard(store, samples: Sequence[Sample], **layout) -> Path:
    """The job's preallocated shard in its chunk store, created unless a matching one is there.

    A shard kept from a killed run is reused when its header equals the one ``samples``
    and ``layout`` (:meth:`ShardWriter.layout` arguments) give and it has the size that header
    gives (a file cut short lost rows of done chunks), with those of its done chunks whose rows
    still hold what was written (:func:`check_done_chunks`; the others are extracted again);
    otherwise it is created afresh (atomically) and any done markers are dropped.

    Returns:
        the path of the partial shard (``<chunk store>/shard.safetensors``).
    """
    path = partial_shard_path(store.dir)
    prefix, _ = ShardWriter.layout(samples, **layout)
    if path.is_file() and path.stat().st_size == ShardWriter.file_bytes(prefix):
        with open(path, "rb") as f:
            same = f.read(len(prefix)) == prefix
        if same:
            t = time.perf_counter()
            bad = check_done_chunks(store, path)
            for i, reason in sorted(bad.items()):
                logger.warning("%s: done chunk %d is extracted again: %s", store.final_path, i, reason)
                store.path(i).unlink(missing_ok=True)
            if kept := len(store.finished()) + len(bad):
                logger.info(
                    "%s: %d done chunk(s) of the kept partial shard checked in %.1f s", store.final_path, kept, time.perf_counter() - t
                )
            return path
    stale = store.finished()
    if stale:
        logger.warning("%s: the partial shard is missing or differs; discarding %d done chunk(s)", store.final_path, len(stale))
        for i in stale:
            store.path(i).unlink(missing_ok=True)
    path.unlink(missing_ok=True)  # its done chunks are dropped: its space goes to the new one
    with atomic_path(path, suffix=".safetensors") as tmp:
        ShardWriter.create(tmp, samples, **layout).close()
    return path
