"""The embedded model: our import of SmolLM2-135M-Instruct against transformers' own GGUF load."""

import pytest
import torch

pytestmark = pytest.mark.slow


def test_imported_smollm2_matches_transformers_gguf_load():
    from transformers import AutoModelForCausalLM

    from specrl import load_model
    from specrl.model.presets import gguf_path
    from specrl.model.tokenizer import encode_chat

    ours, tok = load_model("smollm2-135m", dtype=torch.float32)
    src = gguf_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32).eval()
    prompts = ["What is 2 + 2?", "Write a haiku about rain.", "List three colours."]
    for p in prompts:
        ids = torch.tensor([encode_chat(tok, p)])
        with torch.no_grad():
            ref = hf(ids).logits
            got, _ = ours(ids)
        assert (ref - got).abs().max().item() < 1e-3
        assert torch.equal(ref.argmax(-1), got.argmax(-1))
    assert tok.decode(encode_chat(tok, "hi")).startswith("<|im_start|>")
    assert sum(p.numel() for p in ours.parameters()) == 134_515_008
