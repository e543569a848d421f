"""--model as a HuggingFace Hub id (models/hub.py): a hand-built Hub cache read offline, and
downloads from a Hub on loopback (fake_hub.py) into a real huggingface_hub cache. No network.

huggingface_hub reads HF_HUB_OFFLINE, HF_HUB_CACHE and HF_ENDPOINT once, at import: the
in-process tests set its constants too, and the download tests run resolve() in a child process
with the variables set, as a user's shell would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch

from tests.models.fake_hub import FakeHub, FakeRepo, write_cache
from tokenway.models import hub
from tokenway.models.loader import resolve_model
from tokenway.models.weights import iter_weights

ENGINE_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"}
WORDS = ["<eos>", *"abcdefghijklmnopqrstuvwxyz"]
SPLIT = ("big-Q8_0-00001-of-00002.gguf", "big-Q8_0-00002-of-00002.gguf")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> dict[str, bytes]:
    """A random two-layer Llama with a word-level tokenizer: the files of a HF safetensors repo."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, bos_token_id=None, eos_token_id=0,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    files = {path.name: path.read_bytes() for path in directory.iterdir()}
    assert set(files) == ENGINE_FILES
    return files


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[bytes, dict]:
    from tests.models.test_loader import _write_tiny_gguf

    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    weights = _write_tiny_gguf(path)
    return path.read_bytes(), weights


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=<tmp>, in the environment and in huggingface_hub."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize(("model", "expected"), [
    ("Qwen/Qwen2.5-0.5B-Instruct", True),
    ("unsloth/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q4_K_M.gguf", True),
    ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", True),
    ("smollm2-135m-instruct", False),  # the alias
    ("gpt2", False),  # a bare name: tokenway takes org/name only
    ("/models/org/name", False),
    ("./org/name", False),
    ("~/org/name", False),
    ("a/b/c", False),
    ("org/na--me", False),  # the Hub's rules: no -- or ..
    ("org/name.git", False),
    ("org/", False),
    ("", False),
])
def test_is_hub_id(model, expected):
    assert hub.is_hub_id(model) is expected


def test_an_existing_local_path_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_id("org/name")


def test_cached_repo_resolves_offline_and_the_engine_generates(offline_cache, tiny_model):
    from tokenway import LLM, SamplingParams

    snapshot = write_cache(offline_cache, "org/tiny", FakeRepo(tiny_model, tags=("v1",)))
    assert hub.resolve("org/tiny") == snapshot
    assert hub.resolve("org/tiny", revision="v1") == snapshot
    assert hub.resolve("org/tiny", revision=snapshot.name) == snapshot  # a commit hash
    assert resolve_model("org/tiny") == snapshot.resolve()

    options = {"dtype": "float32", "quantization": "none", "linear_kernels": "default", "kv_cache_memory": "16MiB",
               "max_model_len": 64, "show_progress": False}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    from_hub = LLM("org/tiny", **options).generate("a b c", params)[0].outputs[0].token_ids
    from_dir = LLM(str(snapshot), **options).generate("a b c", params)[0].outputs[0].token_ids
    assert len(from_hub) == 8
    assert from_hub == from_dir


def test_cached_gguf_resolves_offline_and_converts(offline_cache, tiny_gguf, tmp_path):
    data, weights = tiny_gguf
    snapshot = write_cache(offline_cache, "org/tiny-GGUF", FakeRepo({"tiny-Q8_0.gguf": data, "tiny-F32.gguf": data}))
    assert hub.resolve("org/tiny-GGUF:tiny-Q8_0.gguf") == snapshot / "tiny-Q8_0.gguf"
    assert hub.resolve("org/tiny-GGUF", gguf_file="tiny-F32.gguf") == snapshot / "tiny-F32.gguf"
    assert hub.resolve("org/tiny-GGUF:Q8_0") == snapshot / "tiny-Q8_0.gguf"  # vLLM's repo_id:quant_type
    model_dir = resolve_model("org/tiny-GGUF:tiny-Q8_0.gguf", cache_dir=tmp_path / "converted")
    ours = dict(iter_weights(model_dir))
    assert set(ours) == set(weights)
    for name, w in weights.items():
        assert torch.equal(ours[name], torch.from_numpy(w)), name


def test_cached_gguf_repo_without_a_file_named_lists_its_ggufs(offline_cache, tiny_gguf):
    write_cache(offline_cache, "org/tiny-GGUF", FakeRepo({"tiny-Q8_0.gguf": b"GGUF", "tiny-F32.gguf": b"GGUF"}))
    with pytest.raises(ValueError, match=r"org/tiny-GGUF has GGUF files but no \*.safetensors weights; pick one "
                                         r"with --model org/tiny-GGUF:<file>.gguf or --gguf-file <file>.gguf: "
                                         r"tiny-F32.gguf, tiny-Q8_0.gguf$"):
        hub.resolve("org/tiny-GGUF")


def test_split_gguf_fetches_every_part_and_the_loader_refuses_it(offline_cache):
    snapshot = write_cache(offline_cache, "org/split", FakeRepo({SPLIT[0]: b"GGUF1", SPLIT[1]: b"GGUF2"}))
    assert hub.resolve(f"org/split:{SPLIT[1]}") == snapshot / SPLIT[0]
    assert hub.resolve("org/split:Q8_0") == snapshot / SPLIT[0]
    with pytest.raises(ValueError, match="a GGUF split into 2 parts, which tokenway cannot read yet; merge them"):
        resolve_model(f"org/split:{SPLIT[0]}")
    (snapshot / SPLIT[1]).unlink()
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        hub.resolve(f"org/split:{SPLIT[0]}")


@pytest.mark.parametrize("model", ["org/missing", "org/missing:model.gguf"])
def test_offline_and_not_cached(offline_cache, model):
    with pytest.raises(ValueError) as exc:
        hub.resolve(model)
    assert str(exc.value) == (f"org/missing: HF_HUB_OFFLINE is set and the files are not in the Hub cache at "
                              f"{offline_cache}; download them once without HF_HUB_OFFLINE")


def test_revision_and_gguf_file_need_a_hub_id(tmp_path):
    with pytest.raises(ValueError, match="revision and gguf_file apply to a HuggingFace Hub id"):
        resolve_model(str(tmp_path), revision="main")


# Downloads, in a child process that sees HF_* as a user's shell sets them.
_RESOLVE = """
import json, sys
from tokenway.models.hub import resolve
model, kwargs = json.loads(sys.argv[1])
try:
    print(json.dumps({"path": str(resolve(model, **kwargs))}))
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def _hub_env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HF_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    return {**env, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def resolve_in_child(env: dict[str, str], model: str, **kwargs) -> dict[str, str]:
    """{"path": ...} or {"error": the ValueError's sentence}; anything else fails the test."""
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps([model, kwargs])], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_download_lands_in_the_cache_then_works_offline(tmp_path, tiny_model):
    extra = {"README.md": b"# tiny", "pytorch_model.bin": b"pickle", "onnx/model.safetensors": b"onnx"}
    repo = FakeRepo({**tiny_model, **extra})
    with FakeHub({"org/tiny": repo}) as fake:
        env = _hub_env(tmp_path, fake.url)
        path = Path(resolve_in_child(env, "org/tiny")["path"])
        assert fake.downloaded() == ENGINE_FILES  # never the README, *.bin or a subfolder's weights
        num_requests = len(fake.requests)
        # Offline, and with the Hub out of reach, the cache alone answers.
        assert resolve_in_child({**env, "HF_HUB_OFFLINE": "1"}, "org/tiny") == {"path": str(path)}
        assert len(fake.requests) == num_requests
    assert resolve_in_child(env, "org/tiny") == {"path": str(path)}  # the Hub is down now

    storage = tmp_path / "hub" / "models--org--tiny"
    assert path == storage / "snapshots" / repo.commit
    assert (storage / "refs" / "main").read_text() == repo.commit
    assert {p.name for p in path.iterdir()} == ENGINE_FILES
    for name in ENGINE_FILES:
        assert (path / name).is_symlink() and (path / name).resolve().parent == storage / "blobs"
        assert (path / name).read_bytes() == tiny_model[name]


def test_download_gguf_files(tmp_path):
    files = {"tiny-Q4_K_M.gguf": b"GGUF-q4", "tiny-Q8_0.gguf": b"GGUF-q8", SPLIT[0]: b"GGUF-1", SPLIT[1]: b"GGUF-2",
             "mmproj-Q8_0.gguf": b"GGUF-proj", "README.md": b"#"}
    listing = ", ".join(sorted(n for n in files if n.endswith(".gguf")))
    with FakeHub({"org/tiny-GGUF": FakeRepo(files)}) as fake:
        env = _hub_env(tmp_path, fake.url)
        path = Path(resolve_in_child(env, "org/tiny-GGUF:tiny-Q4_K_M.gguf")["path"])
        assert path.name == "tiny-Q4_K_M.gguf" and path.read_bytes() == b"GGUF-q4"
        assert fake.downloaded() == {"tiny-Q4_K_M.gguf"}
        assert Path(resolve_in_child(env, "org/tiny-GGUF:Q4_K_M")["path"]) == path

        path = Path(resolve_in_child(env, "org/tiny-GGUF", gguf_file=SPLIT[1])["path"])
        assert path.name == SPLIT[0]
        assert (path.parent / SPLIT[1]).read_bytes() == b"GGUF-2"

        assert resolve_in_child(env, "org/tiny-GGUF") == {"error": (
            "org/tiny-GGUF has GGUF files but no *.safetensors weights; pick one with --model "
            f"org/tiny-GGUF:<file>.gguf or --gguf-file <file>.gguf: {listing}")}
        assert resolve_in_child(env, "org/tiny-GGUF:nope.gguf") == {"error": (
            f"org/tiny-GGUF has no file nope.gguf; its GGUF files: {listing}")}
        assert resolve_in_child(env, "org/tiny-GGUF:Q8_0") == {"error": (
            "org/tiny-GGUF has 2 GGUFs of quant type 'Q8_0'; name the file with --model "
            f"org/tiny-GGUF:<file>.gguf; its GGUF files: {listing}")}


def test_hub_errors_are_one_sentence(tmp_path, tiny_model):
    repos = {"org/tiny": FakeRepo(tiny_model), "org/gated": FakeRepo(tiny_model, gated=True)}
    with FakeHub(repos) as fake:
        env = _hub_env(tmp_path, fake.url)
        assert resolve_in_child(env, "org/nope") == {"error": (
            f"org/nope: no such local path, and no repository org/nope on {fake.url} (HTTP 401); a private or "
            "gated one needs HF_TOKEN set to a token with access")}
        assert resolve_in_child(env, "org/gated") == {"error": (
            f"org/gated is a gated repository: accept its terms at {fake.url}/org/gated and set HF_TOKEN to a "
            "token of an account that has access")}
        assert resolve_in_child(env, "org/tiny", revision="v9") == {"error": (
            f"org/tiny: no revision 'v9' on {fake.url}")}
        closed = fake.url
    error = resolve_in_child(_hub_env(tmp_path, closed), "org/tiny")["error"]
    assert error.startswith(f"org/tiny: cannot reach {closed} (")
    assert error.endswith(f") and the files are not in the Hub cache at {tmp_path / 'hub'}")


def test_cli_prints_the_error_without_a_traceback(tmp_path):
    with FakeHub({}) as fake:
        proc = subprocess.run([sys.executable, "-m", "tokenway.cli", "generate", "hi", "--model", "org/nope"],
                              env=_hub_env(tmp_path, fake.url), capture_output=True, text=True, timeout=120,
                              check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("tokenway: org/nope: no such local path, and no repository org/nope on ")
    assert "Traceback" not in proc.stderr
