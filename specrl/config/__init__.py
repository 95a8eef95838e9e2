"""specrl.config: the training config, a leaf every layer reads: its YAML sections (`sections.py`, the vLLM
backend's `rollout.vllm` section in `vllm.py` and the certificate's `run.certificate` in `certificate.py`), loading
and cross-field checks (`schema.py`), and the hardware (device, precisions) it resolves to at the start of a run
(`hardware.py`). It imports nothing from the layers that use it; the names their registries own are checked by
`specrl.trainer.config_check` right after loading.
"""
