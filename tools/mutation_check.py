"""Mutation check for THE verifier: plant known bugs and fail unless the losslessness suite catches every one.

Each mutant is a copy of specrl/rollout/spec_decode/verify.py with one source substitution, written to a temporary
directory
and imported from there (the real file is never edited). The direct tests of tests/test_verify_power.py
(10^6 synthetic rows per case, exact outcome probabilities) run against each mutant until one case fails; the
wrong-position-bonus mutant also runs one end-to-end bonus-path case of tests/test_spec_proof.py (the engine's
`verify` patched in this process only). The unmutated copy must pass every case. Exit status 1 if any mutant
survives or the unmutated verifier fails, 0 otherwise.

    .venv/bin/python tools/mutation_check.py            # the CI check (about a minute on 2 cores)
    .venv/bin/python tools/mutation_check.py --power    # also print the suite's power (analytic and simulated)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VERIFY = ROOT / "specrl" / "rollout" / "spec_decode" / "verify.py"

REJECTION = ["rejection-q-k1", "rejection-onehot-k1", "rejection-q-k2", "rejection-onehot-k2", "rejection-q-k3",
             "rejection-onehot-k3"]
SEED_EXACT = ["seed_exact-q-k1", "seed_exact-q-k2", "seed_exact-q-k3"]
ACCEPT = "    ok = u_accept * q_x.double() < p_x.double()\n"
# name: (what the bug is, source text, its replacement, direct cases to try in order, also run the e2e case?)
MUTANTS = {
    "residual-from-p": ("replacement drawn from p instead of norm(max(0, p - q))",
                        "    resid = (p_j - q_j).clamp_min(0.0)\n", "    resid = p_j.clamp_min(0.0)\n",
                        REJECTION, False),
    "residual-keeps-onehot-draft": ("one-hot drafts: residual from p without removing the rejected draft",
                                    "        q_j = torch.zeros_like(p_j).scatter(-1, draft_tokens[rows, j][:, None], "
                                    "1.0)\n", "        q_j = torch.zeros_like(p_j)\n",
                                    ["rejection-onehot-k1", "rejection-onehot-k2", "rejection-onehot-k3"], False),
    "residual-wrong-position": ("residual drawn at the position before the rejected one",
                                "    j = num_acc.clamp_max(k - 1)", "    j = (num_acc - 1).clamp(0, k - 1)",
                                ["rejection-q-k2", "rejection-onehot-k2", "rejection-q-k3"], False),
    "accept-ignoring-q": ("accept with probability p(x) instead of min(1, p(x)/q(x))",
                          ACCEPT, "    ok = u_accept < p_x.double()\n", ["rejection-q-k1", "rejection-q-k2"], False),
    "bonus-wrong-position": ("bonus token drawn from p at position k-1 instead of k",
                             "bonus_p, bonus_u = target_probs[rows, num_acc], u_sample[rows, num_acc]",
                             "bonus_p, bonus_u = target_probs[rows, num_acc - 1], u_sample[rows, num_acc]", REJECTION,
                             True),
    "over-accept-2pct": ("accept when u*q < 1.02*p", ACCEPT, ACCEPT.replace("< p_x", "< 1.02 * p_x"), REJECTION,
                         False),
    "over-accept-1pct": ("accept when u*q < 1.01*p", ACCEPT, ACCEPT.replace("< p_x", "< 1.01 * p_x"), REJECTION,
                         False),
    "under-accept-1pct": ("accept when u*q < 0.99*p", ACCEPT, ACCEPT.replace("< p_x", "< 0.99 * p_x"), REJECTION,
                          False),
    "seed-exact-mirrored-noise": ("seed_exact draws the policy token with 1 - u (still p-distributed, not the "
                                  "autoregressive sampler's token)",
                                  "sample_inverse_cdf(target_probs[live, i], u_sample[live, i])",
                                  "sample_inverse_cdf(target_probs[live, i], 1 - u_sample[live, i])", SEED_EXACT,
                                  False),
}


def load_variant(name: str, old: str | None, new: str | None, tmp: Path):
    """verify.py with `old` (which must occur exactly once) replaced by `new`, imported from tmp."""
    src = VERIFY.read_text()
    if old is not None:
        if src.count(old) != 1:
            raise SystemExit(f"mutation_check: mutant {name!r}: the text it replaces occurs {src.count(old)} times "
                             f"in {VERIFY} (expected once); update MUTANTS to the verifier's current source")
        src = src.replace(old, new)
    path = tmp / f"verify_{name.replace('-', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"_mutant_{name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.verify


def direct_case(case_name: str, verify_fn, prepared=None) -> tuple[bool, str]:
    """(passed, detail) for one case of tests/test_verify_power.py run with verify_fn."""
    from tests import test_verify_power as tvp

    case = next(c for c in tvp.CASES if tvp.case_id(c) == case_name)
    try:
        r = tvp.run_case(case, verify_fn, prepared=prepared)
    except AssertionError as e:
        return False, f"assertion: {str(e).splitlines()[0]}"
    return r.pvalue > tvp.ALPHA, f"chi-square {r.stat:.1f} on {r.df} df, p = {r.pvalue:.2e}"


def e2e_case(verify_fn, kind: str = "draft-model", mode: str = "rejection") -> tuple[bool, str]:
    """(passed, detail) for tests/test_spec_proof.py's bonus-path case with the engine using verify_fn."""
    import specrl.rollout.engine as engine_module
    from specrl.model.transformer import tiny_model
    from tests.stats import FAMILY_ALPHA
    from tests.test_spec_proof import bonus_path_case

    real = engine_module.verify
    engine_module.verify = verify_fn
    try:
        pvalue, bonus = bonus_path_case(tiny_model("llama", vocab_size=8, seed=5, num_layers=2), kind, mode)
    finally:
        engine_module.verify = real
    return pvalue > FAMILY_ALPHA and bonus >= 200, f"e2e {kind}/{mode}: adjusted p = {pvalue:.2e}, {bonus} bonus rows"


def mutation_check() -> int:
    import torch

    from tests import test_verify_power as tvp

    torch.set_num_threads(min(2, torch.get_num_threads()))
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        original = load_variant("unmutated", None, None, Path(tmp))
        mutants = {name: load_variant(name, old, new, Path(tmp)) for name, (_, old, new, _, _) in MUTANTS.items()}
        caught: dict[str, list[str]] = {name: [] for name in MUTANTS}
        for case in tvp.CASES:  # case by case, so each case's 10^6 rows are built once and then dropped
            name = tvp.case_id(case)
            prepared = tvp.prepare_case(case)
            ok, detail = direct_case(name, original, prepared)
            print(f"unmutated  {name:22s} {'pass' if ok else 'FAIL'}  {detail}", flush=True)
            if not ok:
                failures.append(f"the unmutated verifier fails {name}")
            for mname, (_, _, _, cases, _) in MUTANTS.items():
                if name in cases and not caught[mname]:
                    ok, detail = direct_case(name, mutants[mname], prepared)
                    if not ok:
                        caught[mname].append(f"{name}: {detail}")
            del prepared
        ok, detail = e2e_case(original)
        print(f"unmutated  {'e2e bonus path':22s} {'pass' if ok else 'FAIL'}  {detail}", flush=True)
        if not ok:
            failures.append("the unmutated verifier fails the end-to-end bonus-path case")
        for mname, (what, _, _, _, e2e) in MUTANTS.items():
            if e2e:
                ok, detail = e2e_case(mutants[mname])
                if not ok:
                    caught[mname].append(detail)
                else:
                    failures.append(f"mutant {mname} survived the end-to-end bonus-path case ({detail})")
            status = "caught  " if caught[mname] else "SURVIVED"
            print(f"{status} {mname:28s} ({what}): {'; '.join(caught[mname]) or 'every case passed'}", flush=True)
            if not caught[mname]:
                failures.append(f"mutant {mname} survived every case")
        print(f"mutation check: {len(MUTANTS)} mutants in {time.perf_counter() - t0:.0f} s", flush=True)
    for f in failures:
        print(f"mutation check FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


def power_report(reps: int) -> None:
    """The direct tests' power: analytic (noncentral chi-square) for planted biases, then simulated: `reps`
    re-seeded runs of the 1% over-acceptance mutant and of the correct verifier per case."""
    import numpy as np
    import torch
    from scipy.stats import kstest

    from specrl.rollout.spec_decode.verify import verify
    from tests import test_verify_power as tvp
    from tests.stats import ALPHA, FAMILY_ALPHA, N_CHI_SQUARE

    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"family: {N_CHI_SQUARE} chi-square cases, family-wise alpha {FAMILY_ALPHA:g} (Bonferroni = Holm's "
          f"decision), per-case alpha {ALPHA:.3g}; {tvp.N_ROWS} rows per direct case")
    scales = [1.0025, 1.005, 1.01, 1.02, 0.99]
    miss = {c: 1.0 for c in scales}
    miss_bonus = 1.0
    print("P(a case misses the bug) = 1 - power, analytic; c = acceptance scale (accept when u*q < c*p)")
    print(f"{'case':22s} {'df':>3s} {'crit':>6s}  " + "  ".join(f"c={c:<7g}" for c in scales) + "  wrong-bonus")
    results = {}
    for case in tvp.CASES:
        r = tvp.run_case(case)
        results[tvp.case_id(case)] = r
        mode, _, k = case
        cols = []
        for c in scales:
            pw, lam = tvp.analytic_power(r, mode, accept_scale=c)
            cols.append(f"{1 - pw:.2e}" if mode == "rejection" else "    -    ")
            if mode == "rejection":
                miss[c] *= 1 - pw
        pw, lam = tvp.analytic_power(r, mode, bonus_pos=k - 1)
        if mode == "rejection":
            miss_bonus *= 1 - pw
        lam1 = tvp.analytic_power(r, mode, accept_scale=1.01)[1]
        print(f"{tvp.case_id(case):22s} {r.df:3d} {r.critical:6.1f}  " + "  ".join(cols) +
              f"  {1 - pw:.2e} (noncentrality: wrong bonus {lam:.3g}, c=1.01 {lam1:.3g})", flush=True)
    print("P(every rejection case misses the bug), analytic: " +
          ", ".join(f"c={c:g}: {miss[c]:.2e}" for c in scales) + f", wrong bonus: {miss_bonus:.2e}")
    if reps <= 0:
        return
    with tempfile.TemporaryDirectory() as tmp:
        _, old, new, _, _ = MUTANTS["over-accept-1pct"]
        mutant = load_variant("over-accept-1pct", old, new, Path(tmp))
        print(f"simulated, {reps} re-seeded runs per case (seeds 10^6 + i):")
        for name in REJECTION:
            case = next(c for c in tvp.CASES if tvp.case_id(c) == name)
            caught, stats = 0, []
            for i in range(reps):
                r = tvp.run_case(case, mutant, seed=10 ** 6 + 1000 * i + tvp.case_seed(case))
                caught += r.pvalue <= ALPHA
                stats.append(r.stat)
            print(f"  1% over-acceptance, {name:22s}: caught {caught}/{reps} (statistic min {min(stats):.1f}, "
                  f"median {np.median(stats):.1f}; critical {results[name].critical:.1f})", flush=True)
        pvals = []
        for case in tvp.CASES:
            for i in range(reps):
                pvals.append(tvp.run_case(case, verify, seed=2 * 10 ** 6 + 1000 * i + tvp.case_seed(case)).pvalue)
        pvals = np.array(pvals)
        print(f"  correct verifier: {len(pvals)} runs, min p {pvals.min():.3g}, share p < 0.05: "
              f"{(pvals < 0.05).mean():.3f}, p < 0.01: {(pvals < 0.01).mean():.3f}, KS test of uniformity p = "
              f"{kstest(pvals, 'uniform').pvalue:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--power", action="store_true", help="print the power report instead of the mutation check")
    ap.add_argument("--reps", type=int, default=10, help="re-seeded runs per case for the simulated power")
    args = ap.parse_args()
    if args.power:
        power_report(args.reps)
        return 0
    return mutation_check()


if __name__ == "__main__":
    sys.exit(main())
