"""Tokenizer files: finding them under a path, and keeping them with a run.

A file tokenizer is the bytes of its files (`{name: bytes}`, held in memory: what was read is
what is saved, even if the source changes meanwhile). A run keeps them in RUN_DIR/tokenizer/
under the names below, and its checkpoints record each file's SHA-256, so a run directory is
self-contained (copy or move it whole) and a saved tokenizer is checked before it is used.
"""

from __future__ import annotations

import hashlib
import shutil
import uuid
from pathlib import Path

from moe_jax.tokenizer.simple import DataError

HF_FILE = "tokenizer.json"  # Hugging Face `tokenizers`: the whole pipeline in one file
SP_FILE = "tokenizer.model"  # SentencePiece model proto
# Read with either, where present next to it: special tokens and the chat template.
CONFIG_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
SPEC_HELP = (
    "a tokenizer is byte, char, or the path of a directory holding tokenizer.json (Hugging "
    "Face) or tokenizer.model (SentencePiece), or of such a file (*.json, *.model)"
)


def find_files(spec: str) -> tuple[str, dict[str, bytes], str]:
    """(kind "hf" | "sentencepiece", files, source for messages) of a tokenizer path: a
    directory (tokenizer.json preferred over tokenizer.model; every other tokenizer file there
    comes along, e.g. for export) or one file (*.json: HF, *.model: SentencePiece)."""
    path = Path(spec)
    if path.is_dir():
        names = [HF_FILE, SP_FILE, *CONFIG_FILES]
        files = {n: _read(path / n) for n in names if (path / n).is_file()}
        if HF_FILE in files:
            return "hf", files, str(path / HF_FILE)
        if SP_FILE in files:
            return "sentencepiece", files, str(path / SP_FILE)
        raise DataError(f"directory '{path}' holds neither {HF_FILE} nor {SP_FILE}; {SPEC_HELP}")
    if path.is_file() and path.suffix in (".json", ".model"):
        kind, name = ("hf", HF_FILE) if path.suffix == ".json" else ("sentencepiece", SP_FILE)
        return kind, {name: _read(path)}, str(path)
    what = "is not a .json or .model file" if path.exists() else "does not exist"
    raise DataError(f"tokenizer path '{spec}' {what}; {SPEC_HELP}")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read tokenizer file '{path}' ({e.strerror})") from None


class SavedFilesError(DataError):
    """A run's saved tokenizer file is missing or changed; the message says which."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hashes(files: dict[str, bytes]) -> dict[str, str]:
    return {name: sha256(data) for name, data in sorted(files.items())}


def read_saved(directory: Path, saved: dict[str, str]) -> dict[str, bytes]:
    """The files a checkpoint recorded (`{name: sha256}`), read from `directory` and checked."""
    files = {}
    for name, want in saved.items():
        path = directory / name
        if not path.is_file():
            raise SavedFilesError(
                f"its tokenizer file '{path}' is missing; a run directory must be copied or "
                f"moved whole, {directory.name}/ included: copy it again from the original"
            )
        files[name] = _read(path)
        if (got := sha256(files[name])) != want:
            raise SavedFilesError(
                f"its tokenizer file '{path}' changed after the checkpoint was saved (sha256 "
                f"{got[:16]}..., saved {want[:16]}...); put the original file back"
            )
    return files


def holds(directory: Path, files: dict[str, bytes]) -> bool:
    """Whether `directory` holds these files (by SHA-256; other files there do no harm)."""
    return all(
        (directory / name).is_file() and sha256((directory / name).read_bytes()) == sha256(data)
        for name, data in files.items()
    )


def write_files(files: dict[str, bytes], directory: Path) -> None:
    """Create `directory` holding `files`, atomically: written into a temporary sibling and
    renamed, so the directory is complete or absent. It must not exist."""
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
