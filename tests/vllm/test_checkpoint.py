"""The zero-config model: the packaged GGUF converted once into a Hugging Face checkpoint, reused, and tokenized
exactly as the reference engine tokenizes it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.vllm.availability import needs_vllm
from workers.engines.reference.model_file import load_model_file
from workers.engines.reference.tokenizer import GGUFTokenizer
from workers.engines.vllm.checkpoint import CONVERTER_VERSION, ensure_hf_checkpoint
from workers.engines.vllm.tokenizer import HFTokenizer

pytestmark = needs_vllm


def test_the_folder_is_named_by_content_and_reused(hf_checkpoint: Path) -> None:
    source = json.loads((hf_checkpoint / "disagg_source.json").read_text())
    assert hf_checkpoint.name == f"{source['model_hash'][:24]}-v{CONVERTER_VERSION}"
    weights = hf_checkpoint / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert ensure_hf_checkpoint() == hf_checkpoint
    assert weights.stat().st_mtime_ns == written  # not converted again
    config = json.loads((hf_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert sorted(p.name for p in hf_checkpoint.iterdir()) == [
        "config.json", "disagg_source.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]


def test_the_checkpoint_tokenizes_and_templates_as_the_gguf_does(hf_checkpoint: Path) -> None:
    ours = HFTokenizer(hf_checkpoint)
    reference = GGUFTokenizer(load_model_file().tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: 12345, héllo 🙂"}]
    rendered = reference.render_chat(messages)
    assert ours.render_chat(messages) == rendered
    assert ours.encode(rendered).tolist() == reference.encode(rendered).tolist()
    assert ours.eos_token_ids == reference.eos_token_ids
    assert ours.vocab_size == reference.vocab_size
