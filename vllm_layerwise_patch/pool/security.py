"""Who may read and write the pool directory.

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
  0770 (plus setgid, so new files inherit the group) and the files 0660; an
  existing path must carry that group, and others get no access.  Any member
  of the group may own it.

The same checks apply to the lock files and the data file.
"""

from __future__ import annotations

import dataclasses
import grp
import logging
import os
import pwd
import stat

from .config import PREFIX, PoolConfigError

logger = logging.getLogger("vllm.layerwise_patch")

#: files the LMDB backend keeps in the pool directory
POOL_FILES = ("data.mdb", "lock.mdb", ".open.lock", "generation")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
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


def _group_id(shared_group: str) -> int:
    try:
        return grp.getgrnam(shared_group).gr_gid
    except KeyError:
        raise PoolConfigError(
            f"{PREFIX}.shared_group: no group named {shared_group!r} on this machine") from None


def _inspect(st: os.stat_result, shared_gid: int | None, what: str) -> list[str]:
    problems = []
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return [f"{what} is a symbolic link (a pool path must be the directory itself)"]
    if shared_gid is None:
        if st.st_uid != uid:
            problems.append(f"{what} is owned by {_user(st.st_uid)}, not by this user "
                            f"({_user(uid)})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            problems.append(f"{what} is writable by group or others")
    else:
        if st.st_gid != shared_gid:
            problems.append(f"{what} has group {_group(st.st_gid)}, not the shared group "
                            f"{_group(shared_gid)}")
        if st.st_mode & stat.S_IWOTH:
            problems.append(f"{what} is writable by others")
        if st.st_uid != uid and st.st_mode & (stat.S_IROTH | stat.S_IXOTH):
            problems.append(f"{what} is readable by others")
    return problems


def check_pool_path(path: str, shared_group: str | None = None) -> Verdict:
    """Inspect ``path`` and its files without changing or reading anything."""
    shared_gid = _group_id(shared_group) if shared_group else None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Verdict(path, exists=False)
    v = Verdict(path, exists=True, owner=_user(st.st_uid), group=_group(st.st_gid),
                mode=oct(stat.S_IMODE(st.st_mode)))
    v.problems = _inspect(st, shared_gid, "the pool path")
    if not v.problems and not stat.S_ISDIR(st.st_mode):
        v.problems.append("the pool path is not a directory")
    if not v.problems:
        for name in POOL_FILES:
            try:
                fst = os.lstat(os.path.join(path, name))
            except FileNotFoundError:
                continue
            v.problems += _inspect(fst, shared_gid, f"{name} in it")
    v.ok = not v.problems
    return v


def _fix_modes(path: str, shared_gid: int | None) -> None:
    """Exact modes (and the shared group) on what this user owns."""
    dir_mode, file_mode = (0o700, 0o600) if shared_gid is None else (0o2770, 0o660)
    uid = os.geteuid()
    tightened = []
    for name, mode in [(None, dir_mode)] + [(n, file_mode) for n in POOL_FILES]:
        p = path if name is None else os.path.join(path, name)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if st.st_uid != uid:
            continue  # a group member's file (shared mode): checked, not ours to change
        if shared_gid is not None and st.st_gid != shared_gid:
            os.chown(p, -1, shared_gid)
        if stat.S_IMODE(st.st_mode) != mode:
            if stat.S_IMODE(st.st_mode) & ~mode & 0o077:
                tightened.append(f"{p} {oct(stat.S_IMODE(st.st_mode))}")
            os.chmod(p, mode)
    if tightened:
        logger.warning("vllm-layerwise-patch pool: access narrowed to %s for %s",
                       "this user" if shared_gid is None else "its group",
                       ", ".join(tightened))


def refuse(v: Verdict, shared_group: str | None) -> PoolConfigError:
    fix = ("point kv_connector_extra_config.path at a directory of your own (the default "
           "is per user), or remove this one" if shared_group is None else
           f"give the directory group {shared_group} with mode 2770 and its files 0660 "
           "(chgrp -R / chmod), or choose another path")
    return PoolConfigError(f"{PREFIX}.path: refusing the pool at {v.summary()}. Fix: {fix}. "
                           "Nothing was read from it.")


def prepare_pool_dir(path: str, shared_group: str | None = None) -> int:
    """Create or check the pool directory before anything is read from it;
    returns the file mode the backend creates its files with."""
    shared_gid = _group_id(shared_group) if shared_group else None
    if shared_gid is not None and os.geteuid() != 0 and shared_gid not in os.getgroups():
        raise PoolConfigError(f"{PREFIX}.shared_group: this user is not a member of "
                              f"{shared_group!r}")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700 if shared_gid is None else 0o770)
    except FileExistsError:
        pass
    else:  # ours: give it the shared group before the check
        if shared_gid is not None:
            os.chown(path, -1, shared_gid)
            os.chmod(path, 0o2770)
    v = check_pool_path(path, shared_group)
    if not v.ok:
        raise refuse(v, shared_group)
    _fix_modes(path, shared_gid)
    return 0o600 if shared_gid is None else 0o660


def fix_file_modes(path: str, shared_group: str | None = None) -> None:
    """After the backend created its files: exact modes whatever the umask."""
    _fix_modes(path, _group_id(shared_group) if shared_group else None)
