"""One ingest at a time into a local database: an exclusive advisory lock on a file in its folder.

Two ingests writing the same tables at once hit LanceDB commit conflicts; each rolls back, and the
rollback of one breaks the other, so both failed. The second ingest therefore stops before it reads
its input. The lock is `flock`'s: the kernel drops it when its process ends, even by kill -9, so a
lock file left behind never blocks a later ingest (its existence means nothing). Object stores have
no such lock: there the writer's commit-time generation check decides (the later commit gives way).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from drift_lance.errors import IngestError, StoreError
from drift_lance.object_store import check_not_a_file, connect_uri, is_local_uri

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, the commit-time check remains
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "IngestLock"]

LOCK_FILE = ".drift-lance-ingest.lock"


def local_folder(uri: str) -> Path | None:
    """The folder of a local database URI (a path or file://), None for object storage."""
    if not is_local_uri(uri):
        return None
    parsed = urlparse(uri)
    return Path(parsed.path if parsed.scheme == "file" else connect_uri(uri))


class IngestLock:
    """The exclusive ingest lock of the database at `uri` (nothing to lock on object storage)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.folder = local_folder(uri)
        self._fd: int | None = None
        self._created: list[Path] = []  # folders take(create=True) made, the database's first

    def take(self, *, create: bool) -> None:
        """Lock the database, or raise IngestError naming it when another ingest holds the lock. A
        database folder that does not exist yet is only created when `create` (not before the input
        is validated: bad input writes nothing); until then there is nothing another ingest could
        break, and a later take(create=True) locks it."""
        check_not_a_file(self.uri)
        if self._fd is not None or self.folder is None or fcntl is None:
            return
        if not self.folder.is_dir():
            if not create:
                return
            self._create_folder()
        fd = self._open_lock_file()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _recorded_pid(fd)
            os.close(fd)
            raise IngestError(
                f"{self.uri}: another ingest{f' (pid {holder})' if holder else ''} is writing to this database; "
                "nothing was written, run it again once that one has finished"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # named in the error of an ingest that has to wait
        self._fd = fd

    def release(self, *, failed: bool = False) -> None:
        """Unlock. After a failed first ingest, the folder this lock created goes too when nothing
        but the lock file is left in it (the rollback dropped the tables): no half-made database."""
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the lock
            self._fd = None
        if failed and self._created and self.folder is not None:
            try:
                if [entry.name for entry in self.folder.iterdir()] == [LOCK_FILE]:
                    (self.folder / LOCK_FILE).unlink()
                    for folder in self._created:  # then the parents it made (--db new/dir/db)
                        folder.rmdir()
            except OSError:  # best effort: a lock file left behind never blocks a later ingest
                pass

    def _create_folder(self) -> None:
        assert self.folder is not None
        missing = [folder for folder in (self.folder, *self.folder.parents) if not folder.exists()]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._created = missing
        except OSError as exc:
            raise StoreError(f"{self.uri}: cannot create the database folder: {exc.strerror or exc}") from exc

    def _open_lock_file(self) -> int:
        assert self.folder is not None
        path = self.folder / LOCK_FILE
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"{path}: cannot open the ingest lock file: {exc.strerror or exc}") from exc


def _recorded_pid(fd: int) -> int | None:
    """The pid the holder wrote into the lock file (None if it has not yet, or the file is odd)."""
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None
