"""DCP's files of a sharded checkpoint on an object store (a URL ``model_dir``).

Imported only for a URL (it imports fsspec through torch's fsspec filesystem). Every rank writes
its own shard file through DCP as usual; each file DCP opens for writing is a buffer in memory
that becomes **one object** when DCP closes it (``_store.write_bytes``: whole or not at all, with
the store's bounded retries, an error naming the URL). DCP's ``.metadata.tmp`` -> ``.metadata``
rename is a copy then a delete (the metadata is small). Reading goes through fsspec's files (range
requests for each slice a rank asks for); DCP's metadata is read with ``_sharded``'s unpickler
that runs no code.

There is no rename of a directory on an object store: a sharded checkpoint is written in place,
under its final name, and is complete only once ``estimatorch.json`` exists, which rank 0 writes
after every rank's shards and files are uploaded (``_sharded.write_sharded``). Discovery and
validation take no directory without it for a checkpoint; the next writer under the prefix's
lease removes such leftovers (``_files.remove_orphan_temporaries``), and deleting a checkpoint
removes its marker first.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import Any, Iterator

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter

from . import _store

__all__ = ["StoreReader", "StoreWriter"]


class _Buffer(io.BytesIO):
    """What DCP writes a file into: DCP closes its stream inside its own ``with``; the upload
    reads the buffer after that, so closing waits for :meth:`discard`."""

    def close(self) -> None:  # noqa: D401 - see the class
        return

    def discard(self) -> None:
        try:
            super().close()
        except BufferError:  # a view of it still referenced (an error's traceback): freed with it
            return


class _StoreFileSystem(FileSystem):
    """torch's fsspec filesystem for DCP, writing whole objects through ``_store``."""

    def init_path(self, path: Any, **kwargs: Any) -> str:
        self.fs, _ = _store.filesystem(os.fspath(path))
        return os.fspath(path)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        path = os.fspath(path)
        if "w" not in mode:
            fs, key = _store.filesystem(path)
            with fs.open(key, mode) as stream:
                yield stream
            return
        buffer = _Buffer()
        try:
            yield buffer
            _store.write_bytes(path, buffer.getbuffer())  # one object, uploaded whole (no copy of the bytes)
        finally:
            buffer.discard()

    def rename(self, path: Any, new_path: Any) -> None:
        _store.write_bytes(os.fspath(new_path), _store.read_bytes(os.fspath(path)))
        _store.remove(os.fspath(path))

    def mkdir(self, path: Any) -> None:
        return  # an object store has no directories

    def exists(self, path: Any) -> bool:
        return _store.exists(os.fspath(path))

    def rm_file(self, path: Any) -> None:
        _store.remove(os.fspath(path))


class StoreWriter(FsspecWriter):
    """DCP's writer of the sharded checkpoint at the URL ``path`` (one object per rank's shards;
    no fsync: an object is durable once its upload returns)."""

    def __init__(self, path: str):
        super().__init__(path, sync_files=False, overwrite=False)
        self.fs = _StoreFileSystem()  # type: ignore[assignment]  # (torch types it as its local one)
        self.path = self.fs.init_path(path)


class StoreReader(FsspecReader):
    """DCP's reader of the sharded checkpoint at the URL ``path`` (the directory's storage options)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.fs = _StoreFileSystem()  # type: ignore[assignment]  # (torch types it as its local one)
        self.path = self.fs.init_path(path)
