"""specrl.model: the policy model itself, with no knowledge of rollouts or training.

This package owns the decoder-only transformer and its KV cache (`transformer.py`), HF safetensors checkpoint
I/O and parameter-name mapping (`checkpoint.py`), `load_model` for embedded presets and checkpoint directories
(`loader.py`), the embedded model presets and their cache (`presets.py`), and tokenizer helpers such as chat
templates and stop tokens (`tokenizer.py`). It imports only `specrl.errors`.
"""
