"""What every `specrl` command group shares: the Typer `app` and its `draft` group, the one-line error exit, and the
options several commands take (--threads, --dtype, --k). Command groups register themselves on `app` in their own
modules (`specrl.cli.training`, `generation`, `drafts`, `backends`); `specrl.cli` imports them in help order.
"""

from __future__ import annotations

import os

import typer

from specrl.errors import SpecRLError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="specrl: RL post-training with lossless "
                  "speculative rollouts.")
draft_app = typer.Typer(no_args_is_help=True, help="Drafters: train one offline (init), build one from a recipe, "
                        "evaluate it held-out (eval), draw its scaling curve (curve), export it to vLLM (export).")
app.add_typer(draft_app, name="draft")

from specrl.sim.commands import app as _sim_app  # noqa: E402  (the simulator registers `specrl simulate ...`)

app.add_typer(_sim_app, name="simulate")


def fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def parse_k(k: str) -> int | str:
    if k == "auto":
        return "auto"
    try:
        return int(k)
    except ValueError:
        raise SpecRLError(f"--k must be an integer or 'auto', got {k!r}") from None


THREADS_HELP = "torch threads: an integer, or auto (the cores other processes leave free when it starts)"


def set_threads(value: str) -> None:
    """Set torch's thread count from a --threads option (an integer or auto)."""
    from specrl.cpu import ThreadGovernor

    g = ThreadGovernor("auto" if value == "auto" else (int(value) if value.isdigit() else value), "--threads")
    g.activate()  # auto: long loops (generation, drafter training) re-read the machine's load as they go
    typer.echo(f"[specrl] torch threads: {g.describe()} (re-read every few seconds while it works)"
               if g.setting == "auto" else f"[specrl] torch threads: {g.describe()}")


DTYPE_HELP = "auto (bf16 where the device has bf16 units: AVX512-BF16/AMX CPUs, CUDA; else fp32) | bf16 | fp32"


def dtype_option(value: str, device: str = "auto"):
    """A --dtype option (auto | bf16 | fp32 | bfloat16 | float32) -> torch dtype, resolved for `device`."""
    from specrl.device import resolve_device, resolve_dtype
    from specrl.model.hf_checkpoint import parse_dtype

    names = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
    if value not in names:
        raise SpecRLError(f"--dtype must be auto, bf16 or fp32, got {value!r}")
    return parse_dtype(resolve_dtype(names[value], resolve_device(device), "--dtype"))


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecRLError(f"{name} must be comma-separated integers, e.g. 1,3,7; got {text!r}") from None
    if not out or min(out) < 1:
        raise SpecRLError(f"{name} must list integers >= 1, got {text!r}")
    return out
