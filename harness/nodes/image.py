"""The base image of every node: built on the spot, no registry, through the Docker SDK.

No image can be pulled here (and CI has no registry either), so the base is a root
filesystem of a few kilobytes made in memory and brought in with the engine's import (what
``docker import`` does): the folders a Linux userland expects, the host's ``/etc`` basics,
and links for a merged ``/usr``. The programs come from the host at run time, mounted
read-only at the same paths (:func:`host_mounts`): ``/usr`` (the dynamic loader, libc, the
shell, torchrun's Python), the Python installation and virtual environment that run the
harness, and the project itself, so torch is never copied and a node runs exactly the
code and libraries the harness was tested with. Building it takes well under a second.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from aftershock._root import ROOT

# Bump the tag when the layout below changes: an older base is then rebuilt, not reused.
BASE_IMAGE = "aftershock/base:2"
IMAGE_LABEL = "aftershock.image"
PROJECT_ROOT = ROOT  # the folder holding the aftershock package: nodes import this copy
# /etc files a process of the host's userland reads: users and groups (whoami, Python's pwd),
# name service order, the dynamic loader's cache (torch's libraries are found through it).
_ETC = ("passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "host.conf")


def _add(tar: tarfile.TarFile, name: str, kind: bytes, mode: int, *, target: str = "",
         data: bytes = b"") -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.mtime = 0  # the same bytes on every build
    if kind == tarfile.SYMTYPE:
        info.linkname = target
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data else None)


def rootfs() -> bytes:
    """The base image's root filesystem, as a tar archive."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder in ("proc", "sys", "dev", "etc", "root", "run", "var", "home", "usr", "opt",
                       "mnt", "work"):
            _add(tar, folder, tarfile.DIRTYPE, 0o755)
        for folder in ("tmp", "var/tmp"):
            _add(tar, folder, tarfile.DIRTYPE, 0o1777)
        # /sbin is a folder of its own: the engine mounts its init (docker-init) there, which
        # it cannot do through a link into the read-only /usr.
        _add(tar, "sbin", tarfile.DIRTYPE, 0o755)
        # Merged /usr (Debian 12, Ubuntu 22.04+): /bin, /lib... are links into /usr, which is
        # mounted from the host. A host without it has them mounted as folders instead.
        for top in ("bin", "lib", "lib64", "lib32", "libx32"):
            host = Path("/") / top
            if host.is_symlink():
                _add(tar, top, tarfile.SYMTYPE, 0o777, target=os.readlink(host))
            elif host.is_dir():
                _add(tar, top, tarfile.DIRTYPE, 0o755)
        for name in _ETC:
            path = Path("/etc") / name
            if path.is_file():
                _add(tar, f"etc/{name}", tarfile.REGTYPE, 0o644, data=path.read_bytes())
        if Path("/etc/ld.so.conf.d").is_dir():
            _add(tar, "etc/ld.so.conf.d", tarfile.DIRTYPE, 0o755)
            for conf in sorted(Path("/etc/ld.so.conf.d").glob("*.conf")):
                _add(tar, f"etc/ld.so.conf.d/{conf.name}", tarfile.REGTYPE, 0o644,
                     data=conf.read_bytes())
    return buffer.getvalue()


def ensure_base(api: Any, *, rebuild: bool = False) -> tuple[str, float]:
    """The base image's id, imported now if missing (or ``rebuild``); and how long that took
    (0 when it was there)."""
    import docker

    if not rebuild:
        try:
            return str(api.images.get(BASE_IMAGE).id), 0.0
        except docker.errors.ImageNotFound:
            pass
    started = time.monotonic()
    repository, tag = BASE_IMAGE.split(":")
    api.api.import_image_from_data(
        rootfs(), repository=repository, tag=tag,
        changes=[f"LABEL {IMAGE_LABEL}=base", "ENV PATH=/usr/local/sbin:/usr/local/bin:"
                 "/usr/sbin:/usr/bin:/sbin:/bin"],
    )
    image = api.images.get(BASE_IMAGE)
    return str(image.id), time.monotonic() - started


def host_mounts() -> list[str]:
    """Read-only binds that give a node the host's programs at the same paths: ``/usr``, the
    folders a non-merged host keeps beside it, the Python installation and the virtual
    environment running this harness, and the project (an editable install points there)."""
    paths: list[Path] = [Path("/usr")]
    paths += [Path("/") / top for top in ("bin", "lib", "lib64", "lib32", "libx32")
              if (Path("/") / top).is_dir() and not (Path("/") / top).is_symlink()]
    for prefix in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))):
        paths.append(Path(os.path.realpath(prefix)))
    paths.append(PROJECT_ROOT)
    kept: list[Path] = []
    for path in sorted(set(paths), key=lambda p: len(p.parts)):
        if not any(path == k or path.is_relative_to(k) for k in kept):
            kept.append(path)
    return [f"{p}:{p}:ro" for p in kept]


def main(argv: list[str] | None = None) -> int:
    """``python -m aftershock.harness.nodes.image``: build the base image (CI's engine step)."""
    import argparse
    import contextlib

    parser = argparse.ArgumentParser(prog="python -m aftershock.harness.nodes.image",
                                     description=__doc__)
    parser.add_argument("--rebuild", action="store_true", help="import it even if present")
    args = parser.parse_args(argv)
    from aftershock.faults import docker_engine as _docker

    problem = _docker.engine_problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 3
    with contextlib.closing(_docker.client()) as api:
        image_id, took = ensure_base(api, rebuild=args.rebuild)
    print(f"{BASE_IMAGE} {image_id[:19]} " + (f"built in {took:.2f}s" if took else "present"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
