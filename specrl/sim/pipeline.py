"""One RL step end to end: the five stages, the sync and async pipelines, and the simulator's public entry.

`SimConfig` is everything a user can set (model, hardware, GPUs, drafter, k, acceptance, pipeline mode, workload,
efficiencies). `simulate(config)` validates it, lays the model out (GPUs per engine, memory checks), runs the
generation event simulation twice — plain decoding and with the drafter — prices the other stages (`data` fixed;
`prepare` = weight-sync bytes / bandwidth + fixed; `logprob` = a forward over all step tokens, or nothing when the
train forward supplies the old log-probs (`logprob_forward`); `train` = ≈6·N_active·tokens / achieved FLOP/s +
data-parallel gradient all-reduce) and combines them: `sync` runs the stages in sequence on all GPUs; `async`
splits GPUs between generation and training and overlaps them within the policy lag, so the effective step time is
max(P, C, (P+C)/(L+1)) with P = prepare + gen on the generation side and C = data + logprob + train on the training
side. Under a lag L the generators also run ahead continuously: up to L+1 steps' rollouts share the engines, so the
end-of-batch drain (the long tail) is paid once per L+1 steps (`generation.simulate_generation` with L+1 streams).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from specrl.errors import SpecRLError
from specrl.sim.costs.accelerators import Hardware, get_hardware, with_threads
from specrl.sim.costs.models import DTYPE_BYTES, ModelSpec, eagle3_head, get_model, mtp_head
from specrl.sim.costs.roofline import Efficiency, ForwardCost
from specrl.sim.costs.speculation import DRAFTERS, Acceptance, StepModel
from specrl.sim.costs.training import moe_train_a2a_seconds, trainer_forward_flops
from specrl.sim.generation import SimulatedGeneration, simulate_generation
from specrl.sim.workload import Workload

STAGES = ("data", "prepare", "gen", "logprob", "train")
TRAIN_BYTES_PER_PARAM = 18.0  # bf16 weights + fp32 grads + fp32 master + Adam m, v (mixed precision)


@dataclass(frozen=True)
class SimConfig:
    model: str = "qwen3-8b"
    hardware: str = "gb200"
    gpus: int = 32
    drafter: str = "eagle3"
    k: int | str = 3
    acceptance_length: float | None = 2.77
    acceptance_rates: tuple[float, ...] | None = None
    acceptance_ref_k: int = 3  # the k an acceptance length was measured at, when k is 'auto'
    drafter_model: str = "qwen3-0.6b"  # for drafter 'draft-model'
    draft_vocab: int | None = None  # EAGLE-3 head's draft vocabulary (None: 32k)
    drafter_trained_online: bool = False  # drafter weights are trained and synced every step too
    # online drafter: forward+backward passes of the drafter over the trainer's tokens per RL step
    # (training-time-test steps x updates; specrl's EAGLE: 3 unrolled steps x 1 update)
    drafter_train_passes: float = 3.0
    mode: str = "sync"
    policy_lag: int = 1
    # async: generators queue the next L+1 steps' rollouts back to back, so the end-of-batch drain is paid once
    # per L+1 steps (in-flight / partial-rollout designs). False: one batch at a time (specrl's rollout worker)
    async_run_ahead: bool = True
    gen_gpu_fraction: float = 0.5
    precision: str = "bf16"  # generation weights
    train_precision: str = "bf16"  # logprob and train compute
    gpus_per_engine: int | None = None  # None: the smallest power of two that leaves half of memory for KV
    train_model_parallel: int | None = None  # None: smallest power of two whose shard fits
    max_num_seqs: int = 256
    # largest forward (tokens) that replays a CUDA graph on a GPU; None: vLLM's default for the engine's k,
    # min(max_num_seqs * (1 + k) * 2, 512 | 1024 on data-center Blackwell); 0: no graphs (vLLM enforce_eager)
    cudagraph_max_tokens: int | None = None
    memory_utilization: float = 0.9
    workload: Workload = field(default_factory=Workload)
    efficiency: Efficiency = field(default_factory=Efficiency)
    cpu_profile: str | None = None
    cpu_threads: int | None = None  # measured cpu profile: threads per device (None: the threads it was measured with)
    # measured cpu profile, async: threads of the training device(s) when they differ from the generators'
    # (specrl's pipeline.learner_threads vs worker_threads); None: cpu_threads
    learner_cpu_threads: int | None = None
    # 0: the trainer packs sequences (Megatron / NeMo-RL). N: specrl's trainer — micro-batches of N rollouts in
    # rollout order, right-padded to their longest sequence; the LM head runs on response tokens only.
    train_micro_batch: int = 0
    # a separate logprob forward over the step's tokens (a trainer that takes several optimizer steps per batch, or
    # recomputes old log-probs anyway); False: they come from the train forward (specrl's learner with one optimizer
    # step per batch), and the logprob stage costs nothing
    logprob_forward: bool = True

    def with_(self, **kw) -> SimConfig:
        wl = {k: kw.pop(k) for k in list(kw) if k in Workload.__dataclass_fields__}
        cfg = replace(self, **kw)
        return replace(cfg, workload=replace(cfg.workload, **wl)) if wl else cfg


@dataclass
class Layout:
    gen_gpus: int
    train_gpus: int
    gpus_per_engine: int
    engines: int
    kv_capacity_tokens: float
    train_model_parallel: int
    weights_gb_per_gpu: float


def _pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def drafter_model_spec(cfg: SimConfig, target: ModelSpec) -> ModelSpec | None:
    if cfg.drafter not in DRAFTERS:
        raise SpecRLError(f"unknown drafter {cfg.drafter!r}; valid: {', '.join(DRAFTERS)}")
    if cfg.drafter == "eagle3":
        return eagle3_head(target, cfg.draft_vocab)
    if cfg.drafter == "mtp":
        return mtp_head(target)
    if cfg.drafter == "draft-model":
        return get_model(cfg.drafter_model)
    return None


def build_acceptance(cfg: SimConfig) -> Acceptance | None:
    if cfg.drafter == "none":
        return None
    if cfg.acceptance_rates is not None:
        return Acceptance.from_rates(cfg.acceptance_rates)
    if cfg.acceptance_length is None:
        raise SpecRLError(f"drafter {cfg.drafter!r} needs --acceptance-length X or --acceptance-rates a1,a2,..")
    k = cfg.acceptance_ref_k if cfg.k == "auto" else cfg.k
    if not isinstance(k, int):
        raise SpecRLError(f"k must be an integer >= 1 or 'auto', got {cfg.k!r}")
    return Acceptance.from_length(cfg.acceptance_length, k)


def plan_layout(cfg: SimConfig, model: ModelSpec, hw: Hardware, drafter: ModelSpec | None) -> Layout:
    """GPUs per engine, engine count, KV capacity and the training shard; raises when things do not fit."""
    if cfg.gpus < 1:
        raise SpecRLError(f"--gpus must be >= 1, got {cfg.gpus}")
    if cfg.mode not in ("sync", "async"):
        raise SpecRLError(f"--mode must be sync or async, got {cfg.mode!r}")
    if cfg.precision not in ("bf16", "fp8", "fp32"):
        raise SpecRLError(f"--precision must be bf16 or fp8 (fp32 on cpu), got {cfg.precision!r}")
    if not 0 < cfg.memory_utilization <= 1:
        raise SpecRLError(f"memory_utilization={cfg.memory_utilization} must be in (0, 1]")
    if cfg.mode == "async":
        if not 0.0 < cfg.gen_gpu_fraction < 1.0:
            raise SpecRLError(f"--gen-gpu-fraction must be in (0, 1) for async, got {cfg.gen_gpu_fraction}")
        if cfg.policy_lag < 0:
            raise SpecRLError(f"--policy-lag must be >= 0, got {cfg.policy_lag}")
        gen_gpus = round(cfg.gpus * cfg.gen_gpu_fraction)
        if gen_gpus < 1 or gen_gpus >= cfg.gpus:
            raise SpecRLError(f"--gen-gpu-fraction {cfg.gen_gpu_fraction} of {cfg.gpus} GPUs leaves "
                              f"{gen_gpus} for generation and {cfg.gpus - gen_gpus} for training; both need >= 1")
    else:
        gen_gpus = cfg.gpus
    train_gpus = cfg.gpus - gen_gpus if cfg.mode == "async" else cfg.gpus
    usable = hw.hbm_bytes * cfg.memory_utilization
    wbytes = DTYPE_BYTES[cfg.precision]
    weights = model.total_params() * wbytes + (drafter.total_params() * wbytes if drafter else 0.0)
    if cfg.gpus_per_engine is None:
        g = _pow2_at_least(weights / (0.5 * usable))
        g = min(g, _pow2_at_least(weights / usable * 1.05)) if g > hw.nvlink_domain else g
    else:
        g = cfg.gpus_per_engine
        if g < 1:
            raise SpecRLError(f"--gpus-per-engine must be >= 1, got {g}")
    if weights / g > usable:
        need = _pow2_at_least(weights / usable * 1.001)
        raise SpecRLError(
            f"{model.name} does not fit: its {cfg.precision} weights{' + drafter' if drafter else ''} need "
            f"{weights / 1e9:.1f} GB, {weights / g / 1e9:.1f} GB per GPU at {g} GPU(s) per engine, but a "
            f"{hw.name} offers {usable / 1e9:.1f} GB; use >= {need} GPUs per engine"
            + (" or --precision fp8" if cfg.precision == "bf16" else ""))
    if gen_gpus % g:
        raise SpecRLError(f"{gen_gpus} generation GPUs are not divisible by the parallel layout of {g} GPUs "
                          f"per engine; use a multiple of {g}")
    if gen_gpus < g:
        raise SpecRLError(f"{model.name} needs {g} GPUs per engine but only {gen_gpus} are for generation")
    kv_per_token = model.kv_bytes_per_token() / model.kv_shard(g)
    if drafter is not None:
        kv_per_token += drafter.kv_bytes_per_token() / drafter.kv_shard(g)
    kv_capacity = (usable - weights / g) / kv_per_token
    state = model.total_params() * TRAIN_BYTES_PER_PARAM
    mp = cfg.train_model_parallel or _pow2_at_least(state / (0.8 * hw.hbm_bytes))
    if state / mp > hw.hbm_bytes:
        raise SpecRLError(f"training {model.name} needs {state / 1e12:.2f} TB of weights+grads+optimizer "
                          f"state ({state / mp / 1e9:.0f} GB per GPU at model-parallel {mp}); a {hw.name} "
                          f"has {hw.hbm_bytes / 1e9:.0f} GB: use >= {_pow2_at_least(state / hw.hbm_bytes)}")
    if train_gpus < mp or train_gpus % mp:
        raise SpecRLError(f"{train_gpus} training GPUs are not divisible by the training model-parallel size "
                          f"{mp} that {model.name} needs ({state / 1e9:.0f} GB of training state); use a "
                          f"multiple of {mp}" + (" or a different --gen-gpu-fraction" if cfg.mode == "async" else ""))
    return Layout(gen_gpus, train_gpus, g, gen_gpus // g, kv_capacity, mp, weights / g / 1e9)


@dataclass
class Context:
    cfg: SimConfig
    model: ModelSpec
    hw: Hardware
    drafter: ModelSpec | None
    acceptance: Acceptance | None
    layout: Layout
    prompts: np.ndarray  # (streams, rollouts): streams = policy_lag + 1 in async mode, else 1
    responses: np.ndarray
    train_hw: Hardware | None = None  # the device logprob/train run on (None: hw)


def prepare(cfg: SimConfig) -> Context:
    model = get_model(cfg.model)
    hw = get_hardware(cfg.hardware, cfg.cpu_profile)
    check_cudagraph_config(cfg, hw)
    base_hw = hw
    if cfg.cpu_threads is not None:
        hw = with_threads(base_hw, cfg.cpu_threads)
    train_hw = hw
    if cfg.learner_cpu_threads is not None:
        if cfg.mode != "async":
            raise SpecRLError(f"learner_cpu_threads={cfg.learner_cpu_threads} sizes the learner of an async pipeline; "
                              "a sync pipeline trains on the generation devices (use cpu_threads)")
        train_hw = with_threads(base_hw, cfg.learner_cpu_threads)
    if cfg.train_micro_batch < 0:
        raise SpecRLError(f"train_micro_batch={cfg.train_micro_batch} must be 0 (packed sequences) or the trainer's "
                          "micro-batch size >= 1")
    drafter = drafter_model_spec(cfg, model)
    acceptance = build_acceptance(cfg)
    layout = plan_layout(cfg, model, hw, drafter)
    wl = cfg.workload
    streams = cfg.policy_lag + 1 if cfg.mode == "async" and cfg.async_run_ahead else 1
    responses = np.stack([replace(wl, seed=wl.seed + s).response_lengths() for s in range(streams)])
    prompts = np.stack([wl.prompt_lengths()] * streams)
    return Context(cfg, model, hw, drafter, acceptance, layout, prompts, responses, train_hw)


def check_cudagraph_config(cfg: SimConfig, hw: Hardware) -> None:
    v = cfg.cudagraph_max_tokens
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SpecRLError(f"--cudagraph-max-tokens must be an integer >= 0 (the largest forward, in tokens, that "
                          f"replays a CUDA graph; 0: no graphs, like vLLM's enforce_eager), got {v!r}")
    if not hw.cuda_graphs:
        raise SpecRLError(f"--cudagraph-max-tokens {v}: hardware {hw.name!r} has no CUDA graphs (its fitted "
                          "per-forward overheads already hold its launch costs); drop the flag or use a GPU")


def cudagraph_max_tokens(cfg: SimConfig, hw: Hardware, k_max: int) -> float:
    """Largest forward (tokens) of an engine drafting up to `k_max` tokens (0: plain decoding) that replays a
    CUDA graph. vLLM's default (vllm/config/vllm.py `_set_cudagraph_sizes`): min(max_num_seqs x decode query
    length x 2, 512, or 1024 on data-center Blackwell), the decode query length being 1 + num_speculative_tokens.
    inf on a device without CUDA graphs (nothing to fall out of)."""
    check_cudagraph_config(cfg, hw)
    if not hw.cuda_graphs:
        return math.inf
    if cfg.cudagraph_max_tokens is not None:
        return float(cfg.cudagraph_max_tokens)
    return float(min(cfg.max_num_seqs * (1 + k_max) * 2, hw.cudagraph_default_max))


def run_generation(ctx: Context, speculative: bool, trace: list | None = None) -> tuple[SimulatedGeneration, StepModel]:
    cfg, eff, g = ctx.cfg, ctx.cfg.efficiency, ctx.layout.gpus_per_engine
    k_max = 0
    if speculative and ctx.acceptance is not None:
        k_max = ctx.acceptance.max_k if cfg.k == "auto" else int(cfg.k)
    graphs = cudagraph_max_tokens(cfg, ctx.hw, k_max)
    target = ForwardCost(ctx.model, ctx.hw, eff, cfg.precision, g, eff.step_overhead_s, graph_max_tokens=graphs)
    prefill = ForwardCost(ctx.model, ctx.hw, eff, cfg.precision, g, eff.step_overhead_s, graph_max_tokens=graphs)
    draft = None
    if speculative and ctx.drafter is not None:
        draft = ForwardCost(ctx.drafter, ctx.hw, eff, cfg.precision, g, eff.draft_overhead_s,
                            graph_max_tokens=graphs)
    drafter = cfg.drafter if speculative else "none"
    step = StepModel(target, drafter, draft, ctx.acceptance if speculative else None, cfg.k,
                     eff.ngram_overhead_s, eff.spec_seq_overhead_s, eff.decode_seq_overhead_s)
    res = simulate_generation(ctx.prompts, ctx.responses, ctx.layout.engines, step, prefill,
                              ctx.layout.kv_capacity_tokens, cfg.max_num_seqs, cfg.workload.generations_per_prompt,
                              trace=trace)
    return res, step


def other_stages(ctx: Context, speculative: bool) -> dict[str, float]:
    cfg, eff, hw, m, lay = ctx.cfg, ctx.cfg.efficiency, ctx.train_hw or ctx.hw, ctx.model, ctx.layout
    peak = hw.flops(cfg.train_precision) * lay.train_gpus
    gemm, attn = trainer_forward_flops(m, ctx.prompts[0], ctx.responses[0], cfg.train_micro_batch)
    mp, dp = lay.train_model_parallel, lay.train_gpus // lay.train_model_parallel
    ep_a2a = moe_train_a2a_seconds(m, hw, float((ctx.prompts[0] + ctx.responses[0]).sum()), mp, lay.train_gpus)
    # attention priced apart (mfu_attention > 0: specrl's CPU trainer, whose SDPA runs at ~3 % of peak FLOP/s) is
    # bandwidth-bound: on a device carved out of a cpu profile it scales with the device's bandwidth, not its cores
    attn_peak = peak / hw.flops_scale * hw.bandwidth_scale if eff.mfu_attention else peak
    logprob = 0.0
    if cfg.logprob_forward:
        attn_lp = attn / (attn_peak * eff.mfu_attention) if eff.mfu_attention else attn / (peak * eff.mfu_logprob)
        logprob = gemm / (peak * eff.mfu_logprob) + attn_lp + ep_a2a
    grad_bytes = m.total_params() * 2.0 / mp
    grad_sync = 0.0
    if dp > 1:
        grad_sync = 2.0 * (dp - 1) / dp * grad_bytes / hw.link_bandwidth(lay.train_gpus) + hw.collective_latency_s
    train_gemm, train_attn = 3.0 * gemm, 3.0 * attn  # forward + backward (2x the forward)
    if speculative and ctx.drafter is not None and cfg.drafter_trained_online:
        if cfg.drafter_train_passes < 0:
            raise SpecRLError(f"drafter_train_passes={cfg.drafter_train_passes} must be >= 0")
        d_gemm, d_attn = trainer_forward_flops(ctx.drafter, ctx.prompts[0], ctx.responses[0], cfg.train_micro_batch,
                                               head_on_all=True)
        train_gemm += 3.0 * cfg.drafter_train_passes * d_gemm
        train_attn += 3.0 * cfg.drafter_train_passes * d_attn
    train_attn_s = train_attn / (attn_peak * eff.mfu_attention) if eff.mfu_attention else \
        train_attn / (peak * eff.mfu_train)
    train = train_gemm / (peak * eff.mfu_train) + train_attn_s + grad_sync \
        + 2.0 * ep_a2a  # the backward sends the gradients of dispatch and combine back
    sync_bytes = m.total_params() * DTYPE_BYTES[cfg.precision]
    if speculative and ctx.drafter is not None and cfg.drafter_trained_online:
        sync_bytes += ctx.drafter.total_params() * DTYPE_BYTES[cfg.precision]
    # colocated: each GPU reloads its shard over NVLink; async: shards cross to the generation pool
    span = lay.gpus_per_engine if cfg.mode == "sync" else cfg.gpus
    # the weights land on the generation devices (async: the rollout workers' refit)
    prepare_s = sync_bytes / lay.gpus_per_engine / ctx.hw.link_bandwidth(span) + eff.prepare_fixed_s
    return {"data": eff.data_s, "prepare": prepare_s, "logprob": logprob, "train": train}


def combine(stages: dict[str, float], mode: str, policy_lag: int) -> tuple[float, float]:
    """(effective step seconds, exposed generation seconds) for the pipeline mode."""
    if mode == "sync":
        return sum(stages.values()), stages["gen"]
    producer = stages["prepare"] + stages["gen"]
    consumer = stages["data"] + stages["logprob"] + stages["train"]
    step = max(producer, consumer, (producer + consumer) / (policy_lag + 1))
    return step, step - consumer


def _arm(ctx: Context, speculative: bool) -> dict:
    gen, step = run_generation(ctx, speculative)
    stages = other_stages(ctx, speculative)
    stages["gen"] = gen.seconds
    stages = {s: stages[s] for s in STAGES}
    step_s, exposed = combine(stages, ctx.cfg.mode, ctx.cfg.policy_lag)
    out = {"stages": stages, "step_seconds": step_s, "exposed_gen_seconds": exposed,
           "generation": gen.to_dict(), "gen_tokens_per_second": gen.generated_tokens / gen.seconds,
           "cudagraph_max_tokens": step.target.graph_max_tokens if ctx.hw.cuda_graphs else None}
    if speculative:
        out["acceptance_length"] = gen.acceptance_length
        out["num_draft_tokens"] = gen.mean_k
        b, kv = max(gen.mean_batch, 1.0), gen.mean_batch * float(ctx.prompts.mean())
        out["draft_cost_ratio"] = step.draft_cost_ratio(b, kv) if ctx.drafter is not None else 0.0
    return out


def simulate(cfg: SimConfig, ar_cache: dict | None = None) -> dict:
    """Run the simulator; returns the JSON-contract dict (see docs/simulator.md)."""
    ctx = prepare(cfg)
    key = None
    if ar_cache is not None:
        key = repr(replace(cfg, drafter="none", k=1, acceptance_length=None, acceptance_rates=None))
    ar = ar_cache.get(key) if ar_cache is not None else None
    if ar is None:
        ar = _arm(ctx, speculative=False)
        if ar_cache is not None:
            ar_cache[key] = ar
    spec = _arm(ctx, speculative=True) if cfg.drafter != "none" else dict(
        ar, acceptance_length=1.0, num_draft_tokens=0.0, draft_cost_ratio=0.0)
    ar_gen, spec_gen = ar["stages"]["gen"], spec["stages"]["gen"]
    gen_share = ar["exposed_gen_seconds"] / ar["step_seconds"]
    al = spec["acceptance_length"]
    result = {
        "ar": ar,
        "spec": spec,
        "rollout_speedup": ar_gen / spec_gen,
        "step_speedup": ar["step_seconds"] / spec["step_seconds"],
        "bound": 1.0 / (gen_share / al + 1.0 - gen_share),
        "gen_share": gen_share,
        "exposed_gen_seconds": {"ar": ar["exposed_gen_seconds"], "spec": spec["exposed_gen_seconds"]},
        "mode": cfg.mode,
        "config": config_dict(cfg),
        "layout": asdict(ctx.layout),
        "model": {"name": ctx.model.name, "total_params": ctx.model.total_params(),
                  "active_params": ctx.model.active_params(), "moe": ctx.model.is_moe},
        "hardware": ctx.hw.name,
    }
    if cfg.mode == "async":
        sync_ar = simulate(replace(cfg, mode="sync", drafter="none", learner_cpu_threads=None),
                           ar_cache=ar_cache)["ar"]["step_seconds"]
        result["sync_ar_step_seconds"] = sync_ar
        result["combined_speedup_vs_sync_ar"] = sync_ar / spec["step_seconds"]
    return result


def config_dict(cfg: SimConfig) -> dict:
    d = asdict(cfg)
    if d.get("acceptance_rates") is not None:
        d["acceptance_rates"] = list(d["acceptance_rates"])
    return d
