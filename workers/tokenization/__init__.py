"""Prompt text -> int32 ids on the worker that prefills it, at the cost of what a turn adds.

At long prompts the tokenizer, not GEN's decode of the relayed ids, is the frontend's largest cost: one Hugging Face
``tokenizers`` encode of a 144k-token chat took 0.7 s here, and every turn of a conversation paid for its whole
history again. Four parts, each a module:

- ``cut_rules``: where tokenization provably restarts for a given ``tokenizer.json`` (after an added token; before a
  space, for byte-level BPE), so that encoding the pieces gives the ids of one whole encode;
- ``piece_encoder``: the encoder of those pieces: ``fastokens`` (a Rust re-implementation of ``tokenizers``, loaded
  from the same JSON and checked against it at load) with its flat uint32 output, else ``tokenizers`` itself;
- ``conversation_cache``: the ids of recent prompts, by their text, so that a follow-up turn encodes only its tail;
- ``prompt_encoder``: the three together, what a tokenizer's ``encode`` calls.
"""
