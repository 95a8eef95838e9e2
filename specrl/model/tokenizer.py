"""Tokenizer helpers: chat-template encoding and stop tokens, over HF tokenizers/transformers."""

from __future__ import annotations


def encode_chat(tokenizer, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt with the generation prompt appended."""
    if not getattr(tokenizer, "chat_template", None):
        return encode_raw(tokenizer, user)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_raw(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, model_args=None) -> tuple[int, ...]:
    """The end-of-turn / end-of-sequence ids generation should stop at."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_args is not None:
        ids.update(int(t) for t in model_args.eos_token_id)
    return tuple(sorted(ids))
