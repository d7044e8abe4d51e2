from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING

import numpy as np

from frontend.sampling import SamplingParams
from tests.workers.engines.reference.tiny_model import (
    CONTROL_TOKENS,
    byte_level_alphabet,
    tiny_vocab,
    write_tiny_model,
)
from workers.engines.reference.model_file import load_model_file
from workers.engines.reference.sampler import Sampler
from workers.engines.reference.tokenizer import GGUFTokenizer
from workers.engines.reference.transformer import Transformer

if TYPE_CHECKING:
    from tests.workers.engines.reference.conftest import Engine


def test_byte_level_alphabet() -> None:
    alphabet = byte_level_alphabet()
    assert len(alphabet) == len(set(alphabet)) == 256
    assert alphabet[ord("A")] == "A" and alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"
    assert alphabet[0] == chr(256)


def test_vocab_layout() -> None:
    tokens, merges, types = tiny_vocab()
    assert tuple(tokens[:3]) == CONTROL_TOKENS and types[:3] == [3, 3, 3]
    assert tokens[3 : 3 + 256] == byte_level_alphabet()
    assert len(tokens) == len(types) == 3 + 256 + len(merges)
    assert len(merges) >= 40


def test_same_seed_same_bytes(tmp_path: pathlib.Path) -> None:
    a = write_tiny_model(tmp_path / "a.gguf", seed=5)
    b = write_tiny_model(tmp_path / "b.gguf", seed=5)
    assert a.read_bytes() == b.read_bytes()


def test_custom_shape(tmp_path: pathlib.Path) -> None:
    path = write_tiny_model(
        tmp_path / "c.gguf", seed=2, n_layers=3, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64
    )
    loaded = load_model_file(path)
    c = loaded.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (3, 32, 2, 1, 16, 64)
    tr = Transformer(loaded.weights)
    assert tr.prefill(np.array([1, 50, 60], np.int32), tr.new_cache()).shape == (c.vocab_size,)


def test_not_degenerate(tiny: Engine) -> None:
    # Random prompts should not end at once with <|im_end|>, and sampled text should vary.
    tr, tok = tiny.transformer, tiny.tokenizer
    rng = np.random.default_rng(0)
    first_eos = 0
    outputs = set()
    for i in range(10):
        prompt = tok.encode(tok.render_chat([{"role": "user", "content": f"prompt {i} " + "x" * i}]))
        cache = tr.new_cache()
        logits = tr.prefill(prompt, cache)
        first_eos += int(np.argmax(logits)) in tok.eos_token_ids
        sampler = Sampler(SamplingParams(seed=int(rng.integers(1 << 30))), prompt, tok.vocab_size)
        out = []
        for _ in range(20):
            out.append(sampler.sample(logits).token_id)
            if out[-1] in tok.eos_token_ids:
                break
            logits = tr.decode(out[-1], cache)
        outputs.add(tuple(out))
        assert len(out) >= 5
    assert first_eos == 0 and len(outputs) == 10


def test_loads_through_the_real_path(tiny: Engine) -> None:
    assert isinstance(tiny.tokenizer, GGUFTokenizer)
    assert tiny.loaded.tokenizer.pre == "smollm" and tiny.loaded.weights.tied_output
    text = tiny.tokenizer.render_chat([{"role": "user", "content": "Hello world"}])
    ids = tiny.tokenizer.encode(text)
    assert ids[0] == 1 and 2 in ids.tolist()
