"""``kv_connector_extra_config`` of the LayerwisePoolConnector: a pydantic
model (pydantic comes with vLLM) with unknown fields forbidden, validated at
startup; every error names ``kv_connector_extra_config.<field>``.

Sizes are an integer number of bytes or a string with a unit spelled exactly:
decimal ``kB``/``MB``/``GB``/``TB`` (powers of 1000) or binary
``KiB``/``MiB``/``GiB``/``TiB`` (powers of 1024).  ``"4GiB"`` is 4 294 967 296
bytes, ``"4GB"`` is 4 000 000 000.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .config_tiered import TieredConfig

PREFIX = "kv_connector_extra_config"

_UNITS = {"B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


class PoolConfigError(ValueError):
    pass


def parse_size(value: Any) -> int:
    """Bytes from an int or a string with an exactly spelled unit."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if m is None or m.group(2) not in _UNITS:
            raise ValueError(
                f"cannot read size {value!r}: a number of bytes or a number with one "
                f"of the units {', '.join(_UNITS)} (e.g. '4GiB', '512MiB', '8GB')")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        raise ValueError(f"expected a size, got {value!r}")
    if n <= 0:
        raise ValueError(f"must be > 0, got {value!r}")
    return n


def _address(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected 'host:port', got {v!r}")
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected 'host:port', got {v!r}")
    return v


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"expected a number, got {v!r}")
    return float(v)


def _metadata_server(v: Any) -> str:
    if not isinstance(v, str) or (
            v != "P2PHANDSHAKE" and not v.startswith(("http://", "https://", "etcd://"))):
        raise ValueError(f"expected 'P2PHANDSHAKE' or an http:// metadata server URL, "
                         f"got {v!r}")
    return v


Size = Annotated[int, BeforeValidator(parse_size)]
def _size_or_zero(v: Any) -> int:
    return 0 if v in (0, "0") else parse_size(v)


SizeOrZero = Annotated[int, BeforeValidator(_size_or_zero)]


def _staging_size(v: Any) -> int:
    """``pinned_staging_bytes``: 0, or a size from 1 MiB to 64 GiB."""
    n = v if isinstance(v, int) and not isinstance(v, bool) and v < 0 else _size_or_zero(v)
    if n and not (1 << 20) <= n <= (64 << 30):
        raise ValueError(f"must be 0 (no staging) or 1MiB to 64GiB, got {v!r}")
    return n
Number = Annotated[float, BeforeValidator(_number)]
Address = Annotated[str, BeforeValidator(_address)]


class MooncakeConfig(BaseModel):
    """``kv_connector_extra_config.mooncake``: the Mooncake Store client."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    master_address: Address = Field(
        default="127.0.0.1:50051", description="the `mooncake_master` RPC address (host:port)")
    metadata_server: Annotated[str, BeforeValidator(_metadata_server)] = Field(
        default="P2PHANDSHAKE",
        description="`P2PHANDSHAKE` (no metadata server) or an HTTP metadata server "
                    "`http://host:port/metadata`; every member of the pool uses the same")
    protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", description="transfer protocol: `tcp`, or `rdma` where the NICs have it")
    rdma_devices: str = Field(default="", description="RDMA devices (e.g. `mlx5_0`), rdma only")
    local_hostname: str = Field(
        default="127.0.0.1",
        description="the address this client advertises to peers (loopback: one machine)")
    global_segment_size: SizeOrZero = Field(
        default=4 << 30,
        description="pool memory each worker process contributes (`0`: none, e.g. when a "
                    "`mooncake_client` holds the memory); it leaves with the process")
    local_buffer_size: Size = Field(
        default=256 << 20,
        description="registered staging buffer per process for loads and saves (a quarter "
                    "must hold one layer's pages of a step, and with `block_objects` one "
                    "block's pages of one kind: every layer's; a same-node client reads a "
                    "step's block objects through it, up to three quarters at a time)")
    replica_num: int = Field(default=1, ge=1, le=16, description="replicas per entry")
    client_address: Address | None = Field(
        default=None,
        description="a same-node `mooncake_client` (host:port) holding the memory: loads "
                    "and saves go through shared memory (`setup_dummy`)")
    zero_copy_loads: bool = Field(
        default=False,
        description="register the host KV cache with Mooncake and load pages straight into "
                    "it (not with `client_address`; opt-in: a few percent faster on a 2-core "
                    "CPU machine, the KV cache is then reachable by the transfer engine's peers like the "
                    "staging buffer, and whether Mooncake can still write into a page after "
                    "reporting its transfer failed is not verified)")
    zero_copy_saves: bool = Field(
        default=True,
        description="register the save path's pack memory with Mooncake and put block "
                    "objects straight from it, without a copy into the staging buffer "
                    "(not with `client_address`; the pack memory holds what the staging "
                    "buffer would: the values being saved)")
    prefer_local_segment: bool = Field(
        default=True,
        description="saves ask Mooncake to place pages in the segment this process holds "
                    "(`global_segment_size` > 0; other segments when it is full), so this "
                    "process's own hits are a local copy instead of a transfer; `false`: "
                    "Mooncake places them anywhere in the pool")
    block_objects: bool = Field(
        default=True,
        description="one Mooncake object per block, kind and rank, each layer's page a "
                    "byte range of it (key format 5: one master operation per block "
                    "instead of one per layer, its existence the commit); `false`: an "
                    "object per page plus commit markers (the format-4 layout; "
                    "measurements only)")
    hit_cache_seconds: Number = Field(
        default=2.0, ge=0, le=3600,
        description="with `block_objects`: the scheduler's hit cache keeps an answer at most "
                    "this long (and `hit_cache_ttl`); Mooncake says nothing of other "
                    "engines' saves and of its evictions, so within it a block another "
                    "engine just saved can be missed and an evicted one taken for a hit "
                    "(its load fails and the request recomputes); this engine's own saves "
                    "and removals and a master that went away drop every answer; `0`: no "
                    "cache")
    reconnect_seconds: Number = Field(
        default=10.0, gt=0, le=3600,
        description="while the master is unreachable, how often to try again")
    connect_timeout_seconds: Number = Field(
        default=5.0, gt=0, le=3600,
        description="how long a connect attempt waits for the master to answer a request "
                    "before Mooncake's client setup (which, against a master that accepts "
                    "connections and never answers, stops the whole process for about ten "
                    "minutes); a master that does not answer in time is unreachable: "
                    "`on_backend_unavailable`, then a new attempt every `reconnect_seconds`")


class PoolConfig(BaseModel):
    """The pool connector's settings (docs/configuration.md: "kv_connector_extra_config")."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    backend: Literal["lmdb", "mooncake", "tiered"] = Field(
        default="lmdb", description="storage backend: `lmdb` (embedded, one machine), "
                                    "`mooncake` (Mooncake Store, many machines) or `tiered` "
                                    "(an lmdb pool as the near tier in front of Mooncake)")
    mooncake: MooncakeConfig = Field(
        default_factory=MooncakeConfig,
        description="the Mooncake client (backend `mooncake`): see the table below")
    tiered: TieredConfig = Field(
        default_factory=TieredConfig,
        description="backend `tiered`: the near tier's policy (its own table); the near "
                    "tier is the lmdb pool of `path`, `capacity`, `shared_group` and "
                    "`preallocate`, the far tier the Mooncake client of `mooncake`")
    on_backend_unavailable: Literal["recompute", "fail"] = Field(
        default="recompute",
        description="a distributed backend that cannot be reached at startup: `recompute` "
                    "serves without pool hits until it answers (logged once), `fail` stops "
                    "the engine with the address; likewise an lmdb pool file that cannot "
                    "be opened (damaged, not a pool): `recompute` serves without the pool "
                    "and leaves the file as it is (one error naming it), `fail` stops")
    path: str | None = Field(
        default=None, min_length=1,
        description="lmdb: pool directory; the default is per user "
                    "(`/dev/shm/vllm-layerwise-pool-<uid>`, tmpfs: RAM; when another user "
                    "holds that path: a private fallback, with a warning). A path set here "
                    "that is unsafe is refused")
    capacity: Size = Field(
        default=4 << 30,
        description="lmdb: maximum pool size: bytes or a size with an exact unit (`512MiB`, "
                    "`8GiB`, `1TiB`; `GB` = 10^9); least recently used blocks are "
                    "evicted; the filesystem under `path` must hold it")
    shared_group: str | None = Field(
        default=None, min_length=1,
        description="lmdb: a group whose members share the pool (directory 2770, files 0660 "
                    "of that group); unset: private to this user (0700/0600)")
    preallocate: bool = Field(
        default=True,
        description="lmdb: give the pool file its whole capacity at startup (the memory "
                    "of a tmpfs pool is taken then; a filesystem filling up later cannot "
                    "take it) and write values straight into the mapped file (LMDB "
                    "writemap: the write costs ~1.1x a memcpy instead of ~4.9x on tmpfs); false: the file grows "
                    "as it fills, LMDB's default write path")
    shards: int = Field(
        default=8, ge=1, le=64,
        description="lmdb: LMDB environments (shards) a new pool is created with, each "
                    "with its own writer, eviction and `capacity / shards` bytes (a shard "
                    "holds at least 8 MiB: fewer for a small capacity); a block's entries "
                    "of every kind and TP rank live in one shard (chosen by its block "
                    "hash), so engines saving different blocks do not wait on one writer. "
                    "The count is recorded in the pool when it is created and every engine "
                    "follows the pool's (logged when it differs); a pool written before "
                    "sharding opens as one environment. `1`: one environment")
    prefetch_layers: int = Field(default=2, ge=1, le=64,
                                 description="layers loaded ahead of compute")
    load_threads: int = Field(default=2, ge=1, le=32, description="load threads per worker")
    pinned_staging_bytes: Annotated[int, BeforeValidator(_staging_size)] = Field(
        default=256 << 20,
        description="KV cache on a CUDA device: pinned host memory per worker that "
                    "the load threads stage values in before their asynchronous copies "
                    "to the device on their own streams (each thread's ring grows to "
                    "twice the largest layer it loads, kept across steps, its share at "
                    "most); `0`: no staging, synchronous pageable copies (the path "
                    "before; for comparison); else 1 MiB to 64 GiB. Host KV caches "
                    "never use it")
    pin_seconds: Number = Field(
        default=30.0, gt=0,
        description="longest a pending load pins what it reads against eviction (pins "
                    "are released when the load is done; this bounds them if an engine "
                    "dies)")
    verify_on_lookup: bool = Field(
        default=True,
        description="read and check (length, checksum, namespace, the key it was "
                    "written under) every entry of a hit before reporting it")
    hit_cache_ttl: Number = Field(
        default=30.0, ge=0,
        description="the scheduler's hit cache: longest an answer is kept (it is dropped "
                    "at once when any process stores or removes entries; `0`: off)")
    hit_cache_size: int = Field(default=200_000, ge=0,
                                description="the scheduler's hit cache: entries kept at most")
    draft_hit_rule: Literal["next-token", "trim"] = Field(
        default="next-token",
        description="with speculative decoding: `next-token` keys the drafter's pages of a "
                    "block by the token that followed it, so a request continuing the same "
                    "way hits whole blocks; `trim` drops the last block of every hit")
    admission: Literal["all", "reused"] = Field(
        default="all",
        description="which computed blocks are saved: `all` (every block not in the pool "
                    "yet), or `reused`: only a block whose prefix at least two requests "
                    "have held (counted by this scheduler over the last `admission_window` "
                    "block hashes): a prefix seen once is not saved (a later miss, never a "
                    "wrong token). Counted in `vllm:layerwise_pool_blocks_not_admitted_total`")
    admission_window: int = Field(
        default=64_000, ge=1, le=10_000_000,
        description="with `admission: reused`: how many recently seen block hashes the "
                    "scheduler remembers (about 150 bytes each); a block not seen within "
                    "it counts from zero again")
    save_budget_blocks: int = Field(
        default=0, ge=0,
        description="most blocks one scheduler step hands to the workers to save (a "
                    "block's pages and its boundary state count once); the rest of the "
                    "step's blocks are not saved (a later miss; counted in "
                    "`vllm:layerwise_pool_blocks_over_save_budget_total`). On a hybrid layout a "
                    "request's save of a step is kept whole or skipped (a cut one could "
                    "never be hit). `0`: no limit")
    defer_last_save: bool = Field(
        default=False,
        description="a step's final write (the last layer's pages and the commit markers) "
                    "completes in the background, before the next step loads or saves, "
                    "instead of at the end of the step")
    load_async: bool = Field(
        default=False,
        description="load a hit in the background, outside any forward: vLLM parks the "
                    "request (`WAITING_FOR_REMOTE_KVS`) until every layer of its hit is in "
                    "place, then computes it as a prefix-cache hit (no layer overlap; other "
                    "requests' steps go on meanwhile); `false`: the hit loads layer by layer "
                    "in the step that computes the request")
    share_loads_seconds: Number = Field(
        default=10.0, ge=0, le=3600,
        description="with `load_async`: a request whose hit would read blocks another "
                    "request is loading waits for that load (vLLM then serves them from "
                    "its prefix cache and the pool loads only what lies beyond), at most "
                    "this long before it loads its own hit; a burst of requests on one "
                    "prefix reads it once; `0`: every request loads its whole hit")
    weights_identity: Literal["content", "sampled"] = Field(
        default="content",
        description="how the namespace names the weights: `content` digests every weights "
                    "file in full (once per file version: about 0.2 s/GB on a 2-core CPU "
                    "machine, logged; a Hugging Face cache file is named by its blob and never read); `sampled` reads "
                    "names, sizes, headers and 8 x 4 KiB per file, and misses a change "
                    "outside those samples (a re-saved fine-tune of a few layers, new "
                    "quantization scales): its old entries then serve wrong tokens")
    namespace_salt: str = Field(
        default="", description="extra namespace text (engines with different salts never "
                                "share entries)")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> PoolConfig:
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise PoolConfigError(_describe(exc)) from None

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls.model_fields)

    @classmethod
    def markdown_table(cls) -> str:
        """docs/configuration.md's tables of fields (scripts/render_readme.py)."""
        from vllm_layerwise_patch.pool.config_doc import reference

        return reference(cls, MooncakeConfig)


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "extra_forbidden":
            model = {"mooncake": MooncakeConfig, "tiered": TieredConfig}.get(
                err["loc"][0] if len(err["loc"]) > 1 else "", PoolConfig)
            msg = f"unknown field (known: {', '.join(model.model_fields)})"
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if "input" in err and err["type"] != "missing" and repr(err["input"]) not in msg:
                msg += f" (got {err['input']!r})"
        lines.append(f"{PREFIX}.{field}: {msg}")
    return "; ".join(lines)
