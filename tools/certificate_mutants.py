"""Which planted verifier bugs (`tools/mutation_check.py`'s mutants) the run certificate catches at its default size.

For each mutant (and the unmutated verifier) the native engine's `verify` is replaced in this process only, and the
certificate's test runs as a run's certificate does (`specrl.run.certificate.sample_size`: continuations x tokens
sized to detect w <= 0.10 at power 0.99; the losslessness probe on the task's prompts): a tiny random target
(vocabulary 64) with another tiny model as its draft model (the n-gram drafter's one-hot drafts for the one-hot
mutant), k = 2, rejection sampling at T = 1. A mutant is caught
when the certificate fails. The seed_exact mutant keeps the emitted distribution (it changes which token, not its
law), so no distribution test can catch it; it is run at verify=seed_exact and reported as such.

    .venv/bin/python tools/certificate_mutants.py [--only NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9], [11, 3, 12, 4]]
K = 2


def certify_with(verify_fn, mode: str = "rejection", kind: str = "draft-model") -> dict:
    """The certificate's test at its default size with the engine's verify replaced by `verify_fn`."""
    import specrl.rollout.engine as engine_module
    from specrl.backends.probe import probe_backend
    from specrl.drafters import NGramDrafter
    from specrl.drafters.kinds.draft_model import DraftModelDrafter
    from specrl.model.transformer import tiny_model
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams
    from specrl.run.certificate import POWER, TARGET_W, sample_size

    target = tiny_model("llama", vocab_size=64, seed=3)
    drafter = DraftModelDrafter(tiny_model("llama", vocab_size=64, seed=4, num_layers=1)) if kind == "draft-model" \
        else NGramDrafter()  # one-hot drafts (q = the draft token), from the prompts' repeats
    samples, tokens = sample_size(K)
    engine = RolloutEngine(target, max_batch_size=64, max_seq_len=32, drafter=drafter, num_draft_tokens=K,
                           verify=mode, k_max=K)
    real = engine_module.verify
    engine_module.verify = verify_fn
    t = time.perf_counter()
    try:
        r = probe_backend(engine, target, PROMPTS, SamplingParams(temperature=1.0, seed=0), num_samples=samples,
                          num_tokens=tokens, power_target=POWER, target_w=TARGET_W)
    finally:
        engine_module.verify = real
    return {"passed": r.passed, "p_value": r.p_value, "num_tokens": r.num_tokens, "detectable_w": r.detectable_w,
            "accepted_per_position": r.accepted_per_position, "bonus_tokens": r.bonus_tokens,
            "seconds": time.perf_counter() - t}


def run(only: list[str] | None = None) -> list[dict]:
    from mutation_check import MUTANTS, load_variant

    names = [n for n in MUTANTS if only is None or n in only]
    unknown = sorted(set(only or ()) - set(MUTANTS) - {"unmutated"})
    if unknown:
        raise SystemExit(f"certificate_mutants: no mutant {unknown}; the mutants are {', '.join(MUTANTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if only is None or "unmutated" in only:
            r = certify_with(load_variant("unmutated", None, None, Path(tmp)))
            rows.append({"mutant": "unmutated", "what": "the real verifier", "caught": not r["passed"], **r})
        for name in names:
            what, old, new, cases, _ = MUTANTS[name]
            mode = "seed_exact" if all(c.startswith("seed_exact") for c in cases) else "rejection"
            kind = "ngram" if all("onehot" in c for c in cases) else "draft-model"
            r = certify_with(load_variant(name, old, new, Path(tmp)), mode, kind)
            rows.append({"mutant": name, "what": what, "verify": mode, "drafter": kind, "caught": not r["passed"],
                         **r})
            print(f"{name:<28} {'CAUGHT' if not r['passed'] else 'missed'}  p = {r['p_value']:.2e} over "
                  f"{r['num_tokens']} tokens ({r['seconds']:.0f} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="mutant names (and/or 'unmutated')")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = run(a.only)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
