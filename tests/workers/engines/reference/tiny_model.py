"""A tiny random-weight llama GGUF with a real byte-level BPE vocab, for fast tests.

It goes through exactly the same loader, tokenizer and forward pass as the real model, and
follows SmolLM2's conventions: control tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2
first, then the 256 GPT-2 byte-level characters, then merged tokens; ChatML chat template.
"""

from __future__ import annotations

import pathlib

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Merges as pairs of byte-level strings ("Ġ" is the space byte, "Ċ" newline). Each result
# becomes a token, so later merges may use earlier results.
_MERGE_TEXT = (
    "Ġ t,h e,i n,e r,a n,o n,Ġt he,r e,Ġ a,e s,o r,Ġ s,e n,Ġ w,a t,i s,Ġ c,i t,o u,e d,Ġ o,Ġ b,"
    "Ġ f,a r,Ġ p,l l,in g,Ġ m,a l,Ġ i,Ġ h,Ġ d,i c,Ġ in,Ġ Ġ,Ġ is,Ġt o,Ġa n,Ġan d,Ġo f,H e,He ll,"
    "Hell o,Ġw or,Ġwor l,Ġworl d,ĠĠ ĠĠ,Ċ Ċ"
)
_MERGES = tuple((left, right) for left, _, right in (pair.partition(" ") for pair in _MERGE_TEXT.split(",")))

# Simplified ChatML in SmolLM2's style: a default system prompt unless one is given.
CHAT_TEMPLATE = (
    "{% if messages and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_level_alphabet() -> list[str]:
    """The 256 GPT-2 byte-level characters, in byte order (printable bytes map to themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + extra  # unprintable bytes are shifted past Latin-1
            extra += 1
    return [chr(mapping[b]) for b in range(256)]


def tiny_vocab(added_tokens: tuple[str, ...] = ()) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges as "a b" strings, token types); ``added_tokens`` (printable ASCII) last, user-defined tokens
    whose text is their own, as Hermes' and Qwen's ``<tool_call>``."""
    tokens = [*CONTROL_TOKENS, *byte_level_alphabet()]
    types = [int(TokenType.CONTROL)] * len(CONTROL_TOKENS) + [int(TokenType.NORMAL)] * 256
    known = set(tokens)
    for left, right in _MERGES:
        if left not in known or right not in known:
            raise AssertionError(f"merge {left} {right} uses an unknown token")
        merged = left + right
        if merged not in known:
            tokens.append(merged)
            types.append(int(TokenType.NORMAL))
            known.add(merged)
    for added in added_tokens:
        tokens.append(added)
        types.append(int(TokenType.USER_DEFINED))
    return tokens, [f"{a} {b}" for a, b in _MERGES], types


def write_tiny_model(
    path: pathlib.Path | str,
    seed: int = 0,
    *,
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_ff: int = 128,
    context_length: int = 512,
    rope_base: float = 10000.0,
    tied_output: bool = True,
    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    added_tokens: tuple[str, ...] = (),
) -> pathlib.Path:
    """Write a random llama GGUF to `path` and return it.

    tensor_type F32 (default), F16 or Q8_0 (then d_model and d_ff must be multiples of 32).
    """
    path = pathlib.Path(path)
    rng = np.random.default_rng(seed)
    tokens, merges, types = tiny_vocab(added_tokens)
    vocab = len(tokens)
    head_dim = d_model // n_heads

    # Block outputs are scaled up so the layers, not the input embedding, dominate the residual
    # stream: with a tied head and weak layers the model just repeats its last input token.
    residual_gain = 4.0

    def matrix(out_dim: int, in_dim: int, gain: float = 1.0) -> npt.NDArray[np.float32]:
        # Variance-preserving init keeps activations O(1) through the residual stream.
        out: npt.NDArray[np.float32] = (
            rng.standard_normal((out_dim, in_dim)) * (gain / np.sqrt(in_dim))
        ).astype(np.float32)
        return out

    def norm_weight() -> npt.NDArray[np.float32]:
        return (1.0 + 0.1 * rng.standard_normal(d_model)).astype(np.float32)

    embedding = (rng.standard_normal((vocab, d_model)) * 0.5).astype(np.float32)
    # Control tokens get small embeddings: with a tied head their logits stay near 0 while the
    # ordinary tokens spread over +-several, so random text rarely hits <|im_end|> by chance.
    embedding[: len(CONTROL_TOKENS)] *= 0.05

    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny-llama-seed{seed}")
    writer.add_block_count(n_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(d_model)
    writer.add_feed_forward_length(d_ff)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, data: npt.NDArray[np.float32]) -> None:
        if data.ndim == 1 or tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)  # norms stay F32, as in llama.cpp's quantized files
        elif tensor_type == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(data, tensor_type), raw_dtype=tensor_type)

    add("token_embd.weight", embedding)
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm_weight())
        add(p + "attn_q.weight", matrix(n_heads * head_dim, d_model))
        add(p + "attn_k.weight", matrix(n_kv_heads * head_dim, d_model))
        add(p + "attn_v.weight", matrix(n_kv_heads * head_dim, d_model))
        add(p + "attn_output.weight", matrix(d_model, n_heads * head_dim, gain=residual_gain))
        add(p + "ffn_norm.weight", norm_weight())
        add(p + "ffn_gate.weight", matrix(d_ff, d_model))
        add(p + "ffn_up.weight", matrix(d_ff, d_model))
        add(p + "ffn_down.weight", matrix(d_model, d_ff, gain=residual_gain))
    add("output_norm.weight", norm_weight())
    if not tied_output:
        output = matrix(vocab, d_model, gain=4.0)
        output[: len(CONTROL_TOKENS)] *= 0.05
        add("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
