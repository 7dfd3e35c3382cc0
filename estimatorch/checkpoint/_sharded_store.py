"""DCP's storage for sharded checkpoints: its reader and writer for a directory (``_reader``,
``_writer``), DCP's ``.metadata`` read with an unpickler that runs no code, and DCP's files on an
object store (a URL ``model_dir``).

Every rank writes its own shard file through DCP as usual; each file DCP opens for writing is a
buffer in memory that becomes **one object** when DCP closes it (``_store.write_bytes``: whole or
not at all, with the store's bounded retries, an error naming the URL). DCP's ``.metadata.tmp``
-> ``.metadata`` rename is a copy then a delete (the metadata is small). Reading goes through
fsspec's files (range requests for each slice a rank asks for); DCP's metadata is read with
``_sharded``'s unpickler that runs no code. Nothing here imports fsspec: ``_store`` does, for a
URL only.

There is no rename of a directory on an object store: a sharded checkpoint is written in place,
under its final name, and is complete only once ``estimatorch.json`` exists, which rank 0 writes
after every rank's shards and files are uploaded (``_sharded.write_sharded``). Discovery and
validation take no directory without it for a checkpoint; the next writer under the prefix's
lease removes such leftovers (``_files.remove_orphan_temporaries``), and deleting a checkpoint
removes its marker first.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import types
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch

from . import _store

if TYPE_CHECKING:  # heavy (DTensor and DCP take about a third of torch's own import): typing only
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["METADATA", "read_metadata"]

#: DCP's metadata file in a sharded checkpoint directory.
METADATA = ".metadata"


class _Buffer(io.BytesIO):
    """What DCP writes a file into: DCP closes its stream inside its own ``with``; the upload
    reads the buffer after that, so closing waits for :meth:`discard`."""

    def close(self) -> None:  # see the class
        return

    def discard(self) -> None:
        try:
            super().close()
        except BufferError:  # a view of it still referenced (an error's traceback): freed with it
            return


# -- reading DCP's metadata safely, a reader and writer for a path or URL ------------------------
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in
    ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
     "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: its classes, torch sizes and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(path: str, load_id: Any = None) -> Metadata:
    """DCP's metadata of the sharded checkpoint at ``path``, unpickled without running code."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta  # heavy: only for a sharded checkpoint

    metadata = _MetadataUnpickler(io.BytesIO(_read_bytes(os.path.join(path, METADATA)))).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError("not DCP metadata")
    storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
    storage_meta.load_id = load_id
    metadata.storage_meta = storage_meta
    return metadata


class _SafeMetadata:
    """DCP's metadata read with an unpickler that runs no code (for a reader's ``path``)."""

    path: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(os.fspath(self.path), self.load_id)


@functools.lru_cache(maxsize=None)
def _classes() -> types.SimpleNamespace:
    """DCP's filesystem, reader and writer for an object store, and the readers that unpickle
    DCP's metadata safely: defined at the first sharded checkpoint a process reads or writes
    (DCP is a heavy import no other checkpoint needs)."""
    from torch.distributed.checkpoint.filesystem import (  # heavy: only where a checkpoint is sharded
        FileSystemBase,
        FileSystemReader,
        FileSystemWriter,
    )

    class _StoreFileSystem(FileSystemBase):
        """DCP's filesystem on an object store, through ``_store``: whole objects written, fsspec's
        files read."""

        def init_path(self, path: Any, **kwargs: Any) -> str:
            return os.fspath(path)

        def concat_path(self, path: Any, suffix: str) -> str:
            return os.path.join(os.fspath(path), suffix)

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
            path = os.fspath(path)
            if "w" not in mode:
                with _store.open_file(path, mode) as stream:
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

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return _store.is_url(checkpoint_id)

        def exists(self, path: Any) -> bool:
            return _store.exists(os.fspath(path))

        def rm_file(self, path: Any) -> None:
            _store.remove(os.fspath(path))

        def ls(self, path: Any) -> list[str]:
            return [os.path.join(os.fspath(path), name) for name in _store.listdir(os.fspath(path))]

    class StoreWriter(FileSystemWriter):
        """DCP's writer of the sharded checkpoint at the URL ``path`` (one object per rank's shards;
        no fsync: an object is durable once its upload returns)."""

        def __init__(self, path: str):
            super().__init__(path, sync_files=False, overwrite=False)
            self.fs = _StoreFileSystem()  # type: ignore[assignment]  # (torch types it as its local one)
            self.path = self.fs.init_path(path)

    class StoreReader(FileSystemReader):
        """DCP's reader of the sharded checkpoint at the URL ``path`` (the directory's storage options)."""

        def __init__(self, path: str):
            super().__init__(path)
            self.fs = _StoreFileSystem()  # type: ignore[assignment]  # (torch types it as its local one)
            self.path = self.fs.init_path(path)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return _store.is_url(checkpoint_id)

    class _SafeReader(_SafeMetadata, FileSystemReader):
        """DCP's file reader with a metadata unpickler that runs no code."""

    class _SafeStoreReader(_SafeMetadata, StoreReader):
        """DCP's reader on an object store with a metadata unpickler that runs no code."""

    return types.SimpleNamespace(StoreWriter=StoreWriter, StoreReader=StoreReader, SafeReader=_SafeReader,
                                 SafeStoreReader=_SafeStoreReader, FileSystemWriter=FileSystemWriter)


def _reader(path: str) -> Any:
    dcp = _classes()
    return dcp.SafeStoreReader(path) if _store.is_url(path) else dcp.SafeReader(path)


def _writer(path: str) -> Any:
    dcp = _classes()
    return dcp.StoreWriter(path) if _store.is_url(path) else dcp.FileSystemWriter(path, sync_files=True,
                                                                                   overwrite=False)


def _read_bytes(path: str) -> bytes:
    if _store.is_url(path):
        return _store.read_bytes(path)
    with open(path, "rb") as f:
        return f.read()
