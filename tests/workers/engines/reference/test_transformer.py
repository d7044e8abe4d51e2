from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import pytest

from frontend.sampling import SamplingParams
from workers.engines.reference.model_file import ModelWeights, load_model_file
from workers.engines.reference.sampler import Sampler
from workers.engines.reference.transformer import KVCache, Transformer, export_kv, import_kv

if TYPE_CHECKING:
    from tests.workers.engines.reference.conftest import Engine

F32 = npt.NDArray[np.float32]
PROMPT = np.array(
    [1, 118, 124, 118, 119, 104, 112, 13, 92, 277, 267, 266, 267, 259, 261, 124, 2, 13], np.int32
)
# Greedy ids this engine produces for the France prompt, ending with <|im_end|>:
# "The capital of France is Paris."
FRANCE_GREEDY = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def naive_logits(w: ModelWeights, ids: npt.NDArray[np.int32]) -> npt.NDArray[np.float64]:
    """Slow float64 textbook llama forward, written independently: per-head loops, explicit pairs."""
    c = w.config
    x = w.token_embedding[ids].astype(np.float64)
    t = len(ids)

    def norm(v: npt.NDArray[np.float64], g: F32) -> npt.NDArray[np.float64]:
        out: npt.NDArray[np.float64] = v / np.sqrt((v * v).mean(-1, keepdims=True) + c.rms_eps) * g
        return out

    def rope(v: npt.NDArray[np.float64], pos: int) -> npt.NDArray[np.float64]:
        out = v.copy()
        for i in range(c.head_dim // 2):
            a = pos * c.rope_base ** (-2 * i / c.head_dim)
            out[2 * i] = v[2 * i] * np.cos(a) - v[2 * i + 1] * np.sin(a)
            out[2 * i + 1] = v[2 * i] * np.sin(a) + v[2 * i + 1] * np.cos(a)
        return out

    for lw in w.layers:
        h = norm(x, lw.attn_norm)
        q, k, v = (
            h @ lw.wq.T.astype(np.float64),
            h @ lw.wk.T.astype(np.float64),
            h @ lw.wv.T.astype(np.float64),
        )
        attn = np.zeros((t, c.n_heads * c.head_dim))
        for head in range(c.n_heads):
            kv = head // (c.n_heads // c.n_kv_heads)
            hs, ks = (
                slice(head * c.head_dim, (head + 1) * c.head_dim),
                slice(kv * c.head_dim, (kv + 1) * c.head_dim),
            )
            for i in range(t):
                qi = rope(q[i, hs], i)
                scores = np.array([rope(k[j, ks], j) @ qi for j in range(i + 1)]) / np.sqrt(c.head_dim)
                p = np.exp(scores - scores.max())
                attn[i, hs] = (p / p.sum()) @ v[: i + 1, ks]
        x = x + attn @ lw.wo.T
        h = norm(x, lw.ffn_norm)
        gate, up = h @ lw.w_gate.T, h @ lw.w_up.T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ lw.w_down.T
    return np.asarray(norm(x, w.output_norm) @ w.output.T)


def greedy(tr: Transformer, logits: F32, cache: KVCache, steps: int) -> tuple[list[int], list[F32]]:
    tokens, all_logits = [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = tr.decode(tokens[-1], cache)
        all_logits.append(logits)
    return tokens, all_logits


def test_matches_naive_reference(tiny: Engine) -> None:
    # Pins the conventions: RoPE on adjacent pairs, GQA head mapping, SwiGLU, RMSNorm, causal mask.
    ids = PROMPT[:10]
    got = tiny.transformer.prefill_all_logits(ids, tiny.transformer.new_cache())
    np.testing.assert_allclose(got, naive_logits(tiny.loaded.weights, ids), atol=2e-3, rtol=1e-3)


def test_prefill_equals_token_by_token_decode(tiny: Engine) -> None:
    tr = tiny.transformer
    all_logits = tr.prefill_all_logits(PROMPT, tr.new_cache())
    assert all_logits.shape == (len(PROMPT), tiny.loaded.config.vocab_size) and all_logits.dtype == np.float32
    last = tr.prefill(PROMPT, tr.new_cache())
    np.testing.assert_allclose(last, all_logits[-1], atol=1e-5)
    cache = tr.new_cache(capacity=1)  # also exercises growth by doubling
    stepped = np.stack([tr.decode(int(t), cache) for t in PROMPT])
    np.testing.assert_allclose(stepped, all_logits, atol=1e-4, rtol=1e-4)
    assert cache.length == len(PROMPT) and cache.capacity >= len(PROMPT)


def test_chunked_prefill_close_to_one_shot(tiny: Engine) -> None:
    tr = tiny.transformer
    one = tr.prefill(PROMPT, tr.new_cache())
    cache = tr.new_cache()
    tr.prefill(PROMPT[:7], cache)
    np.testing.assert_allclose(tr.prefill(PROMPT[7:], cache), one, atol=1e-4)


def test_cache_capacity_does_not_change_bits(tiny: Engine) -> None:
    tr = tiny.transformer
    small, big = tr.new_cache(capacity=1), tr.new_cache(capacity=400)
    assert np.array_equal(tr.prefill(PROMPT, small), tr.prefill(PROMPT, big))
    for token in (5, 77, 300):
        assert np.array_equal(tr.decode(token, small), tr.decode(token, big))


def test_export_import_bitwise_with_separately_loaded_weights(tiny: Engine) -> None:
    tr = tiny.transformer
    cache = tr.new_cache()
    logits = tr.prefill(PROMPT, cache)
    k, v = export_kv(cache)
    c = tiny.loaded.config
    assert k.shape == v.shape == (c.n_layers, c.n_kv_heads, len(PROMPT), c.head_dim) and k.dtype == np.float32
    other = Transformer(load_model_file(tiny.loaded.path).weights)
    imported = import_kv(k.copy(), v.copy(), other.config)
    assert imported.length == len(PROMPT)
    want_tokens, want_logits = greedy(tr, logits, cache, 12)
    got_tokens, got_logits = greedy(other, logits, imported, 12)
    assert got_tokens == want_tokens
    for a, b in zip(want_logits, got_logits, strict=True):
        assert np.array_equal(a, b)


def test_import_kv_validates(tiny: Engine) -> None:
    c = tiny.loaded.config
    good = np.zeros((c.n_layers, c.n_kv_heads, 3, c.head_dim), np.float32)
    with pytest.raises(ValueError):
        import_kv(good[:1], good[:1], c)
    with pytest.raises(ValueError):
        import_kv(good.astype(np.float64), good.astype(np.float64), c)
    with pytest.raises(ValueError):
        import_kv(good, good[:, :, :2], c)


def test_input_validation(tiny: Engine) -> None:
    tr = tiny.transformer
    with pytest.raises(ValueError):
        tr.prefill(np.array([tiny.loaded.config.vocab_size], np.int32), tr.new_cache())
    with pytest.raises(ValueError):
        tr.prefill(np.array([], np.int32), tr.new_cache())
    with pytest.raises(ValueError, match="context"):
        tr.prefill(np.zeros(tiny.loaded.config.context_length + 1, np.int32), tr.new_cache())


def _split_run(tr: Transformer, prompt: npt.NDArray[np.int32], cfg: SamplingParams, steps: int) -> list[int]:
    """CTX worker: prefill the real prompt, choose token 0, export KV. GEN worker: import KV and
    continue with a placeholder prompt of the same length (it never sees the real prompt)."""
    vocab = tr.config.vocab_size
    cache = tr.new_cache()
    first = Sampler(cfg, prompt, vocab).sample(tr.prefill(prompt, cache)).token_id
    k, v = export_kv(cache)
    gen_cache = import_kv(k, v, tr.config)
    gen = Sampler(cfg, np.zeros(len(prompt), np.int32), vocab, output_so_far=[first])
    out = [first]
    for _ in range(steps - 1):
        out.append(gen.sample(tr.decode(out[-1], gen_cache)).token_id)
    return out


def _single_run(tr: Transformer, prompt: npt.NDArray[np.int32], cfg: SamplingParams, steps: int) -> list[int]:
    cache = tr.new_cache()
    sampler = Sampler(cfg, prompt, tr.config.vocab_size)
    out = [sampler.sample(tr.prefill(prompt, cache)).token_id]
    for _ in range(steps - 1):
        out.append(sampler.sample(tr.decode(out[-1], cache)).token_id)
    return out


@pytest.mark.parametrize(
    "cfg", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=7)]
)
def test_tiny_split_with_placeholder_prompt_matches_single(tiny: Engine, cfg: SamplingParams) -> None:
    assert _split_run(tiny.transformer, PROMPT, cfg, 15) == _single_run(tiny.transformer, PROMPT, cfg, 15)


@pytest.mark.real_model
def test_real_greedy_france(real: Engine) -> None:
    tok, tr = real.tokenizer, real.transformer
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    cache = tr.new_cache()
    tokens, _ = greedy(tr, tr.prefill(ids, cache), cache, len(FRANCE_GREEDY))
    assert tokens == FRANCE_GREEDY
    assert "Paris" in tok.decode(tokens)


@pytest.mark.real_model
def test_real_export_import_bitwise(real: Engine) -> None:
    tok, tr = real.tokenizer, real.transformer
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "Name three colours."}]))
    cache = tr.new_cache()
    logits = tr.prefill(ids, cache)
    k, v = export_kv(cache)
    other = Transformer(load_model_file(real.loaded.path).weights)
    want_tokens, want_logits = greedy(tr, logits, cache, 6)
    got_tokens, got_logits = greedy(other, logits, import_kv(k, v, other.config), 6)
    assert got_tokens == want_tokens
    assert all(np.array_equal(a, b) for a, b in zip(want_logits, got_logits, strict=True))


@pytest.mark.real_model
def test_real_placeholder_prompt(real: Engine) -> None:
    tok, tr = real.tokenizer, real.transformer
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    greedy_cfg = SamplingParams(temperature=0.0)
    assert _split_run(tr, ids, greedy_cfg, 8) == _single_run(tr, ids, greedy_cfg, 8) == FRANCE_GREEDY


@pytest.mark.real_model
def test_real_speed_report(real: Engine) -> None:
    tok, tr = real.tokenizer, real.transformer
    text = "The quick brown fox jumps over the lazy dog. " * 60
    ids = tok.encode(text)[:500]
    cache = tr.new_cache()
    start = time.perf_counter()
    logits = tr.prefill(ids, cache)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    # 10 decode steps per context length: enough for a rough rate in a printed report (the figures proper come
    # from bench.reference), and a third of the time 30 took.
    greedy(tr, logits, cache, 10)
    decode_s = time.perf_counter() - start
    short = tr.new_cache()
    logits = tr.prefill(ids[:20], short)
    start = time.perf_counter()
    greedy(tr, logits, short, 10)
    short_s = time.perf_counter() - start
    print(
        f"\nload {real.load_seconds:.2f} s, RSS after load {real.rss_mb_after_load:.0f} MB; "
        f"prefill {len(ids)} tokens {len(ids) / prefill_s:.0f} tok/s; "
        f"decode {10 / short_s:.1f} tok/s at 20 ctx, {10 / decode_s:.1f} tok/s at 500 ctx"
    )
