"""Group write is harmless where the group is the owner's own (a user private group).

Debian and most distributions give each user a group of their own and a umask of 002, so a
checkout's golden files are mode 0664 and its folders 0775. The trust rules refused every
such file ("writable by others"), so a user on those systems could never use their own
goldens. Debian's OpenSSH (user-group-modes) draws the line where it belongs: group write
counts as someone else's only if the group has a member other than the owner, or none at
all. Here root's primary group (gid 0, no other member on this machine) is such a group;
``users`` (gid 100, no member) is not, and neither is ``daemon``, the primary group of
another user.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
from pathlib import Path

import pytest

from aftershock.faults.journal import others_can_write, unsafe_folder
from aftershock.harness.twin import golden
from aftershock.harness.twin._paths import untrusted


def _mine() -> int:
    """My primary group, which must have no other member for the control to mean anything."""
    me = pwd.getpwuid(os.geteuid())
    others = [p.pw_name for p in pwd.getpwall() if p.pw_gid == me.pw_gid and p.pw_uid != me.pw_uid]
    members = [m for m in grp.getgrgid(me.pw_gid).gr_mem if m != me.pw_name]
    if others or members:
        pytest.skip(f"this user's primary group also holds {others + members}")
    return me.pw_gid


def _shared() -> int:
    for name in ("users", "daemon", "nogroup"):
        try:
            gid = grp.getgrnam(name).gr_gid
        except KeyError:
            continue
        if gid != pwd.getpwuid(os.geteuid()).pw_gid:
            return gid
    pytest.skip("no group here that is not this user's own")


def _golden(tmp_path: Path, gid: int, mode: int = 0o664, folder_mode: int = 0o775) -> Path:
    folder = tmp_path / "scenarios"
    folder.mkdir()
    path = folder / "golden.json"
    path.write_text(json.dumps({"goldens": []}))
    for each, bits in ((folder, folder_mode), (path, mode)):
        os.chown(each, os.geteuid(), gid)
        os.chmod(each, bits)
    return path


def test_a_umask_002_checkout_in_my_own_group_is_trusted(tmp_path: Path) -> None:
    path = _golden(tmp_path, _mine())
    assert not others_can_write(os.stat(path))
    assert unsafe_folder(path.parent) is None
    assert untrusted(path) is None
    assert golden.distrust(path) is None
    assert golden.read(path) == []


@pytest.mark.parametrize("what", ["file", "folder"])
def test_group_write_for_a_group_that_is_not_mine_is_refused(tmp_path: Path, what: str) -> None:
    path = _golden(tmp_path, _mine())
    os.chown(path if what == "file" else path.parent, os.geteuid(), _shared())
    assert "writable by others" in str(golden.distrust(path))
    with pytest.raises(ValueError, match="not trusted"):
        golden.read(path)


def test_world_write_is_refused_even_in_my_own_group(tmp_path: Path) -> None:
    path = _golden(tmp_path, _mine(), mode=0o666)
    assert others_can_write(os.stat(path))
    assert "writable by others (mode 0666" in str(untrusted(path))
