"""Named simulator presets and the workload assumptions behind them.

`paper-8b-rl-think` / `paper-8b-rl-zero` reproduce the setup of paper_8b.json (Qwen3-8B, 32 GB200, sync
GRPO, EAGLE-3 k=3 with the published acceptance lengths). The paper does not publish the rollout workload, so
the presets assume DAPO's published batch (512 prompts x 16 generations, max 20480 response tokens — the
dataset is DAPO-Math-17K), 256-token prompts and a 1800-token mean response (one value for both workloads,
because the paper's logprob and train times are equal within 1%, i.e. equal tokens per step). The log-normal
tail shape of each workload is fitted together with the efficiencies by `specrl simulate fit` and stored in
`calibration/calibrated.py`. `paper-235b` projects Qwen3-235B-A22B on GB200 in FP8 with a rollout batch of 4096 under
async RL with policy lag 2, reusing the RL-Think workload shape and acceptance.
"""

from __future__ import annotations

from dataclasses import replace

from specrl.errors import SpecRLError
from specrl.sim.calibration.calibrated import CALIBRATION
from specrl.sim.costs.roofline import Efficiency
from specrl.sim.pipeline import SimConfig
from specrl.sim.workload import Workload

PAPER_WORKLOAD = Workload(prompts_per_step=512, generations_per_prompt=16, max_response_tokens=20480,
                          prompt_tokens=256, response_mean=1800.0, response_sigma=1.0)
PAPER_AL = {"RL-Think": 2.77, "RL-Zero": 3.32}


def gpu_efficiency() -> Efficiency:
    return Efficiency.from_dict(CALIBRATION["efficiency"])


def paper_workload(name: str, sigma: float | None = None) -> Workload:
    s = CALIBRATION["workload_sigma"][name] if sigma is None else sigma
    return replace(PAPER_WORKLOAD, response_sigma=s)


def paper_8b(name: str, eff: Efficiency | None = None, sigma: float | None = None) -> SimConfig:
    return SimConfig(model="qwen3-8b", hardware="gb200", gpus=32, drafter="eagle3", k=3,
                     acceptance_length=PAPER_AL[name], mode="sync", precision="bf16",
                     workload=paper_workload(name, sigma), efficiency=eff or gpu_efficiency())


def paper_235b() -> SimConfig:
    wl = replace(paper_workload("RL-Think"), prompts_per_step=256, generations_per_prompt=16)
    return SimConfig(model="qwen3-235b-a22b", hardware="gb200", gpus=1024, drafter="eagle3", k=3,
                     acceptance_length=PAPER_AL["RL-Think"], mode="async", policy_lag=2, gen_gpu_fraction=0.5,
                     precision="fp8", workload=wl, efficiency=gpu_efficiency())


PRESETS = {
    "paper-8b-rl-think": lambda: paper_8b("RL-Think"),
    "paper-8b-rl-zero": lambda: paper_8b("RL-Zero"),
    "paper-235b": paper_235b,
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> SimConfig:
    if name not in PRESETS:
        raise SpecRLError(f"unknown preset {name!r}; valid: {', '.join(preset_names())}")
    return PRESETS[name]()
