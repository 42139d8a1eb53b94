"""A shared pool that a group member cannot turn against another member, and
a default path another user cannot deny (real LMDB; the last test starts a
real engine).

The attacker is a second user in the pool's group: a real account
(``vlp-pool-attacker`` in group ``vlp-pool-share``, created with useradd when
missing) or, where accounts cannot be created, a fake uid with no account
(``FAKE_ATTACKER_UID``) - the kernel checks the same permissions either way.  The
victim is this test process (root: any path it follows, it can change).
Each race is driven deterministically: the attacker acts at the exact point
between the victim's check and its use (a hook on the victim's file opens,
or on ``lmdb.open``).  Every race has a negative control: the same action
against the path-based steps the pool used before (check with ``lstat``,
then ``chmod``/``chown``/``lmdb.open`` by name) changes the victim's file.
"""

from __future__ import annotations

import dataclasses
import grp
import hashlib
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from vllm_layerwise_patch.pool.directory import descriptors
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.directory.security import POOL_FILES, UnsafePoolPath

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="a second user acts on the pool: needs root")

SHARE, ATTACKER = "vlp-pool-share", "vlp-pool-attacker"
FAKE_ATTACKER_UID = 60301  # no account: used where useradd cannot run
MiB = 1 << 20


@dataclasses.dataclass
class Person:
    label: str
    uid: int
    gid: int  # the share group


def _accounts() -> tuple[str, Person]:
    """(share group name, attacker): a real account where root can create
    one, else a fake uid in the group ``users``."""
    try:
        try:
            grp.getgrnam(SHARE)
        except KeyError:
            subprocess.run(["groupadd", SHARE], check=True, capture_output=True)
        try:
            pwd.getpwnam(ATTACKER)
        except KeyError:
            subprocess.run(["useradd", "-M", "-N", "-g", SHARE, "-s", "/usr/sbin/nologin",
                            ATTACKER], check=True, capture_output=True)
        return SHARE, Person(f"user {ATTACKER}", pwd.getpwnam(ATTACKER).pw_uid,
                             grp.getgrnam(SHARE).gr_gid)
    except (OSError, subprocess.CalledProcessError):
        return "users", Person(f"fake uid {FAKE_ATTACKER_UID}", FAKE_ATTACKER_UID,
                               grp.getgrnam("users").gr_gid)


@pytest.fixture(scope="module")
def people():
    return _accounts()


def as_user(who: Person, cmd: str, cwd: Path, check: bool = True):
    return subprocess.run(["sh", "-c", cmd], cwd=str(cwd), user=who.uid, group=who.gid,
                          extra_groups=[who.gid], capture_output=True, text=True,
                          check=check, env={"PATH": "/usr/bin:/bin"})


@pytest.fixture
def base():
    """A directory like /dev/shm: root's, sticky, everyone may create in it
    (pytest's tmp_path is root's only)."""
    d = Path(tempfile.mkdtemp(prefix="vlp-race-"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def snapshot(p: Path) -> tuple:
    st = os.lstat(p)
    return (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size,
            hashlib.sha256(p.read_bytes()).hexdigest())


def secret(base: Path, name: str = "secret") -> Path:
    """A file of the victim's that nobody else may read."""
    p = base / name
    p.write_bytes(b"the victim's private data\n")
    p.chmod(0o600)
    return p


def attacker_pool(people, base: Path) -> Path:
    """A shared pool directory the attacker made (mode 3770: the sticky bit
    does not stop the directory's owner), with the victim's files in it."""
    share, attacker = people
    as_user(attacker, f"mkdir pool && chgrp {share} pool && chmod 3770 pool", base)
    LmdbBackend(str(base / "pool"), 16 * MiB, shared_group=share).close()
    assert {os.lstat(base / "pool" / n).st_uid for n in POOL_FILES} == {0}
    return base / "pool"


def swap(people, pool: Path, name: str, target: Path) -> None:
    """The attacker replaces ``name`` in the pool with a link to ``target``."""
    as_user(people[1], f"rm -f {name} && ln -s {target} {name}", pool)


@pytest.mark.parametrize("name", POOL_FILES)
def test_a_file_swapped_for_a_link_before_its_open_is_refused(people, base, monkeypatch, name):
    pool, victim = attacker_pool(people, base), secret(base)
    before = snapshot(victim)
    opened = descriptors.PoolDir.open

    def racing_open(self, n, *a, **kw):  # the race: right after the checks, before the open
        if n == name:
            swap(people, pool, n, victim)
        return opened(self, n, *a, **kw)

    monkeypatch.setattr(descriptors.PoolDir, "open", racing_open)
    with pytest.raises(UnsafePoolPath, match=f"{name} in it is a symbolic link"):
        LmdbBackend(str(pool), 16 * MiB, shared_group=people[0])
    assert snapshot(victim) == before


@pytest.mark.parametrize("name", POOL_FILES)
def test_negative_control_a_chmod_by_path_after_the_check_hands_over_the_file(
        people, base, name):
    share, attacker = people
    pool, victim = attacker_pool(people, base), secret(base)
    before = snapshot(victim)
    p = pool / name
    st = os.lstat(p)  # the old check: a regular file of ours, in the group
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0
    assert as_user(attacker, f"cat {victim}", base, check=False).returncode != 0
    swap(people, pool, name, victim)
    os.chown(p, -1, grp.getgrnam(share).gr_gid)  # the old fix, by path
    os.chmod(p, 0o660)
    assert snapshot(victim) != before
    assert as_user(attacker, f"cat {victim}", base).stdout == "the victim's private data\n"


def test_files_swapped_for_links_before_lmdb_opens_them_are_not_followed(
        people, base, monkeypatch):
    import lmdb

    pool = attacker_pool(people, base)
    victims = {n: secret(base, f"secret-{n}") for n in ("data.mdb", "lock.mdb")}
    before = {n: snapshot(p) for n, p in victims.items()}
    real_open, raced = lmdb.open, []

    def racing_lmdb_open(*a, **kw):  # the race: every check done, LMDB about to open
        if not raced:
            raced.append(True)
            for n, p in victims.items():
                swap(people, pool, n, p)
        return real_open(*a, **kw)

    monkeypatch.setattr(lmdb, "open", racing_lmdb_open)
    be = LmdbBackend(str(pool), 16 * MiB, shared_group=people[0])  # proceeds, on its files
    be.put_many([(b"g/k", b"value")])
    assert be.get_many([b"g/k"]) == [b"value"]
    be.close()
    assert raced and {n: snapshot(p) for n, p in victims.items()} == before


def test_negative_control_lmdb_opening_by_name_writes_the_victims_file(people, base):
    import lmdb

    pool = attacker_pool(people, base)
    victims = {n: secret(base, f"secret-{n}") for n in ("data.mdb", "lock.mdb")}
    before = {n: snapshot(p) for n, p in victims.items()}
    for n, p in victims.items():
        swap(people, pool, n, p)
    with pytest.raises(lmdb.Error):
        lmdb.open(str(pool), map_size=16 * MiB, max_dbs=4)  # the old open, by name
    assert snapshot(victims["lock.mdb"]) != before["lock.mdb"]  # LMDB sized it as a lock file


def test_the_sticky_bit_keeps_members_off_each_others_files(people, base):
    share, attacker = people
    LmdbBackend(str(base / "pool"), 16 * MiB, shared_group=share).close()
    pool = base / "pool"
    assert stat.S_IMODE(os.lstat(pool).st_mode) == 0o3770
    before = snapshot(pool / "data.mdb")
    assert as_user(attacker, "rm -f data.mdb", pool, check=False).returncode != 0
    assert as_user(attacker, "mv data.mdb x", pool, check=False).returncode != 0
    assert snapshot(pool / "data.mdb") == before
    # negative control: without the sticky bit a member removes it
    pool.chmod(0o2770)
    assert as_user(attacker, "rm -f data.mdb", pool, check=False).returncode == 0
    assert not (pool / "data.mdb").exists()


@pytest.mark.parametrize("how,refusal", [
    ("group-writable", "writable by its group"), ("attackers", "owned by"),
    ("others-writable-sticky-not-root", "writable by others")])
def test_directories_above_the_pool_that_others_can_write_are_refused(
        people, base, how, refusal):
    share, attacker = people
    parent = base / "parent"
    parent.mkdir()
    if how == "group-writable":
        os.chown(parent, -1, attacker.gid)
        parent.chmod(0o2775)
    elif how == "attackers":
        os.chown(parent, attacker.uid, attacker.gid)
        parent.chmod(0o755)
    else:
        os.chown(parent, attacker.uid, attacker.gid)
        parent.chmod(0o1777)
    with pytest.raises(UnsafePoolPath, match=refusal) as e:
        LmdbBackend(str(parent / "pool"), 16 * MiB, shared_group=share)
    assert str(parent) in str(e.value) and "Nothing was read" in str(e.value)
    assert not (parent / "pool").exists()  # nothing was created
    if how == "group-writable":  # what the refusal prevents: a member replaces the pool
        (parent / "pool").mkdir()
        assert as_user(attacker, "mv pool gone && ln -s /etc pool", parent).returncode == 0


def test_a_sticky_root_directory_like_dev_shm_is_a_fine_parent(people, base):
    parent = base / "shm-like"
    parent.mkdir()
    parent.chmod(0o1777)
    LmdbBackend(str(parent / "pool"), 16 * MiB, shared_group=people[0]).close()


def test_a_pool_file_with_another_hard_link_is_refused(people, base):
    # (a member cannot link the victim's files where protected_hardlinks is
    # on; root makes the link here, as a machine without it would allow)
    pool, victim = attacker_pool(people, base), secret(base)
    before = snapshot(victim)
    (pool / "generation").unlink()
    os.link(victim, pool / "generation")
    with pytest.raises(UnsafePoolPath, match="generation in it has 2 hard links"):
        LmdbBackend(str(pool), 16 * MiB, shared_group=people[0])
    assert snapshot(victim) == before


# -- a default path someone else created first ---------------------------------------

def test_a_foreign_default_path_falls_back_and_a_configured_one_is_refused(
        people, base, monkeypatch, caplog):
    """The connector's own opening (default path pointed into ``base``)."""
    from vllm_layerwise_patch.pool.directory import paths
    from vllm_layerwise_patch.pool.config import PoolConfig
    from vllm_layerwise_patch.pool.opening import open_backend

    attacker = people[1]
    default = base / "vllm-layerwise-pool-0"
    as_user(attacker, f"mkdir -m 700 {default.name}", base)
    monkeypatch.setattr(paths, "default_path", lambda: str(default))
    monkeypatch.setenv("XDG_CACHE_HOME", str(base / "cache"))
    be = open_backend(PoolConfig.from_extra({"capacity": "16MiB"}))
    try:
        assert be.path.startswith(f"{default}-") and len(be.path) == len(str(default)) + 17
        st = os.lstat(be.path)
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    finally:
        be.close()
    assert "the default pool path" in caplog.text and "private fallback" in caplog.text
    assert os.listdir(default) == [] and os.lstat(default).st_uid == attacker.uid
    # every engine of this user agrees on the fallback
    again = open_backend(PoolConfig.from_extra({"capacity": "16MiB"}))
    assert again.path == be.path
    again.close()
    with pytest.raises(UnsafePoolPath, match=f"refusing the pool at {default} .*owned by"):
        open_backend(PoolConfig.from_extra({"capacity": "16MiB", "path": str(default)}))


@pytest.mark.vllm
def test_engine_whose_default_path_another_user_holds(people, base, tiny_model_dir):
    """A real engine: started on a private fallback with a warning; the same
    path configured explicitly is refused.  (This test's default path stands
    in ``base``: root's real one is shared with the machine's other runs, and
    the interpreter here is not other users' to run.)"""
    from vllm_layerwise_patch.testing.engines import engine_env, run_engine

    attacker = people[1]
    default = base / "vllm-layerwise-pool-0"
    as_user(attacker, f"mkdir -m 700 {default.name}", base)
    env = engine_env(XDG_CACHE_HOME=str(base / "cache"))
    res = run_engine({"model": str(tiny_model_dir), "prompts": [],
                      "default_pool_path": str(default), "startup": {
                          "default": {"capacity": "64MiB"},
                          "explicit": {"path": str(default), "capacity": "64MiB"}}},
                     env=env, cwd=str(base))
    assert res["errors"]["default"] is None, res["errors"]["default"]
    err = res["errors"]["explicit"]
    assert err is not None and f"refusing the pool at {default} " in err, err
    assert "owned by" in err
    assert "private fallback" in res["log"], res["log"][-3000:]
    fallback = list(base.glob(f"{default.name}-*"))
    assert len(fallback) == 1 and f"at {fallback[0]}, namespace" in res["log"]
    st = os.lstat(fallback[0])
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    assert os.listdir(default) == [] and os.lstat(default).st_uid == attacker.uid
