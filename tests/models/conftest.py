"""Fixtures the model tests share: the tokenizer tiny models borrow, and llama.cpp's own
converter, which turns their safetensors into the GGUF a user would bring."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

LLAMA_CPP_PYTHON = "0.3.36"
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tokenizer_dir(default_model_dir) -> Path:
    return default_model_dir


@pytest.fixture(scope="session")
def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py (with its conversion/ package and gguf-py beside it)."""
    peers = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "tokenway-peers"))
    unpacked = peers / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (unpacked / "convert_hf_to_gguf.py").is_file():
        return unpacked / "convert_hf_to_gguf.py"
    root = HERE / ".llama_cpp"
    script = root / "llama.cpp" / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    root.mkdir(exist_ok=True)
    download = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)],
                              capture_output=True, text=True, timeout=600)
    if download.returncode:
        pytest.skip(f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist (llama.cpp's converter) not downloadable: "
                    f"{download.stderr.strip().splitlines()[-1:]}")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as sdist:
        members = [m for m in sdist.getmembers() if m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(wanted)]
        for member in members:
            member.name = "llama.cpp/" + member.name[len(prefix):]
        sdist.extractall(root, members=members, filter="data")
    return script
