"""Shared shadows: the file a training session's daemon and script both map (no torch here).

A session over shared memory (:mod:`.sessions`) keeps the shadow of the
script's model in a file the daemon creates, sizes for the declared tensors
(:func:`learn.tensorset.shadow_layout`), and hands to the script by path:

* where: a private directory (mode 0700, this user's, not a symlink) named
  for the data dir, ``/dev/shm/meshd-UID-DIGEST``, if ``/dev/shm`` is a
  tmpfs: its pages are memory only.  Else (no ``/dev/shm``, not a tmpfs, or
  no room: a container's is 64 MB by default) ``DATA_DIR/shadows``: it works,
  but it is a disk file, whose dirty pages the kernel writes back for
  nothing.  The directory exists only while a file is in it.
* the file: mode 0600, a random name, created exclusively (never followed
  through a link), its blocks allocated up front (``posix_fallocate``: with
  too little room the session falls back to the socket, where a write into a
  sparse mapping would kill the writer with SIGBUS), and a random token in
  its first bytes, which the script checks to know it mapped the daemon's
  file (not another with the same path in another mount namespace).
* its lifetime: removed as soon as the script said it mapped it (both keep
  their mappings; nothing else can open it after), or when the session ends
  before that, and leftovers of a daemon that died in between are removed
  when the learning service starts (:func:`clear`).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import stat
from pathlib import Path

SHM = Path("/dev/shm")
SUFFIX = ".shadow"
TOKEN_BYTES = 16
DATA_SUBDIR = "shadows"


def _mount_type(path: Path, mounts: Path = Path("/proc/self/mounts")) -> str | None:
    """The file system type of the mount ``path`` lies on (None if unknown)."""
    try:
        lines = mounts.read_text().splitlines()
        target = os.path.realpath(path)
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def directories(data_dir: Path, *, shm: Path = SHM) -> list[Path]:
    """Where this daemon's shadows may live, best first: its private directory in ``shm``
    if that is a tmpfs, then ``DATA_DIR/shadows``."""
    digest = hashlib.sha256(os.fsencode(os.path.realpath(data_dir))).hexdigest()[:16]
    found = [shm / f"meshd-{os.geteuid()}-{digest}"] if shm.is_dir() and _mount_type(shm) == "tmpfs" else []
    return found + [Path(data_dir) / DATA_SUBDIR]


def _private(directory: Path) -> None:
    """Make ``directory`` (mode 0700) unless it is there; OSError unless it is then a real
    directory of this user's, not a link (``/dev/shm`` is everyone's: someone else may have
    taken the name)."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise OSError(f"{directory} is not a directory of this user's")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(directory, 0o700)


def create(data_dir: Path, size: int, *, shm: Path = SHM) -> tuple[Path, bytes, mmap.mmap]:
    """A new shadow file of ``size`` bytes (at least the token's): its path, its token
    (written at offset 0) and the daemon's shared mapping of it.  OSError, saying why for
    each directory tried, if none would take it."""
    if size < TOKEN_BYTES:
        raise ValueError(f"a shadow is at least {TOKEN_BYTES} bytes")
    why = []
    for directory in directories(data_dir, shm=shm):
        try:
            _private(directory)
            path = directory / f"{secrets.token_hex(12)}{SUFFIX}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            why.append(f"{directory}: {exc.strerror or exc}")
            continue
        try:
            os.posix_fallocate(fd, 0, size)  # every page now, or ENOSPC now: never SIGBUS later
            token = secrets.token_bytes(TOKEN_BYTES)
            os.pwrite(fd, token, 0)
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            remove(path)
            why.append(f"{directory}: {exc.strerror or exc}")
            continue
        finally:
            os.close(fd)
        return path, token, mapping
    raise OSError("; ".join(why))


def remove(path: Path) -> None:
    """Remove the shadow file at ``path`` (gone already: fine), and its directory if now empty."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        os.rmdir(path.parent)
    except OSError:  # another session's file is in it, or it is gone
        pass


def clear(data_dir: Path, *, shm: Path = SHM) -> int:
    """Remove the shadow files a daemon of ``data_dir`` left (it died with a session in
    its handshake), and their directories; how many files.  Only this user's directories
    are touched, and only ``*.shadow`` files in them."""
    removed = 0
    for directory in directories(data_dir, shm=shm):
        try:
            info = os.lstat(directory)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        for entry in os.scandir(directory):
            if entry.name.endswith(SUFFIX) and not entry.is_dir(follow_symlinks=False):
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        try:
            os.rmdir(directory)
        except OSError:
            pass
    return removed
