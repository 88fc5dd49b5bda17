"""An `ExpertStore` on disk: its records, in one file read straight back into the store.

Two files in one directory:
- `mira_store.safetensors`: one uint8 tensor `layer_<i>` [E, record_bytes] per MoE layer (a valid
  safetensors file; the data starts on a 4 KiB boundary);
- `mira_store.json`: what the records are (format, codec, the model's fingerprint), each layer's
  layout arguments (so a layout that depends on the weights, lossless, is rebuilt without reading
  them), and a checksum per 64 MiB of records.

Reading fills the store's own slabs with `pread` from several threads, checking each chunk's checksum
as it lands (beside the reads, not after them); a record that does not match raises
`CorruptStoreError`, so truncated or damaged files are never served. The checksum is Fletcher-like
over 64-bit words (the sum of the words, and the sum of each 64 KiB block's sum times its position):
any changed byte changes the first, a moved block the second. It runs at memory speed
(several times zlib's CRC32 on the same cores), so checking costs the load next to nothing.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections.abc import Callable

import numpy as np
import torch

from .errors import ConfigError, IncompatibleFileError

STORE_FORMAT = "mira-packed-store/2"
STORE_WEIGHTS, STORE_HEADER = "mira_store.safetensors", "mira_store.json"
CHUNK_BYTES = 64 * 2**20  # one checksum per chunk: small enough to spread over threads, large enough to cost nothing
_BLOCK_WORDS = 8192  # 64 KiB blocks of the checksum's position term
_DATA_ALIGN = 4096
_IO_THREADS = 8


class CorruptStoreError(IncompatibleFileError):
    """A saved store's files do not hold what its header says (truncated, damaged or half written)."""


def write_store(directory: str, slabs: dict[int, torch.Tensor], codec_spec: dict, fingerprint: dict, plans: dict) -> None:
    """Write `slabs` (layer -> uint8 [E, record_bytes]) and their header into `directory` (created).
    `plans`: layer -> the layout's arguments (`codec.plan_args(layout)`, JSON-able) or None. Both files are written
    under temporary names and then renamed: a write that fails (no room, no permission) leaves a store already
    there as it was, and raises `ConfigError` naming the directory."""
    weights, header_path = os.path.join(directory, STORE_WEIGHTS), os.path.join(directory, STORE_HEADER)
    temporary = [weights + ".partial", header_path + ".partial"]
    total = sum(slab.numel() for slab in slabs.values())
    try:
        os.makedirs(directory, exist_ok=True)
        _write_files(temporary[0], temporary[1], slabs, codec_spec, fingerprint, plans)
        os.replace(temporary[0], weights)
        os.replace(temporary[1], header_path)
    except OSError as exc:
        for path in temporary:
            if os.path.exists(path):
                os.remove(path)
        raise ConfigError(
            f"cannot write the expert store in {directory} ({exc}): give a directory that can be written, with room "
            f"for {total:,} bytes (a store already there is left as it was)."
        ) from exc


def _write_files(path: str, header_path: str, slabs, codec_spec: dict, fingerprint: dict, plans: dict) -> None:
    layers = sorted(slabs)
    tensors, offset = {}, 0
    for layer in layers:
        n = slabs[layer].numel()
        tensors[f"layer_{layer}"] = {"dtype": "U8", "shape": list(slabs[layer].shape), "data_offsets": [offset, offset + n]}
        offset += n
    tensors["__metadata__"] = {"format": STORE_FORMAT}
    head = json.dumps(tensors, separators=(",", ":")).encode()
    start = -(-(8 + len(head)) // _DATA_ALIGN) * _DATA_ALIGN
    head += b" " * (start - 8 - len(head))  # safetensors allows trailing spaces in its header
    sums: dict[int, list[list[int]]] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(start + offset)
        fd, at = f.fileno(), start
        for layer in layers:
            flat = slabs[layer].reshape(-1)
            sums[layer] = _parallel(
                lambda a, flat=flat, at=at: _write_chunk(fd, flat, a, at), range(0, flat.numel(), CHUNK_BYTES)
            )
            at += flat.numel()
    header = dict(
        format=STORE_FORMAT,
        codec=codec_spec,
        fingerprint=fingerprint,
        data_start=start,
        file_bytes=start + offset,
        chunk_bytes=CHUNK_BYTES,
        layers={
            str(layer): dict(
                experts=int(slabs[layer].shape[0]),
                record_bytes=int(slabs[layer].shape[1]),
                offset=int(tensors[f"layer_{layer}"]["data_offsets"][0]),
                plan=plans.get(layer),
                checksums=sums[layer],
            )
            for layer in layers
        },
    )
    header["header_crc32"] = _header_crc(header)
    with open(header_path, "w") as f:
        json.dump(header, f, indent=1)


def _write_chunk(fd: int, flat: torch.Tensor, a: int, base: int) -> list[int]:
    chunk = flat[a : a + CHUNK_BYTES]
    os.pwrite(fd, memoryview(chunk.numpy()).cast("B"), base + a)
    return checksum(chunk)


def checksum(chunk: torch.Tensor) -> list[int]:
    """[sum of the 64-bit words, sum of (block position + 1) x block sum] of a uint8 chunk whose size is a
    multiple of 8 (records are 256-byte aligned), both modulo 2**64. NumPy: one thread per call with the
    GIL released, so chunks are checked in parallel without oversubscribing torch's thread pool."""
    words = np.frombuffer(memoryview(chunk.numpy()).cast("B"), dtype=np.int64)
    full = words.size // _BLOCK_WORDS * _BLOCK_WORDS
    blocks = words[:full].reshape(-1, _BLOCK_WORDS).sum(1, dtype=np.int64)
    if full < words.size:
        blocks = np.append(blocks, words[full:].sum(dtype=np.int64))
    weights = np.arange(1, blocks.size + 1, dtype=np.int64)
    with np.errstate(over="ignore"):
        return [int(blocks.sum(dtype=np.int64)), int((blocks * weights).sum(dtype=np.int64))]


def _header_crc(header: dict) -> int:
    body = {k: v for k, v in header.items() if k != "header_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


class SavedStore:
    """A saved store opened for reading: its header checked, its records read on demand (`fill`)."""

    def __init__(self, directory: str, codec_spec: dict, fingerprint: dict) -> None:
        """Raises `IncompatibleFileError` when `directory` holds no store, one of another format,
        codec or model, and `CorruptStoreError` when its header or file size is not what was written."""
        self.directory = directory
        path = os.path.join(directory, STORE_HEADER)
        try:
            with open(path) as f:
                header = json.load(f)
        except FileNotFoundError as exc:
            raise IncompatibleFileError(
                f"{directory} holds no saved expert store ({STORE_HEADER}: {exc}). Save one with model.mira.save_store(dir)."
            ) from exc
        except (OSError, ValueError) as exc:
            raise CorruptStoreError(f"{path} cannot be read ({exc}).") from exc
        if not isinstance(header, dict) or header.get("format") != STORE_FORMAT:
            got = header.get("format") if isinstance(header, dict) else None
            raise IncompatibleFileError(
                f"{path}: format {got!r}, expected {STORE_FORMAT!r}. Save the store again with this mira-hf."
            )
        if header.get("header_crc32") != _header_crc(header):
            raise CorruptStoreError(f"{path}: its checksum does not match its content (damaged).")
        for what, mine, theirs in (("format", codec_spec, header["codec"]), ("model", fingerprint, header["fingerprint"])):
            if mine != theirs:
                error = IncompatibleFileError(
                    f"the expert store in {directory} was made for another {what}: it has {theirs}, this load needs {mine}. "
                    "Drop store_path to quantise again, then save a new store with model.mira.save_store(dir)."
                )
                # the fields of the fingerprint that differ, for a caller that can say why (`store_build.saved_records`)
                error.differing = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
                raise error
        self._weights = os.path.join(directory, STORE_WEIGHTS)
        try:
            size = os.path.getsize(self._weights)
        except OSError as exc:
            raise CorruptStoreError(f"{self._weights} is missing ({exc}).") from exc
        if size != header["file_bytes"]:
            raise CorruptStoreError(f"{self._weights} has {size:,} bytes, its header says {header['file_bytes']:,} (truncated).")
        self.header = header
        self.layers = {int(k): v for k, v in header["layers"].items()}

    def plan(self, layer: int) -> dict | None:
        """The layout arguments saved for `layer` (None: the codec plans from shapes alone)."""
        return self.layers[layer]["plan"]

    def shape(self, layer: int) -> tuple[int, int]:
        info = self.layers[layer]
        return info["experts"], info["record_bytes"]

    def fill(self, layer: int) -> Callable[[torch.Tensor], None]:
        """`fill(rows)`: read `layer`'s records into `rows` (uint8 [E, record_bytes], host memory),
        checking every chunk's checksum; raises `CorruptStoreError` on a mismatch."""
        info = self.layers[layer]
        base = self.header["data_start"] + info["offset"]

        def fill(rows: torch.Tensor) -> None:
            if tuple(rows.shape) != (info["experts"], info["record_bytes"]) or not rows.is_contiguous():
                raise CorruptStoreError(f"layer {layer}: rows {tuple(rows.shape)} do not fit the saved records")
            flat = rows.reshape(-1)
            chunks = range(0, flat.numel(), self.header["chunk_bytes"])
            if len(chunks) != len(info["checksums"]):
                raise CorruptStoreError(
                    f"{self._weights}: layer {layer} has {len(info['checksums'])} checksums for {len(chunks)} chunks"
                )
            step = self.header["chunk_bytes"]
            fd = os.open(self._weights, os.O_RDONLY)
            try:
                got = _parallel(lambda a: _read_chunk(fd, flat[a : a + step], base + a), chunks)
            finally:
                os.close(fd)
            for i, (sum_, want) in enumerate(zip(got, info["checksums"])):
                if sum_ != want:
                    raise CorruptStoreError(
                        f"{self._weights}: layer {layer}, bytes {i * step:,}+ do not match their checksum (damaged)."
                    )

        return fill


def _read_chunk(fd: int, dst: torch.Tensor, offset: int) -> list[int]:
    view = memoryview(dst.numpy()).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise CorruptStoreError(f"the saved records end early (at byte {offset + got:,}): truncated.")
        got += n
    return checksum(dst)


def _parallel(fn, items, threads: int = _IO_THREADS) -> list:
    """[fn(x) for x in items] on up to `threads` threads (pread/pwrite and torch release the GIL). Plain
    threads, not an executor: a cache write may still run while the interpreter exits, when executors
    refuse new work. The first exception is raised once every thread has stopped."""
    items = list(items)
    out, errors, lock, next_i = [None] * len(items), [], threading.Lock(), [0]

    def work() -> None:
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= len(items) or errors:
                return
            try:
                out[i] = fn(items[i])
            except BaseException as exc:  # handed to the caller below
                errors.append(exc)

    workers = [threading.Thread(target=work, name="mira-store-io") for _ in range(min(threads, len(items)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return out
