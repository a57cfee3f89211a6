"""Shared shadows' files: where the daemon makes them, with what modes, and that they go."""

import errno
import os
import stat
from pathlib import Path

import pytest

from meshd.services.learning import shadows

SHM = Path("/dev/shm")
needs_tmpfs = pytest.mark.skipif(not SHM.is_dir() or shadows._mount_type(SHM) != "tmpfs",
                                 reason="no tmpfs at /dev/shm")


@pytest.fixture
def data_dir(tmp_path):
    """A data dir; its /dev/shm directory is removed afterwards whatever the test left."""
    data = tmp_path / "node"
    data.mkdir()
    yield data
    private = shadows.directories(data)[0]
    if private.parent == SHM:
        if private.is_symlink():
            private.unlink()
        elif private.is_dir():
            for entry in private.iterdir():
                entry.unlink()
            private.rmdir()


def test_the_mount_type_is_that_of_the_longest_mount_point(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\nproc /proc proc rw 0 0\n")
    assert shadows._mount_type(Path("/dev/shm"), mounts) == "tmpfs"
    assert shadows._mount_type(Path("/dev"), mounts) == "ext4"
    assert shadows._mount_type(Path("/dev/shmx"), mounts) == "ext4"


@needs_tmpfs
def test_a_shadow_is_a_private_tmpfs_file_with_its_token_and_all_its_pages(data_dir):
    path, token, mapping = shadows.create(data_dir, 3 * 4096 + 5)
    try:
        directory = path.parent
        assert directory.parent == SHM and directory.name.startswith(f"meshd-{os.geteuid()}-")
        assert directory == shadows.directories(data_dir)[0]  # named for the data dir: a restart finds it
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
        info = os.lstat(path)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_size == 3 * 4096 + 5 and info.st_blocks * 512 >= info.st_size  # allocated, not sparse
        assert path.read_bytes()[:len(token)] == token and len(token) == shadows.TOKEN_BYTES
        mapping[100:104] = b"abcd"  # the mapping is the file
        assert path.read_bytes()[100:104] == b"abcd"
    finally:
        mapping.close()
    shadows.remove(path)
    assert not path.exists() and not path.parent.exists()  # the directory only lives while a file is in it


@needs_tmpfs
def test_a_name_someone_else_took_in_dev_shm_sends_the_shadow_to_the_data_dir(data_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    private = shadows.directories(data_dir)[0]
    private.symlink_to(elsewhere)  # as another user could: it is not followed
    path, _, mapping = shadows.create(data_dir, 4096)
    mapping.close()
    assert path.parent == data_dir / "shadows" and list(elsewhere.iterdir()) == []
    shadows.remove(path)
    assert shadows.clear(data_dir) == 0 and private.is_symlink()  # clear leaves what is not ours alone


def test_no_room_anywhere_says_why_for_each_place_and_leaves_no_file(data_dir, monkeypatch):
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shadows.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="No space left on device") as info:
        shadows.create(data_dir, 1 << 20)
    assert str(info.value).count("No space left") == len(shadows.directories(data_dir))
    assert all(not d.exists() for d in shadows.directories(data_dir))


def test_leftovers_of_a_dead_daemon_are_cleared(data_dir):
    places = shadows.directories(data_dir)
    for directory in places:
        directory.mkdir(mode=0o700)
        (directory / "dead.shadow").write_bytes(b"x")
    (places[-1] / "other").write_bytes(b"y")  # not a shadow: left alone, and so its directory
    assert shadows.clear(data_dir) == len(places)
    assert all(not d.exists() for d in places[:-1]) and os.listdir(places[-1]) == ["other"]
