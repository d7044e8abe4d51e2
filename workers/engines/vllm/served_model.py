"""The checkpoint a vllm worker serves: the folder ``--model`` names (or the packaged SmolLM2, converted once), the
name it is served under, and the hash that tells two checkpoints apart."""

from __future__ import annotations

import hashlib
import pathlib
from dataclasses import dataclass

from workers.engines.vllm.tokenizer import CheckpointError


@dataclass(frozen=True, slots=True)
class ServedModel:
    folder: pathlib.Path
    name: str


def resolve_model(model_path: str | None, served_model_name: str | None) -> ServedModel:
    """``--model`` is a Hugging Face checkpoint folder; none means the packaged SmolLM2, converted once."""
    if model_path is None:
        from workers.engines.reference.model_file import MODEL_FILENAME
        from workers.engines.vllm.checkpoint import ensure_hf_checkpoint

        return ServedModel(ensure_hf_checkpoint(), served_model_name or pathlib.Path(MODEL_FILENAME).stem)
    folder = pathlib.Path(model_path)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"--model {model_path}: not a Hugging Face checkpoint folder (no config.json)")
    return ServedModel(folder, served_model_name or folder.name)


def checkpoint_hash(folder: pathlib.Path) -> str:
    """Tells two checkpoints apart cheaply: config.json, and each weight file's name, size and header."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
        with weights.open("rb") as f:
            digest.update(f.read(65536))
    return digest.hexdigest()
