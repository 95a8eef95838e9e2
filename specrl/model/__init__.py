"""specrl.model: the policy model itself, with no knowledge of rollouts or training.

This package owns the decoder-only transformer and its KV cache (`transformer.py`), HF safetensors checkpoint
I/O and parameter-name mapping (`hf_checkpoint.py`), `load_model` for embedded presets and checkpoint directories
(`loader.py`), the embedded model presets and their cache (`presets.py`), tokenizer helpers such as chat
templates and stop tokens (`tokenizer.py`) and inference weights laid out once for the CPU's decode kernels
(`packed.py`: bf16 prepacked for oneDNN, float32 per kernel class). It
imports only the layers below it (`specrl.errors`, `specrl.device`, `specrl.fileio`).
"""
