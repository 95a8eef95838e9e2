"""Tiny, offline stand-ins for tests and smoke runs: a char-level chat tokenizer and a random model checkpoint.

`make_tiny_checkpoint(dir)` writes an HF-format checkpoint directory (config.json, model.safetensors) of
`specrl.model.transformer.tiny_model` with vocabulary 128 plus a character-level `PreTrainedTokenizerFast`
whose ids are the ASCII codes, `<|im_start|>`/`<|im_end|>` as ids 1/2 and a ChatML chat template, so
`load_model(dir)` and every code path that needs a tokenizer with a chat template run in well under a second.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer():
    """A 128-token character-level HF tokenizer: printable ASCII + newline at their codes, ChatML specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = c
    vocab["\n"] = 10
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                 pad_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_tiny_checkpoint(path: str | Path, seed: int = 0, arch: str = "llama", **overrides) -> Path:
    """Write a random tiny model + char tokenizer as a checkpoint directory loadable by `load_model`."""
    from specrl.model.hf_checkpoint import save_hf_checkpoint
    from specrl.model.transformer import tiny_model

    overrides.setdefault("eos_token_id", [2])
    model = tiny_model(arch=arch, vocab_size=128, seed=seed, **overrides)
    out = save_hf_checkpoint(model, path)
    char_tokenizer().save_pretrained(str(out))
    return out


def prefill_and_decode(model, tokens):
    """`model` (a specrl transformer) on `tokens` [B, T] under no_grad: the prefill's logits (many rows), then one
    decode row each with layer 1's capture: (prefill logits, decode logits, capture)."""
    import torch

    cache = model.new_cache(tokens.shape[0], 32)
    with torch.no_grad():
        pre, _ = model.forward(tokens, kv_cache=cache)
        pos = torch.full((tokens.shape[0], 1), tokens.shape[1])
        dec, cap = model.forward(tokens[:, -1:], pos, cache, capture=(1,))
    return pre, dec, cap[1]
