"""Which planted verifier bugs (`tools/mutation_check.py`'s mutants) the run certificate catches at its default
size, beside each mutant's exact effect size.

The setting is a Markov one, so every mutant's emitted distribution can be computed exactly: a vocabulary-64 target
whose single layer's attention and MLP outputs are zeroed (its next-token distribution p(. | last token) depends on
the last token only, through its untied embedding and LM head), and a draft model built the same way from another
seed (sampled drafts, q(. | last token)); for the one-hot mutant, a deterministic drafter that drafts the target's
own most likely token. `--sharpness S` multiplies both models' logits by S (more peaked distributions). k = 2,
rejection sampling at T = 1, the certificate's continuations of 8 tokens on four prompts.

*Exact*: for each mutant, its verify rule written as a law (acceptance G(c, x), the replacement distributions at
offsets 0 and 1, the bonus distribution) is pushed through the whole continuation by dynamic programming over (last
token, tokens emitted), which gives, per draft position (plain, draft 1, draft 2, bonus), the exact expected
number of tokens and the exact distribution of the certificate's 10 PIT bins. Cohen's w is computed pooled and per
position against the uniform bins the policy gives, and the certificate's analytic power from them (pooled test at
alpha / 2; a position at alpha / (2 m), m the positions tested: the Holm family's first threshold). The real
verifier's law gives uniform bins exactly (w ~ 1e-16), which checks the dynamic programme.
*Measured*: the native engine's `verify` is replaced in this process only by the mutant copy and the certificate's
test runs at its default size (`specrl.run.certificate.plan`: w <= 0.10 at power 0.99); a mutant is caught when it
fails. `fit p` tests the measured pooled bins against the exact ones (a check that the law is the mutant's code).
The seed_exact mutant draws every token from p by construction (w = 0 exactly: no distribution test can see it).

    .venv/bin/python tools/certificate_mutants.py [--only NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9], [11, 3, 12, 4]]
K, V, BINS = 2, 64, 10
ROLES = ("plain", "draft 1", "draft 2", "bonus")


def markov_model(seed: int, sharpness: float = 1.0):
    """A vocabulary-64 model whose next-token distribution depends on the last token only; `sharpness` scales its
    LM head (its logits), so > 1 gives more peaked distributions."""
    from specrl.model.transformer import tiny_model

    m = tiny_model("llama", vocab_size=V, seed=seed, num_layers=1, tie_word_embeddings=False)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        m.lm_head.weight.mul_(sharpness)
    return m


@torch.no_grad()
def next_token_probs(model) -> torch.Tensor:
    """[V, V] float64: row c = the model's distribution after token c at T = 1."""
    from specrl.rollout.sampling import probs_from_logits

    logits = model(torch.arange(V)[:, None])[0][:, -1].float()
    P = probs_from_logits(logits, torch.ones(V), torch.ones(V), torch.zeros(V, dtype=torch.long)).double()
    return P / P.sum(-1, keepdim=True)  # rows summing to 1 in float64, so the PIT intervals tile [0, 1]


def pit_bins(P: torch.Tensor) -> torch.Tensor:
    """[V(c), V(y), BINS]: the probability that token y's randomised PIT under P[c] falls in each bin."""
    idx = torch.arange(V)
    py = P[:, :, None]
    before = (P[:, None, :] * ((P[:, None, :] > py) | ((P[:, None, :] == py) & (idx[None, None, :] < idx[None, :,
                                                                                                          None])))).sum(-1)
    lo, hi = before, before + P
    edges = torch.linspace(0, 1, BINS + 1, dtype=torch.float64)
    overlap = (torch.minimum(hi[..., None], edges[1:]) - torch.maximum(lo[..., None], edges[:-1])).clamp_min(0)
    return overlap / P[..., None].clamp_min(1e-300)


def _norm(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    mass = x.sum(-1, keepdim=True)
    return torch.where(mass > 0, x / mass.clamp_min(1e-300), fallback)


def law(name: str, P: torch.Tensor, Q: torch.Tensor, onehot: bool):
    """The step law of verify variant `name` at k = 2: (G [c, x] = P(draft x proposed and accepted | c), R0 [a, y] the
    replacement after a rejection at offset 0, Rs [a, x1, y] after a rejection at offset 1, Bon [x1, x2, y])."""
    if onehot:  # the deterministic drafter drafts f(c) = argmax P[c]; accepted with probability p(f(c))
        D = torch.zeros_like(P).scatter(-1, P.argmax(-1, keepdim=True), 1.0)
        G = D * P
    else:
        D = Q
        scale = {"over-accept-2pct": 1.02, "over-accept-1pct": 1.01, "under-accept-1pct": 0.99}.get(name, 1.0)
        G = Q * P if name == "accept-ignoring-q" else torch.minimum(Q, scale * P)
    R = _norm((P - D).clamp_min(0), P)
    if name == "residual-from-p" or (name == "residual-keeps-onehot-draft" and onehot):
        R = P.clone()
    Rs = R[None, :, :].expand(V, V, V)
    if name == "residual-wrong-position":  # a rejection at offset 1 draws from offset 0's residual
        Rs = R[:, None, :].expand(V, V, V)
    Bon = P[None, :, :].expand(V, V, V)  # [x1, x2, y] = p(y | x2)
    if name == "bonus-wrong-position":
        Bon = P[:, None, :].expand(V, V, V)  # p(y | x1)
    return G, R, Rs, Bon


def exact(name: str, P: torch.Tensor, Q: torch.Tensor, onehot: bool, tokens: int) -> dict:
    """Per role: expected tokens per continuation and the PIT bin distribution, by dynamic programming."""
    G, R0, Rs, Bon = law(name, P, Q, onehot)
    B = pit_bins(P)
    beta = G.sum(-1)
    A1 = (1 - beta)[:, None] * R0
    A2 = G[:, :, None] * (1 - beta)[None, :, None] * Rs
    bins = {r: torch.zeros(BINS, dtype=torch.float64) for r in ROLES}
    count = dict.fromkeys(ROLES, 0.0)
    mu = torch.zeros(tokens + 3, V, dtype=torch.float64)
    for prompt in PROMPTS:  # the prefill's token: plain, from p(. | the prompt's last token)
        c = prompt[-1]
        bins["plain"] += (P[c][:, None] * B[c]).sum(0) / len(PROMPTS)
        count["plain"] += 1 / len(PROMPTS)
        mu[1] += P[c] / len(PROMPTS)
    for n in range(1, tokens):
        m = mu[n]
        D1 = A1 + A2.sum(-1) + G * beta[None, :]
        bins["draft 1"] += torch.einsum("a,ax,axb->b", m, D1, B)
        count["draft 1"] += float(m.sum())
        mu[n + 1] += m @ A1
        if n + 1 < tokens:
            W2 = torch.einsum("a,axz->xz", m, A2) + (m @ G)[:, None] * G
            bins["draft 2"] += torch.einsum("xz,xzb->b", W2, B)
            count["draft 2"] += float(W2.sum())
            mu[n + 2] += torch.einsum("a,axy->y", m, A2)
        if n + 2 < tokens:
            F = (m @ G)[:, None, None] * G[:, :, None] * Bon
            bins["bonus"] += torch.einsum("xzy,zyb->b", F, B)
            count["bonus"] += float(F.sum())
            mu[n + 3] += F.sum((0, 1))
    total = sum(bins.values()) / tokens
    w = {r: float(((bins[r] / count[r] - 1 / BINS) ** 2 * BINS).sum() ** 0.5) if count[r] > 0 else 0.0
         for r in ROLES}
    return {"w": float(((total - 1 / BINS) ** 2 * BINS).sum() ** 0.5), "pooled_bins": total.tolist(),
            "w_per_position": w, "tokens_per_position": count}


def power(ex: dict, num_continuations: int, tokens: int, alpha: float, pw_target: float) -> float:
    """The certificate's analytic power against this law: the pooled test at alpha / 2, or any position at
    alpha / (2 m) (at least the larger of the two)."""
    from scipy.stats import chi2, ncx2

    n = num_continuations * tokens
    best = float(ncx2.sf(chi2.isf(alpha / 2, BINS - 1), BINS - 1, n * ex["w"] ** 2))
    tested = [r for r in ROLES if ex["tokens_per_position"][r] * num_continuations >= 50]
    for r in tested:
        lam = num_continuations * ex["tokens_per_position"][r] * ex["w_per_position"][r] ** 2
        best = max(best, float(ncx2.sf(chi2.isf(alpha / (2 * len(tested)), BINS - 1), BINS - 1, lam)))
    return best


class ArgmaxDrafter:
    """One-hot drafts: the target's most likely token after the last one, k times (a good deterministic drafter;
    q is one-hot)."""

    kind, target_layers, catch_up_seconds = "argmax", (), 0.0

    def __init__(self, P: torch.Tensor):
        self.next = P.argmax(-1)

    def bind(self, ctx): ...
    def on_prefill(self, slot_start, batch_tokens, captured): ...
    def on_verified(self, batch, proposal, num_emitted, captured): ...
    def compact(self, order): ...

    def memory(self):
        return {}

    def propose(self, batch, k):
        from specrl.rollout.drafter import Proposal

        last, out = torch.tensor([t[-1] for t in batch.tokens]), []
        for _ in range(k):
            last = self.next[last]
            out.append(last)
        return Proposal(torch.stack(out, 1))


def certify_with(verify_fn, mode: str, onehot: bool, target, draft, P) -> dict:
    """The certificate's test at its default size with the engine's verify replaced by `verify_fn`."""
    import specrl.rollout.engine as engine_module
    from specrl.backends.probe import probe_backend
    from specrl.drafters.kinds.draft_model import DraftModelDrafter
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams
    from specrl.run.certificate import ALPHA, POWER, TARGET_W, plan

    p = plan(K, len(PROMPTS))
    engine = RolloutEngine(target, max_batch_size=64, max_seq_len=32, num_draft_tokens=K, verify=mode, k_max=K,
                           drafter=ArgmaxDrafter(P) if onehot else DraftModelDrafter(draft))
    real = engine_module.verify
    engine_module.verify = verify_fn
    t = time.perf_counter()
    try:
        r = probe_backend(engine, target, PROMPTS, SamplingParams(temperature=1.0, seed=0), alpha=ALPHA,
                          num_samples=p["continuations"], num_tokens=p["tokens_each"], power_target=POWER,
                          target_w=TARGET_W)
    finally:
        engine_module.verify = real
    return {"passed": r.passed, "p_value": r.p_value, "num_tokens": r.num_tokens, "detectable_w": r.detectable_w,
            "bin_counts": r.bin_counts, "accepted_per_position": r.accepted_per_position,
            "bonus_tokens": r.bonus_tokens, "positions": r.positions, "continuations": p["continuations"],
            "tokens_each": p["tokens_each"], "seconds": time.perf_counter() - t}


def fit_p(counts: list[int], bins: list[float]) -> float:
    """Chi-square p-value of measured bin counts against the exact bin distribution."""
    from scipy.stats import chi2

    n = sum(counts)
    e = torch.tensor(bins, dtype=torch.float64) * n
    return float(chi2.sf(float(((torch.tensor(counts, dtype=torch.float64) - e) ** 2 / e).sum()), BINS - 1))


def run(only: list[str] | None = None, measure: bool = True, sharpness: float = 1.0) -> list[dict]:
    from mutation_check import MUTANTS, load_variant

    from specrl.run.certificate import ALPHA, POWER

    unknown = sorted(set(only or ()) - set(MUTANTS) - {"unmutated"})
    if unknown:
        raise SystemExit(f"certificate_mutants: no mutant {unknown}; the mutants are {', '.join(MUTANTS)}")
    target, draft = markov_model(3, sharpness), markov_model(4, sharpness)
    P, Q = next_token_probs(target), next_token_probs(draft)
    names = [n for n in ["unmutated", *MUTANTS] if only is None or n in only]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            what, old, new, cases, _ = MUTANTS.get(name, ("the real verifier", None, None, ["rejection"], False))
            mode = "seed_exact" if all(c.startswith("seed_exact") for c in cases) else "rejection"
            onehot = all("onehot" in c for c in cases)
            row = {"mutant": name, "what": what, "verify": mode, "drafter": "one-hot argmax" if onehot else
                   "draft model"}
            if mode == "seed_exact":  # every emitted token is the inverse-CDF draw from p: the policy's law
                row.update(w=0.0, w_per_position=dict.fromkeys(ROLES, 0.0), exact_power=ALPHA)
            else:
                ex = exact(name, P, Q, onehot, 8)
                row.update(w=ex["w"], w_per_position=ex["w_per_position"],
                           tokens_per_position=ex["tokens_per_position"], exact_bins=ex["pooled_bins"])
            if measure:
                r = certify_with(load_variant(name, old, new, Path(tmp)), mode, onehot, target, draft, P)
                row.update(caught=not r["passed"], **r)
                row["position_p"] = min((q["p_value"] for q in r["positions"] if q["p_value"] is not None),
                                        default=float("nan"))
                row["rejected_positions"] = [q["position"] for q in r["positions"] if q["rejected"]]
                if "exact_bins" in row:
                    row["fit_p"] = fit_p(r["bin_counts"], row["exact_bins"])
                    row["exact_power"] = power(row, r["continuations"], r["tokens_each"], ALPHA, POWER)
            rows.append(row)
            wp = ", ".join(f"{k} {v:.3f}" for k, v in row["w_per_position"].items())
            got = (f"{'CAUGHT' if row['caught'] else 'missed'}  p = {row['p_value']:.2e} (positions: "
                   f"{row['position_p']:.2e}), fit p = "
                   f"{row.get('fit_p', float('nan')):.2f}, power {row.get('exact_power', float('nan')):.3f} "
                   f"({row['seconds']:.0f} s)") if measure else ""
            print(f"{name:<28} w = {row['w']:.4f} (per position: {wp})  {got}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="mutant names (and/or 'unmutated')")
    ap.add_argument("--exact-only", action="store_true", help="the exact effect sizes only (no sampling)")
    ap.add_argument("--sharpness", type=float, default=1.0, help="scale of both models' logits (1: as built)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(a.only, measure=not a.exact_only, sharpness=a.sharpness)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
