"""Where a checkpoint's bytes go: a local directory, or an object store named by an fsspec URL
(``s3://bucket/prefix``; ``gs://``, ``az://`` and the others with their fsspec package).

Paths stay strings everywhere in ``checkpoint/``: ``os.path.join(model_dir, name)`` of a URL is
the URL of that object. The few operations that touch storage (exists, list, read, write whole,
remove) go through the functions below, which call ``os`` for a path and the URL's filesystem for
a URL. ``file://`` URLs are plain paths (:func:`local_path`). fsspec is imported only when a URL
is met: the core never needs it for local paths.

An object store keeps the guarantees of a directory by its own means (docs/checkpoints.md):

- **whole or not at all**: an object is written by one request (``put_object``), or, above
  s3fs's threshold, a multipart upload that becomes visible only when completed; a killed writer
  leaves at most an incomplete multipart upload, which no listing shows and
  :func:`abort_incomplete_uploads` removes;
- **retried with a bound**: a request that fails with a transient error (a connection reset, a
  timeout, a 5xx) is retried :data:`ATTEMPTS` times in all, with a short backoff, on top of the
  filesystem's own retries; then the error names the URL;
- **conditional writes** (:func:`create`, :func:`replace_if`): the lease of ``_lease.py``.

Storage options (endpoint, credentials: what the filesystem takes) are given once per
directory with :func:`configure`; every URL under that directory uses them.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import time
from typing import Any, Callable, Optional, TypeVar

__all__ = ["ATTEMPTS", "abort_incomplete_uploads", "check_reachable", "configure", "create", "etag_of",
           "exists", "filesystem", "is_url", "isdir", "isfile", "listdir", "local_path", "mtime", "open_file",
           "read_bytes", "read_range", "remove", "remove_if", "replace_if", "sizes", "write_bytes"]

logger = logging.getLogger("estimatorch")
T = TypeVar("T")

#: attempts of one request on a transient error (the filesystem's own retries come on top).
ATTEMPTS = 3
_BACKOFF = 0.5
#: configured roots (``protocol://bucket/prefix``, no trailing slash) -> their storage options.
_OPTIONS: dict[str, dict[str, Any]] = {}
#: errors that no retry changes.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
              ValueError, TypeError, AttributeError, KeyError)


def is_url(path: Any) -> bool:
    """True for an fsspec URL other than ``file://`` (``s3://bucket/key``, ``gs://...``)."""
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def local_path(path: Any) -> str:
    """``path`` as a string, a ``file://`` URL as the plain path it names."""
    path = os.fspath(path)
    return path[len("file://"):] if path.startswith("file://") else path


def _root(url: str) -> str:
    return url.rstrip("/")


def configure(url: str, storage_options: Optional[dict[str, Any]], arg: str = "model_dir") -> str:
    """Check ``url``'s protocol (its fsspec package installed) and keep ``storage_options`` for
    every URL under it; a path or ``file://`` URL is returned as a plain path.

    Raises:
        ValueError: an unknown protocol, naming ``arg`` and ``url``; storage options for a path.
        ImportError: the protocol's fsspec package is not installed (which one, in words).
    """
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict (fsspec's filesystem arguments), got {storage_options!r}")
    if not is_url(url):
        if storage_options:
            raise ValueError(f"storage_options are for an object store URL; {arg} {url!r} is a local path")
        return local_path(url)
    try:
        import fsspec  # optional: only object-store URLs need it
    except ImportError:
        raise ImportError(f"{arg} {url!r} is an object store URL, which needs fsspec and the protocol's package: "
                          "pip install estimatorch[s3] (for s3://)") from None
    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(f"{arg} {url!r}: unknown protocol {protocol!r} (fsspec knows "
                         f"{', '.join(sorted(fsspec.available_protocols())[:12])}, ...)") from None
    except ImportError as err:
        raise ImportError(f"{arg} {url!r}: the {protocol}:// filesystem is not installed ({err})") from None
    _OPTIONS[_root(url)] = dict(storage_options or {})
    return url


def _options_for(url: str) -> dict[str, Any]:
    roots = [root for root in _OPTIONS if url == root or url.startswith(root + "/")]
    return _OPTIONS[max(roots, key=len)] if roots else {}


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` (with its directory's storage options) and the path in it."""
    import fsspec  # optional: only object-store URLs need it

    fs, path = fsspec.core.url_to_fs(url, **_options_for(url))
    return fs, path


def _retried(what: str, url: str, call: Callable[[], T], attempts: int = ATTEMPTS) -> T:
    """``call()``, retried on a transient error (``attempts`` in all); the last error names
    ``url``, its type kept where it says something (not found, refused)."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except _PERMANENT:
            raise
        except Exception as err:  # the filesystem's own (botocore's connection errors...)
            if _precondition_failed(err):  # a conditional write that lost: an answer, not a failure
                raise
            if attempt == attempts:
                raise OSError(getattr(err, "errno", None) or 5,
                              f"cannot {what} {url!r} after {attempts} attempts: {err}") from err
            logger.warning("%s %s failed (%s): retrying (%d of %d)", what, url, err, attempt + 1, attempts)
            time.sleep(_BACKOFF * attempt)
    raise AssertionError("unreachable")


# -- what a path or URL holds ------------------------------------------------------------------
def exists(path: str) -> bool:
    """A file or directory at ``path``; an object, or objects under it, at a URL."""
    if not is_url(path):
        return os.path.exists(path)
    fs, key = filesystem(path)
    fs.invalidate_cache(key)  # another process (another rank) may have written since
    return bool(_retried("look up", path, lambda: fs.exists(key)))


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, key = filesystem(path)
    fs.invalidate_cache(key)
    return bool(_retried("look up", path, lambda: fs.isfile(key)))


def isdir(path: str) -> bool:
    """A directory; at a URL, a prefix some objects are under (never an object)."""
    if not is_url(path):
        return os.path.isdir(path)
    fs, key = filesystem(path)
    fs.invalidate_cache(key)
    return bool(_retried("look up", path, lambda: fs.isdir(key)))


def sizes(path: str) -> dict[str, int]:
    """The files right in directory ``path`` and their sizes in bytes (at a URL, the objects
    right under the prefix, from one listing); empty when there is none."""
    if not is_url(path):
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return {}
        return {entry.name: entry.stat().st_size for entry in entries if entry.is_file()}
    fs, key = filesystem(path)
    fs.invalidate_cache(key)

    def listing() -> dict[str, int]:
        try:
            found = fs.ls(key, detail=True)
        except FileNotFoundError:
            return {}
        return {os.path.basename(info["name"].rstrip("/")): int(info.get("size") or 0)
                for info in found if info.get("type") == "file"}

    return _retried("list", path, listing)


def listdir(path: str) -> list[str]:
    """The names in directory ``path``; at a URL, the objects and prefixes right under it (none
    when there are none: an object store has no empty directories)."""
    if not is_url(path):
        return os.listdir(path)
    fs, key = filesystem(path)
    fs.invalidate_cache(key)  # another process may have written since

    def names() -> list[str]:
        try:
            return [os.path.basename(entry.rstrip("/")) for entry in fs.ls(key, detail=False)]
        except FileNotFoundError:
            return []

    return _retried("list", path, names)


def mtime(path: str) -> float:
    if not is_url(path):
        return os.stat(path).st_mtime
    fs, key = filesystem(path)
    info = _retried("look up", path, lambda: fs.info(key))
    modified = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    return modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0.0)


def read_bytes(url: str) -> bytes:
    """The whole object at ``url``.

    Raises:
        FileNotFoundError: there is no such object.
        OSError: it cannot be read (after the retries), naming ``url``.
    """
    fs, key = filesystem(url)
    try:
        return _retried("read", url, lambda: fs.cat_file(key))
    except FileNotFoundError:
        raise FileNotFoundError(2, "no such object", url) from None


class _Body(io.RawIOBase):
    """A read-only file over a buffer (a ``BytesIO.getbuffer()``), sliced without copying: what
    S3's client uploads from, as a request body or, sliced, the parts of a multipart upload
    (s3fs's ``pipe_file`` takes ``len`` and slices of its data)."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view, self._pos = view.cast("B") if view.format != "B" or view.ndim != 1 else view, 0

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, part: slice) -> "_Body":
        return _Body(self._view[part])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos:self._pos + len(buffer)]
        buffer[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def read(self, size: Optional[int] = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else self._pos + size
        chunk = bytes(self._view[self._pos:end])
        self._pos += len(chunk)
        return chunk


def open_file(url: str, mode: str = "rb") -> Any:
    """The object ``url`` open for reading as a file (fsspec's: ranged requests as it is read)."""
    fs, key = filesystem(url)
    return fs.open(key, mode)


def read_range(url: str, start: int, end: Optional[int] = None) -> bytes:
    """Bytes ``start`` to ``end`` (exclusive; None: to the end) of the object ``url``; a negative
    ``start`` with no ``end``, its last ``-start`` bytes (one ranged request).

    Raises:
        FileNotFoundError: there is no such object.
        OSError: it cannot be read (after the retries), naming ``url``.
    """
    fs, key = filesystem(url)
    try:
        return _retried("read", url, lambda: fs.cat_file(key, start=start, end=end))
    except FileNotFoundError:
        raise FileNotFoundError(2, "no such object", url) from None


def write_bytes(url: str, data: Any) -> None:
    """Write ``data`` (bytes, or any buffer: a ``BytesIO.getbuffer()`` is uploaded without a copy
    of its own on S3) as the object ``url``, whole or not at all (see the module's docstring).

    Raises:
        OSError: the upload failed (after the retries), naming ``url``; the previous object of
            that name, if any, is unchanged.
    """
    fs, key = filesystem(url)
    view = memoryview(data)

    def upload() -> None:
        fs.pipe_file(key, _Body(view) if _s3(fs) else bytes(view))  # (other filesystems take bytes)

    try:
        _retried("upload", url, upload)
    except OSError as err:
        if str(url) in str(err):
            raise
        raise OSError(err.errno, f"cannot write {url!r}: {err}") from err


def save_to(url: str, obj: Any, writer: Callable[[Any, Any], None]) -> None:
    """``writer(obj, file)`` into memory, then one upload of the bytes to ``url``."""
    buffer = io.BytesIO()
    writer(obj, buffer)
    write_bytes(url, buffer.getbuffer())  # the buffer itself, not a copy of its bytes


def remove(url: str, prefix: bool = False) -> None:
    """Delete the object ``url``, or every object under the prefix ``url`` (nothing when gone).
    With ``prefix`` on S3, also the folder entry some servers keep for a prefix whose objects
    are gone (SeaweedFS lists an empty directory; on AWS S3 that is a no-op request)."""
    fs, key = filesystem(url)

    def rm() -> None:
        try:
            fs.rm(key, recursive=True)
        except FileNotFoundError:
            pass
        if prefix and _s3(fs):
            bucket, name, _ = fs.split_path(key)
            fs.call_s3("delete_object", Bucket=bucket, Key=name.rstrip("/") + "/")
            fs.invalidate_cache(key)

    _retried("remove", url, rm)


# -- conditional writes (the lease) ------------------------------------------------------------
def _s3(fs: Any) -> bool:
    return callable(getattr(fs, "call_s3", None))


def _precondition_failed(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) is the store's answer to a failed condition:
    botocore's error code when there is one, else the words of the message (a 412 status alone
    in the text could be a port or a key)."""
    for cause in (err, err.__cause__, err.__context__):
        response = getattr(cause, "response", None)
        error = response.get("Error") if isinstance(response, dict) else None
        code = error.get("Code") if isinstance(error, dict) else None
        if code is not None:
            return str(code) in ("PreconditionFailed", "412", "ConditionalRequestConflict")
    text = str(err).lower()
    return "pre-condition" in text or "precondition" in text or "conditionalrequest" in text


def etag_of(url: str) -> Optional[str]:
    """The object's entity tag (what :func:`replace_if` compares), None when there is none."""
    fs, key = filesystem(url)
    try:
        info = _retried("look up", url, lambda: fs.info(key))
    except FileNotFoundError:
        return None
    return info.get("ETag") or info.get("etag") or str(info.get("LastModified", ""))


def create(url: str, data: bytes) -> Optional[str]:
    """Write ``data`` as the object ``url`` only if there is none (S3's ``If-None-Match: *``,
    elsewhere fsspec's ``mode="create"``); its entity tag, or None when one was there."""
    fs, key = filesystem(url)
    if _s3(fs):
        bucket, name, _ = fs.split_path(key)
        try:
            out = _retried("create", url, lambda: fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data,
                                                             IfNoneMatch="*"))
        except (OSError, ValueError) as err:
            if _precondition_failed(err) or isinstance(err, FileExistsError):
                return None
            raise
        fs.invalidate_cache(key)
        return out.get("ETag")
    try:
        fs.pipe_file(key, data, mode="create")
    except FileExistsError:
        return None
    except TypeError:  # a filesystem without exclusive writes: look, then write (weaker, documented)
        if fs.exists(key):
            return None
        fs.pipe_file(key, data)
    return etag_of(url)


def replace_if(url: str, data: bytes, etag: str) -> Optional[str]:
    """Overwrite the object ``url`` only if it is still the one of ``etag`` (S3's ``If-Match``);
    the new entity tag, or None when it changed meanwhile."""
    fs, key = filesystem(url)
    if _s3(fs):
        bucket, name, _ = fs.split_path(key)
        try:
            out = _retried("replace", url, lambda: fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data,
                                                              IfMatch=etag))
        except (OSError, ValueError) as err:
            if _precondition_failed(err) or isinstance(err, FileNotFoundError):
                return None
            raise
        fs.invalidate_cache(key)
        return out.get("ETag")
    if etag_of(url) != etag:  # a filesystem without conditional writes: look, then write (weaker)
        return None
    fs.pipe_file(key, data)
    return etag_of(url)


def remove_if(url: str, etag: str, attempts: int = ATTEMPTS) -> bool:
    """Delete the object ``url`` only if it is still the one of ``etag``; whether it was."""
    fs, key = filesystem(url)
    if _s3(fs):
        bucket, name, _ = fs.split_path(key)
        try:
            _retried("remove", url, lambda: fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=etag),
                     attempts)
        except (OSError, ValueError) as err:
            if _precondition_failed(err) or isinstance(err, FileNotFoundError):
                return False
            raise
        fs.invalidate_cache(key)
        return True
    if etag_of(url) != etag:
        return False
    remove(url)
    return True


def abort_incomplete_uploads(url: str, started_before: float) -> list[str]:
    """Abort the multipart uploads under the prefix ``url`` that began before ``started_before``
    (a time.time()): what writers killed mid-upload left (they are never listed as objects, and
    the caller holds the lease, so no other live writer uploads here). Their keys' names."""
    fs, key = filesystem(url)
    if not _s3(fs):
        return []
    bucket, prefix, _ = fs.split_path(key)
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    listed = _retried("list the uploads under", url,
                      lambda: fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix))
    aborted = []
    for upload in listed.get("Uploads", []):
        initiated = upload.get("Initiated")
        if initiated is not None and hasattr(initiated, "timestamp") and initiated.timestamp() >= started_before:
            continue
        _retried("abort an upload to", url, functools.partial(
            fs.call_s3, "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]))
        aborted.append(os.path.basename(upload["Key"]))
    return aborted


def check_reachable(url: str, arg: str = "model_dir") -> None:
    """Before any work: the store answers, the credentials are taken and the bucket (or
    container) exists: one listing of ``url``, nothing written.

    Raises:
        ValueError: naming ``arg``, ``url`` and what failed, in words.
    """
    fs, key = filesystem(url)
    bucket = key.split("/", 1)[0]
    try:
        if _s3(fs):  # exists() would say False for refused credentials and an unreachable endpoint alike
            fs.call_s3("head_bucket", Bucket=bucket)
        else:
            fs.ls(bucket, detail=False)
    except FileNotFoundError:
        raise ValueError(f"{arg} {url!r}: the bucket {bucket!r} does not exist (create it first; nothing was "
                         "written)") from None
    except PermissionError as err:
        raise ValueError(f"{arg} {url!r}: the store refused the credentials ({err}); check storage_options "
                         "(key, secret) or the environment (nothing was written)") from None
    except Exception as err:  # noqa: BLE001 - the filesystem's own errors (botocore's...): said in words
        if "credential" in f"{type(err).__name__} {err}".lower():
            raise ValueError(f"{arg} {url!r}: no credentials for the store ({err}); give them in "
                             "storage_options or the environment (nothing was written)") from None
        raise ValueError(f"{arg} {url!r}: cannot reach the store ({type(err).__name__}: {err}); check the "
                         "endpoint in storage_options (nothing was written)") from None
