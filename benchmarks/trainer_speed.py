"""The learner's logprob and train stages against transformers + torch AdamW on the same batch, interleaved.

One GRPO batch (--prompts real chat prompts x --group samples each, --response-tokens random response tokens each),
fp32 weights, --precision as `make run` trains (auto: bf16-mixed on CPUs with bf16 units, fp32 elsewhere). Ours:
`Learner.stage_logprob` and `Learner.stage_train` (micro-batches of --micro, LM head on response positions only,
clipped surrogate, grad clip, AdamW), each group's prompt run once (the default), and the same with whole sequences
(`Learner.share_prefixes = False`, the column "ours, whole sequences"). Theirs: the HF `LlamaForCausalLM` of the
same checkpoint, full-sequence logits, the same loss function (`specrl.algorithms.grpo.clipped_surrogate_loss`) and
micro-
batches, torch AdamW (foreach, torch's default; ours is fused). Also times one AdamW step over the policy's
parameters, foreach vs fused. tokens/s counts every token of the batch (prompt + response). --one-update: the step a
batch with one optimizer step takes (what `Learner.learn` runs at the defaults and TRL runs with one update per
batch): no logprob forward on either side, old log-probs are the train forward's own, detached; the logprob row then
times collation only. The output names the processor class, cores, threads and precision.

    .venv/bin/python benchmarks/trainer_speed.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response-tokens", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed"],
                    help="policy.precision for ours; bf16-mixed also runs transformers under the same autocast "
                    "(auto: bf16-mixed where the CPU has bf16 units, else fp32)")
    ap.add_argument("--one-update", action="store_true",
                    help="no logprob forward on either side: old log-probs from the train forward (detached)")
    a = ap.parse_args()
    import torch

    from specrl.device import resolve_precision

    torch.set_num_threads(a.threads)
    a.precision = resolve_precision(a.precision, "cpu", "--precision")
    from common import hardware_line, prompt_ids, run_header

    hw = run_header({"model": "float32", "train": a.precision}, a.threads)
    from transformers import AutoModelForCausalLM

    from specrl import load_model
    from specrl.algorithms.batch import chunks as _chunks
    from specrl.algorithms.batch import collate
    from specrl.algorithms.grpo import clipped_surrogate_loss
    from specrl.algorithms.rollouts import Rollouts
    from specrl.model.presets import prepare
    from specrl.trainer.config_check import validate_config
    from specrl.trainer.learner import Learner

    n = a.prompts * a.group
    policy, tok = load_model("smollm2-135m", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(prepare("smollm2-135m")), dtype=torch.float32,
                                              trust_remote_code=False)
    cfg = validate_config({"grpo": {"num_prompts_per_step": a.prompts, "num_generations": a.group},
                           "policy": {"train_micro_batch_size": a.micro, "learning_rate": 1e-6,
                                      "precision": a.precision},
                           "generation": {"temperature": 1.0}}, "trainer_speed")
    learner = Learner(cfg, policy)
    g = torch.Generator().manual_seed(0)
    prompts = [p for p in prompt_ids(tok, a.prompts) for _ in range(a.group)]  # a GRPO batch: groups share a prompt
    responses = [torch.randint(100, 40000, (a.response_tokens,), generator=g).tolist() for _ in range(n)]
    roll = Rollouts(list(range(n)), prompts, responses, [[-1.0] * a.response_tokens] * n, ["length"] * n,
                    torch.randn(n, generator=g), [False] * n, [None] * n)
    tokens_in_batch = sum(len(p) + a.response_tokens for p in prompts)

    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-6)

    import contextlib

    def hf_logp(toks, m):
        with torch.autocast("cpu", dtype=torch.bfloat16) if a.precision == "bf16-mixed" else contextlib.nullcontext():
            logits = hf(toks).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, toks[:, 1:, None]).squeeze(-1)
        return lp * m

    def trim(batch, idx):  # a micro-batch cut to its longest sequence, as the learner cuts it
        last = max(2, *(batch.ends[i] for i in idx))
        return batch.tokens[idx, :last], batch.mask[idx, : last - 1]

    def hf_stages(batch):
        t = time.perf_counter()
        old = None
        if not a.one_update:
            with torch.no_grad():
                old = torch.zeros_like(batch.gen_logp)
                for idx in _chunks(n, a.micro):
                    toks, m = trim(batch, idx)
                    old[idx, : m.shape[1]] = hf_logp(toks, m)
        t1 = time.perf_counter()
        hf_opt.zero_grad(set_to_none=True)
        total = float(batch.mask.sum())
        for idx in _chunks(n, a.micro):
            toks, m = trim(batch, idx)
            w = m.shape[1]
            lp = hf_logp(toks, m)
            out = clipped_surrogate_loss(lp, lp.detach() if old is None else old[idx, :w], batch.advantages[idx], m,
                                         0.2, 0.28, None,
                                         0.0, normalizer=total)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(list(hf.parameters()), 1.0)
        hf_opt.step()
        return t1 - t, time.perf_counter() - t1

    def ours(share: bool = True):
        learner.share_prefixes = share
        t = time.perf_counter()
        batch = collate(roll, learner.collate_spec)
        if not a.one_update:
            learner.stage_logprob(batch)
        t1 = time.perf_counter()
        learner.stage_train(batch)
        return t1 - t, time.perf_counter() - t1, batch

    _, _, batch = ours()  # warm-up, and the batch layout both sides use
    hf_stages(batch)
    got = {"ours_logprob": [], "ours_train": [], "whole_logprob": [], "whole_train": [], "hf_logprob": [],
           "hf_train": []}
    for _ in range(a.repeats):
        lp, tr, batch = ours()
        got["ours_logprob"].append(lp)
        got["ours_train"].append(tr)
        lp, tr, _ = ours(share=False)
        got["whole_logprob"].append(lp)
        got["whole_train"].append(tr)
        lp, tr = hf_stages(batch)
        got["hf_logprob"].append(lp)
        got["hf_train"].append(tr)
    med = {k: statistics.median(v) for k, v in got.items()}
    params = [p for p in policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt_s = {}
    for name, kw in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-9, **kw)
        opt.step()
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t)
        opt_s[name] = min(ts)
    print(f"threads={a.threads}; batch {n} sequences, {tokens_in_batch} tokens ({a.response_tokens} response tokens "
          f"each), micro-batch {a.micro}, {a.precision}; median of {a.repeats} interleaved runs; "
          f"{hardware_line(hw)}")
    print("| stage | ours s | ours tok/s | ours, whole sequences s | transformers s | transformers tok/s "
          "| ours ÷ whole | ours ÷ transformers |")
    print("|---|---|---|---|---|---|---|---|")
    for stage in ("logprob", "train"):
        o, w, h = med[f"ours_{stage}"], med[f"whole_{stage}"], med[f"hf_{stage}"]
        print(f"| {stage} | {o:.2f} | {tokens_in_batch / o:.0f} | {w:.2f} | {h:.2f} | {tokens_in_batch / h:.0f} "
              f"| {w / o:.2f}× | {h / o:.2f}× |")
    print(f"AdamW step over {sum(p.numel() for p in params) / 1e6:.0f}M parameters: foreach {opt_s['foreach']:.3f} s, "
          f"fused {opt_s['fused']:.3f} s")


if __name__ == "__main__":
    main()
