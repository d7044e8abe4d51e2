"""Prompt text -> int32 ids on the worker that prefills it, at the cost of what a turn adds (docs/engines.md).

``cut_rules`` finds where tokenization provably restarts, ``piece_encoder`` encodes pieces (fastokens, else
``tokenizers``), ``conversation_cache`` keeps recent prompts' ids by their text, and ``prompt_encoder`` puts the
three together behind a tokenizer's ``encode``."""
