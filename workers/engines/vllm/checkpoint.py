"""The zero-config model for ``--engine vllm``: the packaged SmolLM2 GGUF as a Hugging Face llama checkpoint.

vLLM on the CPU cannot load the GGUF, so it is converted once, with the reference engine's reader (no vLLM import),
into a folder named by the GGUF's content and the converter's version (``content_key``). The folder is built under
a temporary name and renamed into place, so workers that start together never see half a checkpoint."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import tempfile
from collections.abc import Iterator

import numpy as np

from workers.engines.reference.model_file import F32Array, LoadedModelFile, load_model_file
from workers.engines.reference.tokenizer import GGUFTokenizer

# Bump when the files written change: every cache folder of an older converter is then rebuilt.
CONVERTER_VERSION = 1
CACHE_ENV = "DISAGG_MODEL_CACHE"


def cache_root() -> pathlib.Path:
    """``$DISAGG_MODEL_CACHE``, else ``$XDG_CACHE_HOME/disagg-serve/hf``, else ``~/.cache/disagg-serve/hf``."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "disagg-serve" / "hf"


def content_key(model_hash: str) -> str:
    return f"{model_hash[:24]}-v{CONVERTER_VERSION}"


def ensure_hf_checkpoint(gguf_path: pathlib.Path | str | None = None, root: pathlib.Path | None = None) -> pathlib.Path:
    """The checkpoint folder for ``gguf_path`` (None: the packaged SmolLM2), converting it on first use."""
    loaded = load_model_file(gguf_path)
    root = cache_root() if root is None else root
    target = root / content_key(loaded.model_hash)
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".converting-", dir=root))
    staging.chmod(0o755)  # mkdtemp makes it private; the checkpoint is for every user of the cache
    try:
        write_hf_checkpoint(loaded, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_hf_checkpoint(loaded: LoadedModelFile, folder: pathlib.Path) -> None:
    tokenizer = GGUFTokenizer(loaded.tokenizer)
    meta = loaded.tokenizer
    bos = meta.tokens[meta.bos_token_id] if meta.bos_token_id is not None else None
    eos = meta.tokens[meta.eos_token_id] if meta.eos_token_id is not None else None
    _write_json(folder / "config.json", _llama_config(loaded, sorted(tokenizer.eos_token_ids)))
    _write_json(folder / "generation_config.json", {
        "bos_token_id": meta.bos_token_id, "eos_token_id": sorted(tokenizer.eos_token_ids),
    })
    tokenizer.save(folder / "tokenizer.json")
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "chat_template": meta.chat_template,
        "model_max_length": loaded.config.context_length,
        "clean_up_tokenization_spaces": False,
    })
    _write_json(folder / "disagg_source.json", {"gguf": str(loaded.path), "model_hash": loaded.model_hash,
                                                "converter_version": CONVERTER_VERSION})
    write_safetensors(folder / "model.safetensors", dict(_hf_tensors(loaded)))


def _llama_config(loaded: LoadedModelFile, eos_ids: list[int]) -> dict[str, object]:
    c = loaded.config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_base,
        "rope_scaling": None,
        "max_position_embeddings": c.context_length,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": loaded.weights.tied_output,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": loaded.tokenizer.bos_token_id,
        "eos_token_id": eos_ids,
    }


def _unpermute_rope_rows(w: F32Array, n_heads: int) -> F32Array:
    """GGUF stores Q and K rows rotated in adjacent pairs (llama.cpp permuted them when converting from HF);
    Hugging Face's llama rotates the first half of a head against the second. Undo llama.cpp's permutation."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def _hf_tensors(loaded: LoadedModelFile) -> Iterator[tuple[str, F32Array]]:
    w, c = loaded.weights, loaded.config
    yield "model.embed_tokens.weight", w.token_embedding
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", layer.attn_norm
        yield p + "self_attn.q_proj.weight", _unpermute_rope_rows(layer.wq, c.n_heads)
        yield p + "self_attn.k_proj.weight", _unpermute_rope_rows(layer.wk, c.n_kv_heads)
        yield p + "self_attn.v_proj.weight", np.ascontiguousarray(layer.wv)
        yield p + "self_attn.o_proj.weight", layer.wo
        yield p + "post_attention_layernorm.weight", layer.ffn_norm
        yield p + "mlp.gate_proj.weight", np.ascontiguousarray(layer.w_gate)
        yield p + "mlp.up_proj.weight", np.ascontiguousarray(layer.w_up)
        yield p + "mlp.down_proj.weight", layer.w_down
    yield "model.norm.weight", w.output_norm
    if not w.tied_output:
        yield "lm_head.weight", w.output


def write_safetensors(path: pathlib.Path, tensors: dict[str, F32Array]) -> None:
    """The safetensors format written directly (an 8-byte little-endian header length, a JSON header of names,
    dtypes, shapes and byte ranges, then the raw little-endian bytes): no torch needed to convert."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keeps the tensor data 8-byte aligned
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for array in tensors.values():
            out.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def _write_json(path: pathlib.Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
