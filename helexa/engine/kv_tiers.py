"""The engine's side of the KV tiers: build them from the config at load (`open_tiers`), keyed by the model's content.

`--kv-host-memory SIZE` keeps evicted blocks in host memory (pinned, on CUDA); `--kv-disk-path DIR`
(with `--kv-disk-bytes SIZE`, default 16 GiB) keeps them in files under DIR, across restarts of the same
model, dtype and block shape. On a CPU the pool already is host memory, so a host tier only copies
blocks into RAM the pool could have used: it works (tests use it), and the load log says so.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from helexa.config import EngineConfig
from helexa.kvcache import BlockPool
from helexa.kvcache.tiers import KVIdentity, KVTiers

__all__ = ["DEFAULT_DISK_BYTES", "model_content_key", "open_tiers"]

logger = logging.getLogger("helexa.engine")

DEFAULT_DISK_BYTES = 16 << 30
_SAMPLE = 1 << 20  # bytes read from each end of a weight file for its fingerprint
_KV_FORMAT = "helexa-kv-tiers/1"


def model_content_key(model_dir: Path, config: EngineConfig) -> str:
    """A hex digest of what a block's K/V depends on besides its tokens: the model's config.json, each weight
    file's name, size and first and last MiB, and the load options that change the weights or the cache
    (`quantization`, `kv_cache_dtype`). Reads at most 2 MiB a weight file."""
    digest = hashlib.sha256(_KV_FORMAT.encode())
    digest.update(f"quantization={config.quantization} kv_cache_dtype={config.kv_cache_dtype}".encode())
    for path in sorted(Path(model_dir).iterdir()):
        if path.name == "config.json":
            digest.update(b"config.json\0" + path.read_bytes())
        elif path.suffix in (".safetensors", ".gguf", ".bin"):
            size = path.stat().st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            with open(path, "rb") as f:
                digest.update(f.read(_SAMPLE))
                f.seek(max(0, size - _SAMPLE))
                digest.update(f.read(_SAMPLE))
    return digest.hexdigest()[:32]


def open_tiers(config: EngineConfig, pool: BlockPool, model_dir: Path) -> KVTiers | None:
    """The tiers the config asks for, over blocks of `pool`'s dtype and shape (None: none asked for)."""
    if config.kv_host_memory is None and config.kv_disk_path is None:
        return None
    identity = KVIdentity.of_pool(pool, model_content_key(model_dir, config))
    if config.kv_host_memory is not None and pool.kv_device.type == "cpu":
        logger.warning(
            "engine: --kv-host-memory on a CPU: the pool already is host memory, so this tier copies evicted blocks "
            "into %.0f MiB of RAM a bigger pool could use; --kv-disk-path is the tier that adds capacity here",
            config.kv_host_memory / 2**20,
        )  # fmt: skip
    disk_bytes = config.kv_disk_bytes if config.kv_disk_bytes is not None else DEFAULT_DISK_BYTES
    tiers = KVTiers(
        identity,
        host_bytes=config.kv_host_memory,
        disk_path=config.kv_disk_path,
        disk_bytes=disk_bytes if config.kv_disk_path is not None else None,
        pin=pool.kv_device.type == "cuda",
    )
    logger.info("engine: %s", tiers.describe())
    return tiers
