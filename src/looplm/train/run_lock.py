"""One trainer per run directory: an exclusive lock held for the life of a training run.

Two ``looplm train`` processes writing into the same ``--out`` would interleave ``metrics.jsonl``
and delete each other's temporary checkpoints. :class:`RunDirLock` takes ``fcntl.flock(LOCK_EX)``
on ``OUT/train.lock`` without waiting: a second trainer fails at once with
:class:`RunDirLockedError`, naming the directory and the holder's pid and host (written into the
lock file). The operating system releases the lock when the holder exits, however it exits
(normal end, exception, ``kill -9``), so a crashed run never leaves a stale lock behind; the file
itself stays (it is not the lock, only where it lives).

Only rank 0 of a distributed run takes it (the trainer broadcasts a refusal to every rank).
On NFS, Linux implements ``flock`` with byte-range locks that the server arbitrates, so two nodes
are kept apart too. Without ``fcntl`` (Windows) no lock is taken.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

__all__ = ["LOCK_FILE", "RunDirLock", "RunDirLockedError"]

LOCK_FILE = "train.lock"


class RunDirLockedError(RuntimeError):
    """Another trainer holds the run directory."""


class RunDirLock:
    """An exclusive, non-blocking lock on ``out_dir`` (created if needed); a context manager.

    >>> with RunDirLock("runs/x"):      # raises RunDirLockedError if another process holds it
    ...     train_into("runs/x")
    """

    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_FILE
        self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self) -> RunDirLock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - no flock on this platform: run unprotected
            return self
        if self.held:
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = _describe_holder(f.read())
            f.close()
            raise RunDirLockedError(
                f"run directory {str(self.out_dir)!r} is in use by another `looplm train` ({holder}): two trainers "
                "in one directory would overwrite each other's metrics and checkpoints. Wait for that run to finish "
                "or stop it (it resumes from its last checkpoint), or train into another --out."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            )
        )
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        """Give the directory back (closing the file releases the lock)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _describe_holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (ValueError, KeyError, TypeError):  # the holder has not written its pid yet
        return "pid unknown"
