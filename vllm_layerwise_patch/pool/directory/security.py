"""Who may read and write the pool directory: the rules, and the read-only
verdict ``doctor`` prints.  :mod:`.directory.descriptors` applies them through file
descriptors when the pool is opened.

A prefix cache is a trust boundary: its KV pages and states reveal the
prompts they were computed from, and an entry planted by someone else under
the right namespace (derived from public facts) reaches this engine's tokens.
So, before anything is read:

* private (default): the directory is created 0700 and its files 0600, owned
  by this user, whatever the umask; an existing path that is a symlink, is
  owned by another user, or is writable by group or others is refused with
  the path, its owner and mode, and the fix.  Our own directory or files that
  are merely readable by others are tightened (logged once).
* shared (``shared_group: NAME``): the directory carries group NAME with
  mode 3770 (setgid: new files inherit the group; sticky: a member cannot
  remove or replace another member's files) and the files 0660; an existing
  path must carry that group, and others get no access.  Any member of the
  group may own it.
* every pool file must be a regular file with one link (a hard link would
  make the pool write into a file that lives elsewhere too).
* every directory above the pool, up to ``/``, must be owned by root or this
  user and writable by nobody else - unless it has the sticky bit (then
  others may write only if root owns it, like ``/dev/shm`` and ``/tmp``):
  whoever can write there could replace the pool directory.  They are
  checked before a missing one is created, and again once created and
  resolved, through descriptors opened one by one from ``/`` without
  following a link (:mod:`.directory.descriptors`): a directory created or
  a link swapped meanwhile is what the second check sees.

A group member is trusted with entries, not with this user's other files:
modes and owners are set through descriptors opened without following
links (``fchmod``/``fchown``), never by path, and LMDB maps exactly the files
that were checked (:mod:`.backends.lmdb.files`), so swapping a pool file for
a link between a check and a use cannot redirect a write.
"""

from __future__ import annotations

import dataclasses
import grp
import logging
import os
import pwd
import re
import stat

from ..config import PREFIX, PoolConfigError

logger = logging.getLogger("vllm.layerwise_patch")

#: files the LMDB backend keeps in the pool directory
POOL_FILES = ("data.mdb", "lock.mdb", ".open.lock", "generation")
#: and the file a pool records its shard count in (.backends.lmdb.shards)
CHECKED_FILES = POOL_FILES + ("shards",)
PRIVATE_MODES, SHARED_MODES = (0o700, 0o600), (0o3770, 0o660)


class UnsafePoolPath(PoolConfigError):
    """The pool path (or a file in it, or a directory above it) is refused."""

    verdict: Verdict | None = None


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


@dataclasses.dataclass
class Verdict:
    path: str
    exists: bool
    owner: str = "-"
    group: str = "-"
    mode: str = "-"
    ok: bool = True
    problems: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        where = (f"{self.path} (owner {self.owner}, group {self.group}, mode {self.mode})"
                 if self.exists else f"{self.path} (not created yet)")
        return where + (": ok" if self.ok else ": refused - " + "; ".join(self.problems))

    @classmethod
    def of(cls, path: str, st: os.stat_result | None, problems: list[str]) -> Verdict:
        if st is None:
            return cls(path, exists=False, ok=not problems, problems=problems)
        return cls(path, True, user_name(st.st_uid), group_name(st.st_gid),
                   oct(stat.S_IMODE(st.st_mode)), not problems, problems)


def group_id(shared_group: str | None) -> int | None:
    if not shared_group:
        return None
    try:
        return grp.getgrnam(shared_group).gr_gid
    except KeyError:
        raise PoolConfigError(
            f"{PREFIX}.shared_group: no group named {shared_group!r} on this machine") from None


def inspect(st: os.stat_result, shared_gid: int | None, what: str,
            is_file: bool = False) -> list[str]:
    """What is wrong with the pool directory or one of its files."""
    problems = []
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return [f"{what} is a symbolic link"]
    if is_file and not stat.S_ISREG(st.st_mode):
        return [f"{what} is not a regular file"]
    if is_file and st.st_nlink > 1:
        problems.append(f"{what} has {st.st_nlink} hard links (it is also a file elsewhere)")
    if shared_gid is None:
        if st.st_uid != uid:
            problems.append(f"{what} is owned by {user_name(st.st_uid)}, not by this user "
                            f"({user_name(uid)})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            problems.append(f"{what} is writable by group or others")
    else:
        if st.st_gid != shared_gid:
            problems.append(f"{what} has group {group_name(st.st_gid)}, not the shared group "
                            f"{group_name(shared_gid)}")
        if st.st_mode & stat.S_IWOTH:
            problems.append(f"{what} is writable by others")
        if st.st_uid != uid and st.st_mode & (stat.S_IROTH | stat.S_IXOTH):
            problems.append(f"{what} is readable by others")
    return problems


def ancestors(path: str) -> list[str]:
    """The existing directories above ``path`` (symbolic links resolved),
    from ``/`` down."""
    d = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    chain = [d]
    while d != os.path.dirname(d):
        d = os.path.dirname(d)
        chain.append(d)
    return [d for d in reversed(chain) if os.path.isdir(d)]


def parent_dir_problems(d: str, st: os.stat_result) -> list[str]:
    """What lets someone else rename the pool in ``d``, a directory above
    it (``st``: its status)."""
    problems = []
    owner = user_name(st.st_uid)
    if st.st_uid not in (0, os.geteuid()):
        problems.append(f"{d} above it is owned by {owner} (neither root nor this user)")
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not (sticky and st.st_uid == 0):
        problems.append(f"{d} above it is writable by others "
                        f"({oct(stat.S_IMODE(st.st_mode))}, owner {owner})"
                        + ("" if sticky else " without the sticky bit"))
    elif st.st_mode & stat.S_IWGRP and not sticky:
        problems.append(f"{d} above it is writable by its group {group_name(st.st_gid)} "
                        f"({oct(stat.S_IMODE(st.st_mode))}) without the sticky bit")
    return problems


def parent_problems(path: str) -> list[str]:
    """Directories above the pool that someone else could rename it in."""
    return [p for d in ancestors(path) for p in parent_dir_problems(d, os.stat(d))]


def check_pool_path(path: str, shared_group: str | None = None) -> Verdict:
    """Inspect ``path``, its files and the directories above it without
    changing or reading anything (``doctor``)."""
    shared_gid = group_id(shared_group)
    problems = parent_problems(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Verdict.of(path, None, problems)
    problems += inspect(st, shared_gid, "the pool path")
    if not problems and not stat.S_ISDIR(st.st_mode):
        problems.append("the pool path is not a directory")
    if not problems:
        problems += _file_problems(path, "", shared_gid)
    if not problems:  # a sharded pool's shards (.backends.lmdb.shards), by the same rules
        for name in sorted(os.listdir(path)):
            if _SHARD.match(name):
                sub = os.path.join(path, name)
                problems += inspect(os.lstat(sub), shared_gid, f"{name} in it")
                if not problems and os.path.isdir(sub):
                    problems += _file_problems(sub, f"{name}/", shared_gid)
    return Verdict.of(path, st, problems)


_SHARD = re.compile(r"^shard-\d{2}$")


def _file_problems(path: str, label: str, shared_gid: int | None) -> list[str]:
    problems = []
    for name in CHECKED_FILES:
        try:
            fst = os.lstat(os.path.join(path, name))
        except FileNotFoundError:
            continue
        problems += inspect(fst, shared_gid, f"{label}{name} in it", is_file=True)
    return problems


def refuse(v: Verdict, shared_group: str | None) -> UnsafePoolPath:
    fix = ("point kv_connector_extra_config.path at a directory of your own (the default "
           "is per user), or remove this one" if shared_group is None else
           f"give the directory group {shared_group} with mode 3770 and its files 0660 "
           "(chgrp -R / chmod), or choose another path")
    if any("above it" in p for p in v.problems):
        fix = ("put the pool under directories that only root or this user can write "
               "(or that have the sticky bit, like /dev/shm)")
    err = UnsafePoolPath(f"{PREFIX}.path: refusing the pool at {v.summary()}. Fix: {fix}. "
                         "Nothing was read from it.")
    err.verdict = v
    return err
