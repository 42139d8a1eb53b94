"""Where the pool and this user's other overlay files live.

* The default pool path is per user: ``/dev/shm/vllm-layerwise-pool-<uid>``
  (tmpfs: RAM; ``~/.cache/vllm-layerwise-pool`` where there is no
  ``/dev/shm``).  Every engine of one user finds it, whatever its session.
* Anybody can create that name in ``/dev/shm`` first.  When the default path
  is held by someone else (or is unsafe), an engine whose ``path`` was not
  configured does not refuse to start: it warns once and uses
  :func:`private_fallback_path` - ``/dev/shm/vllm-layerwise-pool-<uid>-<token>``
  with a random token kept in this user's cache directory, so nobody else can
  know the name in advance, and all of this user's engines still agree on it.
  An explicitly configured path is still refused (:mod:`.security`).
  ``$XDG_RUNTIME_DIR`` is not used: systemd caps it at a fraction of RAM
  (a pool of several GiB does not fit) and removes it at logout, under
  engines still running.
* :func:`user_cache_dir` (``$XDG_CACHE_HOME/vllm-layerwise-patch``, else
  ``~/.cache/vllm-layerwise-patch``) holds the token and the weights' digest
  cache (:mod:`.digests`); it is created 0700 and used only when it is this
  user's own and nobody else can write it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat

logger = logging.getLogger("vllm.layerwise_patch")

_warned: set[str] = set()


def default_path() -> str:
    """This user's default pool directory."""
    if os.path.isdir("/dev/shm"):
        return os.path.join("/dev/shm", f"vllm-layerwise-pool-{os.geteuid()}")
    return os.path.join(os.path.expanduser("~"), ".cache", "vllm-layerwise-pool")


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def _own_private_dir(path: str) -> bool:
    """``path`` is a directory of this user that nobody else can write
    (made 0700 when it is ours and looser)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return False
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
        return True
    finally:
        os.close(fd)


def user_cache_dir(*sub: str) -> str | None:
    """This user's private cache directory (and ``sub`` below it), created
    0700; None, logged once, when it cannot be had privately."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.path.join(base, "vllm-layerwise-patch")
    path = os.path.join(root, *sub)
    try:
        os.makedirs(base, exist_ok=True)
        for i in range(len(sub) + 1):
            d = os.path.join(root, *sub[:i])
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
            if not _own_private_dir(d):
                raise PermissionError(f"{d} is not a directory of this user that only it "
                                      "can write")
    except OSError as exc:
        _warn_once(f"cache:{path}", "vllm-layerwise-patch: no private cache directory (%s); "
                   "weights digests are not kept across restarts", exc)
        return None
    return path


def _token() -> str | None:
    """A random name part kept in this user's cache directory (created once,
    by whichever process comes first)."""
    where = user_cache_dir()
    if where is None:
        return None
    path = os.path.join(where, "pool-token")
    if not os.path.lexists(path):  # written whole, then linked: never seen half-written
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(8))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process was first: its token
        except OSError:
            return None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        token = f.read().strip()
    return token if len(token) == 16 and all(c in "0123456789abcdef" for c in token) else None


def private_fallback_path() -> str | None:
    """Where this user's pool goes when the default path is held by someone
    else: a name nobody else can know in advance (None without a private
    cache directory to keep its token in)."""
    token = _token()
    if token is None:
        return None
    return f"{default_path()}-{token}"


def warn_fallback(default: str, fallback: str, why: str) -> None:
    _warn_once(f"fallback:{default}", "vllm-layerwise-patch pool: the default pool path %s "
               "cannot be used (%s); using this user's private fallback %s instead. "
               "Set kv_connector_extra_config.path to choose the place yourself",
               default, why, fallback)
