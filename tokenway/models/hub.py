"""HuggingFace Hub ids for --model, as vLLM takes them: `org/name` -> a local path.

    org/name                   a safetensors repo -> its snapshot directory (engine files only)
    org/name:file.gguf         one GGUF of a repo -> that file's local path (also --gguf-file)
    org/name:Q4_K_M            vLLM's repo_id:quant_type -> the repo's one GGUF of that type

huggingface_hub does the fetching: its cache (HF_HUB_CACHE, default $HF_HOME/hub), its progress
bars, HF_TOKEN, HF_ENDPOINT, and HF_HUB_OFFLINE, under which only the cache is read. As
huggingface_hub does, a Hub that cannot be reached falls back to the cache. Every failure leaves
here as one ValueError sentence; nothing of huggingface_hub's own reaches the user.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2  # huggingface_hub 2.x's transport: its connection errors and HfHubHTTPError's base
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name
from huggingface_hub.utils import validate_repo_id

from tokenway import config

# What the engine reads of a safetensors repo (loader.py, frontend/tokenizer.py); the rest of a
# repo (README, *.bin, *.pt, onnx/, original/) is never fetched. Top-level files only.
ENGINE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.safetensors.index.json",
)
# llama.cpp's gguf-split naming: model-00001-of-00003.gguf.
SPLIT_GGUF = re.compile(r"(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)
_LOCAL_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def is_hub_id(model: str) -> bool:
    """`org/name`, optionally `:file.gguf` or `:QUANT`, valid by the Hub's own rules and not an
    existing local path; an absolute, ./ or ~ path never is one."""
    if not model or model.startswith(_LOCAL_PREFIXES) or Path(model).expanduser().exists():
        return False
    repo_id, _ = _split(model)
    if repo_id.count("/") != 1:
        return False
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def resolve(model: str, *, revision: str | None = None, gguf_file: str | None = None,
            cache_dir: str | Path | None = None) -> Path:
    """The local path of Hub id `model` at `revision` (default: the main branch), fetched into
    the Hub cache `cache_dir` (default HF_HUB_CACHE) unless already there.

    A GGUF is named in `model` (`org/name:file.gguf`, or vLLM's `org/name:Q4_K_M`) or by
    `gguf_file`; the result is then that file's path. A GGUF split by llama.cpp
    (`-00001-of-00003.gguf`) has all its parts fetched and the first part's path returned:
    the parts sit side by side in the snapshot, and loader.resolve_model refuses them with a
    ValueError naming the limit, since its converter reads single-file GGUFs only for now.
    Without a GGUF named, the repo's safetensors weights, config and tokenizer are fetched and
    the snapshot directory is returned; a repo of GGUFs only is an error listing them.
    """
    if not is_hub_id(model):
        raise ValueError(f"{model!r} is not a HuggingFace Hub id (org/name)")
    repo_id, selector = _split(model)
    if selector == "":
        raise ValueError(f"{model}: nothing after ':'; expected {repo_id}:<file>.gguf or {repo_id}:<quant type>")
    if selector is not None and gguf_file is not None and selector != gguf_file:
        raise ValueError(f"{model}: names GGUF {selector!r} but gguf_file is {gguf_file!r}; give one of them")
    selector = selector if selector is not None else gguf_file
    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()
    with _hub_errors(repo_id, revision, cache):
        if selector is not None and selector.lower().endswith(".gguf"):
            return _fetch_gguf(repo_id, selector, revision, cache)
        repo_files = _repo_files(repo_id, revision, cache)
        ggufs = sorted(name for name in repo_files if name.lower().endswith(".gguf"))
        if selector is not None:
            return _fetch_gguf(repo_id, _gguf_of_type(repo_id, selector, ggufs), revision, cache)
        weights = _engine_files(repo_files)
        if not any(name.endswith(".safetensors") for name in weights):
            if ggufs:
                raise ValueError(f"{repo_id} has GGUF files but no *.safetensors weights; pick one with "
                                 f"--model {repo_id}:<file>.gguf or --gguf-file <file>.gguf: {', '.join(ggufs)}")
            raise ValueError(f"{repo_id}{_at(revision)} has neither *.safetensors weights nor .gguf files; "
                             "tokenway reads those two")
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      allow_patterns=[glob.escape(name) for name in weights]))


def split_gguf_parts(path: Path) -> int:
    """How many parts `path`'s GGUF is split into; 1 for a single file."""
    match = SPLIT_GGUF.fullmatch(Path(path).name)
    return int(match["count"]) if match else 1


def _split(model: str) -> tuple[str, str | None]:
    repo_id, sep, selector = model.partition(":")
    return repo_id, selector if sep else None


def _at(revision: str | None) -> str:
    return f" (revision {revision})" if revision is not None else ""


def _engine_files(repo_files: list[str]) -> list[str]:
    names = [n for n in repo_files if "/" not in n and any(fnmatch.fnmatchcase(n, p) for p in ENGINE_FILES)]
    # Mistral's repos hold the same weights twice: consolidated.safetensors beside HF's shards.
    if any(n.endswith(".safetensors") and not n.startswith("consolidated") for n in names):
        names = [n for n in names if not n.startswith("consolidated")]
    return names


def _gguf_of_type(repo_id: str, quant_type: str, ggufs: list[str]) -> str:
    """vLLM's `repo_id:quant_type`: the one GGUF (or one split set) whose name carries the type."""
    token = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant_type)}(?![A-Za-z0-9_])", re.IGNORECASE)
    # A vision model's projector (mmproj-*.gguf) can carry the type too, but is no language model.
    matches = [n for n in ggufs if token.search(n) and "mmproj" not in n.lower()]
    models = {_split_stem(n) for n in matches}  # the parts of one split GGUF are one model
    if len(models) != 1:
        found = f"no GGUF of quant type {quant_type!r}" if not matches else \
            f"{len(models)} GGUFs of quant type {quant_type!r}"
        raise ValueError(f"{repo_id} has {found}; name the file with --model {repo_id}:<file>.gguf; "
                         f"its GGUF files: {', '.join(ggufs) or 'none'}")
    return min(matches)  # a split GGUF's first part


def _split_stem(name: str) -> str:
    match = SPLIT_GGUF.fullmatch(name)
    return match["stem"] if match else name


def _fetch_gguf(repo_id: str, filename: str, revision: str | None, cache: Path) -> Path:
    match = SPLIT_GGUF.fullmatch(filename)
    parts = [filename] if match is None else [
        f"{match['stem']}-{i:05d}-of-{match['count']}.gguf" for i in range(1, int(match["count"]) + 1)
    ]
    paths = []
    for part in parts:
        try:
            paths.append(Path(hf_hub_download(repo_id, part, revision=revision, cache_dir=cache)))
        except EntryNotFoundError as exc:
            if isinstance(exc, LocalEntryNotFoundError):
                raise
            ggufs = [n for n in _repo_files(repo_id, revision, cache) if n.lower().endswith(".gguf")]
            raise ValueError(f"{repo_id}{_at(revision)} has no file {part}; its GGUF files: "
                             f"{', '.join(sorted(ggufs)) or 'none'}") from exc
    return paths[0]


def _repo_files(repo_id: str, revision: str | None, cache: Path) -> list[str]:
    """The repo's file names from the Hub; offline, or with the Hub out of reach, the ones in the
    cached snapshot (all that can be used then)."""
    error: Exception | None = None
    if not constants.is_offline_mode():
        try:
            # model_info: one request, where list_repo_files retries a refused connection for 23 s.
            return [sibling.rfilename for sibling in HfApi().model_info(repo_id, revision=revision).siblings or ()]
        except HfHubHTTPError as exc:
            if exc.response.status_code < 500:
                raise
            error = exc
        except (httpx2.TransportError, OfflineModeIsEnabled) as exc:
            error = exc
    snapshot = _cached_snapshot(repo_id, revision, cache)
    if snapshot is None:
        raise LocalEntryNotFoundError(f"{repo_id} is not in the cache") from error
    return [path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*") if not path.is_dir()]


def _cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    revision = revision or constants.DEFAULT_REVISION
    commit = revision
    if not REGEX_COMMIT_HASH.fullmatch(revision):
        ref = storage / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, cache: Path) -> Iterator[None]:
    """huggingface_hub's exceptions -> one ValueError sentence each."""
    endpoint = constants.ENDPOINT
    try:
        yield
    except GatedRepoError as exc:
        raise ValueError(f"{repo_id} is a gated repository: accept its terms at {endpoint}/{repo_id} and set "
                         "HF_TOKEN to a token of an account that has access") from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(f"{repo_id}: no such local path, and no repository {repo_id} on {endpoint} (HTTP "
                         f"{exc.response.status_code}); a private or gated one needs HF_TOKEN set to a token "
                         "with access") from exc
    except RevisionNotFoundError as exc:
        raise ValueError(f"{repo_id}: no revision {revision!r} on {endpoint}") from exc
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx2.TransportError) as exc:
        if constants.is_offline_mode():
            raise ValueError(f"{repo_id}{_at(revision)}: HF_HUB_OFFLINE is set and the files are not in the Hub "
                             f"cache at {cache}; download them once without HF_HUB_OFFLINE") from exc
        raise ValueError(f"{repo_id}{_at(revision)}: cannot reach {endpoint} ({_reason(exc)}) and the files are "
                         f"not in the Hub cache at {cache}") from exc
    except HfHubHTTPError as exc:
        raise ValueError(f"{repo_id}: {endpoint} answered HTTP {exc.response.status_code}: "
                         f"{exc.server_message or exc.response.reason_phrase}") from exc
    except OSError as exc:  # the cache: disk full, no permission, ...
        raise ValueError(f"{repo_id}: cannot fetch into the Hub cache at {cache}: {exc}") from exc


def _reason(exc: BaseException) -> str:
    """Why the Hub was out of reach: the error under huggingface_hub's "not in the cache"."""
    while isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ is not None:
        exc = exc.__cause__
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def add_hub_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that go with a HuggingFace Hub id in --model (models/hub.py), as vLLM's."""
    parser.add_argument("--revision", help="the Hub id's branch, tag or commit (default: main)")
    parser.add_argument("--gguf-file", help="the Hub id's GGUF file to serve (same as --model org/name:file.gguf)")


def default_model_name(model: str) -> str:
    """What clients call --model when --served-model-name is not given: a Hub id itself (as vLLM),
    a file's stem, the alias."""
    return model if model == config.DEFAULT_MODEL or is_hub_id(model) else Path(model).stem
