"""The pool directory, opened once and used through descriptors
(the rules are :mod:`.security`'s).

The directories above it are checked by name before a missing one is
created; then, created and resolved, they are opened one by one from ``/``
without following a link and checked again through those descriptors, and
the pool directory is made and opened in the last of them (a directory
created by someone else or a link swapped meanwhile is refused, not
followed).  The pool directory is opened with ``O_NOFOLLOW | O_DIRECTORY``
and checked through its descriptor;
every file is opened relative to it with ``O_NOFOLLOW`` and checked with
``fstat``; modes and the shared group are set with ``fchmod``/``fchown`` on
those descriptors.  Nothing is ever changed by path, so a group member who
swaps a pool file for a link between a check and a use gets a refusal (the
link is not opened) or nothing (the file already open is the one used).
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from ..config import PREFIX, PoolConfigError
from ..faults import faults
from .security import (CHECKED_FILES, PRIVATE_MODES, SHARED_MODES, Verdict, group_id,
                       group_name, inspect, parent_dir_problems, parent_problems, refuse,
                       user_name)

logger = logging.getLogger("vllm.layerwise_patch")

_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_warned: set[str] = set()


def _make_parents(path: str) -> None:
    """Create the missing directories above ``path`` (0755 each, whatever
    the umask: a directory others can write would be refused)."""
    missing = []
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            continue  # (someone else's: checked with the others once all exist)
        try:  # just made by us; the umask may have narrowed it or not
            fd = os.open(d, _DIR)  # (never chmod through a link swapped in since)
        except OSError:
            continue  # (the check that follows refuses what stands there now)
        try:
            os.fchmod(fd, 0o755)
        finally:
            os.close(fd)


def _open_parent(path: str, shared_group: str | None) -> tuple[int, str]:
    """The directory above the pool as it is now (created, resolved): opened
    component by component from ``/`` without following a link, each one
    checked through its descriptor, so the directory the pool is made in is
    the one checked.  Returns its descriptor and resolved name."""
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if faults().parents_checked_first_only:  # the rule before the fix (tests)
        return os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), parent
    fd, here = os.open("/", _DIR), "/"
    try:
        problems = parent_dir_problems(here, os.fstat(fd))
        for name in [p for p in parent.split("/") if p]:
            here = os.path.join(here, name)
            try:
                fd_next = os.open(name, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    raise
                problems.append(f"{here} above it changed while the pool was opened "
                                f"({os.strerror(exc.errno).lower()})")
                break
            os.close(fd)
            fd = fd_next
            problems += parent_dir_problems(here, os.fstat(fd))
        if problems:
            base = os.path.basename(os.path.abspath(path))
            raise refuse(Verdict.of(os.path.join(parent, base), None, problems), shared_group)
    except BaseException:
        os.close(fd)
        raise
    return fd, parent


class PoolDir:
    """An open, checked pool directory (:func:`open_pool_dir`)."""

    def __init__(self, path: str, fd: int, shared_group: str | None) -> None:
        self.path, self.fd, self.shared_group = path, fd, shared_group
        self.shared_gid = group_id(shared_group)
        self.dir_mode, self.file_mode = SHARED_MODES if self.shared_gid else PRIVATE_MODES

    def _refuse(self, problems: list[str]) -> PoolConfigError:
        return refuse(Verdict.of(self.path, os.fstat(self.fd), problems), self.shared_group)

    def _own(self, fd: int, st: os.stat_result, mode: int, what: str) -> None:
        """Exact mode and the shared group on what this user owns (a group
        member's file is checked, not ours to change)."""
        if st.st_uid != os.geteuid():
            return
        if self.shared_gid is not None and st.st_gid != self.shared_gid:
            os.fchown(fd, -1, self.shared_gid)
        old = stat.S_IMODE(st.st_mode)
        if old != mode:
            if old & ~mode & 0o077:
                logger.warning("vllm-layerwise-patch pool: access to %s narrowed from %s to "
                               "%s", what, oct(old), oct(mode))
            os.fchmod(fd, mode)

    def existing(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def open(self, name: str, create: bool = True) -> int:
        """``name`` in the pool directory, read-write, created with the
        pool's file mode; never through a link; checked before it is used."""
        what = f"{name} in it"
        try:
            fd = os.open(name, os.O_RDWR | (os.O_CREAT if create else 0) | _FLAGS,
                         self.file_mode, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise self._refuse([f"{what} is a symbolic link"]) from None
            raise
        try:
            st = os.fstat(fd)
            problems = inspect(st, self.shared_gid, what, is_file=True)
            if problems:
                raise self._refuse(problems)
            self._own(fd, st, self.file_mode, os.path.join(self.path, name))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def open_pool_dir(path: str, shared_group: str | None = None) -> PoolDir:
    """Create or check the pool directory before anything is read from it."""
    shared_gid = group_id(shared_group)
    if shared_gid is not None and os.geteuid() != 0 and shared_gid not in os.getgroups():
        raise PoolConfigError(f"{PREFIX}.shared_group: this user is not a member of "
                              f"{shared_group!r}")
    problems = parent_problems(path)  # before anything is created
    if problems:
        raise refuse(Verdict.of(path, None, problems), shared_group)
    _make_parents(path)
    # ... and again as they are now, through the descriptor the pool is made in
    parent_fd, parent = _open_parent(path, shared_group)
    try:
        return _pool_dir_in(parent_fd, parent, os.path.basename(os.path.abspath(path)),
                            shared_group, shared_gid)
    finally:
        os.close(parent_fd)


def open_pool_subdir(pool: PoolDir, name: str) -> PoolDir:
    """A directory inside the (open, checked) pool directory, created and
    checked by the pool directory's rules through its descriptor: a shard of
    a sharded pool (:mod:`..backends.lmdb.sharded`)."""
    return _pool_dir_in(pool.fd, pool.path, name, pool.shared_group, pool.shared_gid)


def _pool_dir_in(parent_fd: int, parent: str, name: str, shared_group: str | None,
                 shared_gid: int | None) -> PoolDir:
    """The pool directory ``name`` made (when absent) and opened in the
    directory ``parent_fd``, checked with its files."""
    path = os.path.join(parent, name)
    dir_mode = (SHARED_MODES if shared_gid is not None else PRIVATE_MODES)[0]
    try:  # (its group and mode are set below, on the descriptor)
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        created = True
    except FileExistsError:
        created = False
    try:
        fd = os.open(name, _DIR, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            what = ("is a symbolic link" if stat.S_ISLNK(st.st_mode) else
                    "is not a directory")
            raise refuse(Verdict.of(path, st, [f"the pool path {what}"]),
                         shared_group) from None
        raise
    pool = PoolDir(path, fd, shared_group)
    try:
        st = os.fstat(fd)
        if created and shared_gid is not None:  # ours: the shared group before the check
            os.fchown(fd, -1, shared_gid)
            os.fchmod(fd, dir_mode)
            st = os.fstat(fd)
        problems = inspect(st, shared_gid, "the pool path")
        for name in CHECKED_FILES:  # nothing is created or read while any is wrong
            fst = pool.existing(name)
            if fst is not None and not problems:
                problems += inspect(fst, shared_gid, f"{name} in it", is_file=True)
        if problems:
            raise refuse(Verdict.of(path, st, problems), shared_group)
        pool._own(fd, st, dir_mode, path)
        if shared_gid is not None and not os.fstat(fd).st_mode & stat.S_ISVTX:
            _warn_once(path, "vllm-layerwise-patch pool: the shared pool directory %s (owner "
                       "%s, group %s) has no sticky bit: any member of the group can remove "
                       "or replace another member's pool files. Its owner can fix that: "
                       "chmod +t %s", path, user_name(st.st_uid), group_name(st.st_gid), path)
    except BaseException:
        pool.close()
        raise
    return pool
