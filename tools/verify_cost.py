"""Per-piece cost of one speculative verify step vs one plain (AR) step, SmolLM2-135M, one thread.

For each batch size B and draft length k it times, interleaved and repeated (median of --repeats), the pieces
`RolloutEngine._spec_step` runs after the drafter: the target forward over [B, k+1] tokens, the LM head (fp32
logits [B, k+1, V]), and the post-processing of `RolloutEngine._verify_logits` (uniforms, temperature/top-p
scaling, softmax or the greedy argmax, `verify.verify`, the behaviour log-probs of the emitted tokens), and the
same pieces of a plain step over [B, 1]. The context is a filled KV cache of
--ctx positions. `--drafts random`: random tokens (rejected at the first position: the residual path); `--drafts
greedy`: the policy's own greedy continuation (all accepted at T=0, the bonus path; often accepted at T=1).

    .venv/bin/python tools/verify_cost.py --batch-sizes 1,2,4,8 --k 3 --repeats 30 [--temperature 0] [--top-p 0.9]
        [--drafts greedy] [--dtype auto|bfloat16|float32]

The model runs in --dtype: auto (default) is what the rollout engine runs on this processor (bf16 where it has bf16
units, fp32 on AVX2-only CPUs); the first line printed names the processor class and the dtype.
"""

from __future__ import annotations

import argparse
import statistics
import time


def post_pieces(eng, logits, batch, drafts, tick) -> None:
    """What `RolloutEngine._verify_logits` does after the LM head, piece by piece (the same calls in the same
    order), then the emit loop's conversion to lists."""
    import torch

    from specrl.rollout.sampling import (
        STREAM_ACCEPT,
        STREAM_RESIDUAL,
        STREAM_SAMPLE,
        behaviour_logprobs,
        probs_from_scaled,
        scaled_logits,
        uniform,
    )
    from specrl.rollout.spec_decode.verify import verify

    n, k1, _ = logits.shape
    k = k1 - 1
    t0 = time.perf_counter()
    out_pos = batch.positions[:, None] + torch.arange(k1)[None, :]
    u = uniform(batch.seeds[:, None, None], batch.request_ids[:, None, None], out_pos[:, None, :],
                torch.tensor([STREAM_SAMPLE, STREAM_ACCEPT, STREAM_RESIDUAL])[None, :, None])
    t0 = tick("p:uniforms", t0)
    temp = batch.temperature[:, None].expand(n, k1)
    if bool((temp <= 0).all()):
        scaled, probs, argmax = logits, None, logits.argmax(-1)
        t0 = tick("p:argmax", t0)
    else:
        scaled = scaled_logits(logits, temp, batch.top_p[:, None].expand(n, k1), batch.top_k[:, None].expand(n, k1))
        t0 = tick("p:scaled", t0)
        probs, argmax = probs_from_scaled(logits, scaled, temp), None
        t0 = tick("p:softmax", t0)
    res = verify(eng.verify_mode, probs, drafts, None, u[:, 0], u[:, 1, :k], u[:, 2, :k], None, argmax)
    t0 = tick("p:verify", t0)
    sel = torch.arange(k1)[None, :] < res.num_emitted[:, None]
    lps = behaviour_logprobs(logits[sel], scaled[sel], res.tokens[sel], temp[sel])
    t0 = tick("p:logprobs", t0)
    res.tokens.tolist(), lps.tolist(), res.num_emitted.tolist()
    tick("p:tolist", t0)


def main() -> None:
    import torch

    with torch.no_grad():  # as the engine's generate: no autograd graph (and the packed path applies)
        _main()


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafts", choices=("random", "greedy"), default="random")
    ap.add_argument("--unpacked", action="store_true", help="plain F.linear weights (RolloutEngine packed=False)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="the model's dtype (auto: bf16 where the processor has bf16 units, else fp32)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    from specrl import load_model
    from specrl.device import processor_class, resolve_dtype
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams
    from specrl.rollout.sequences import make_sequences

    dtype = resolve_dtype(a.dtype, "cpu", "--dtype")
    model, _ = load_model("smollm2-135m", dtype=getattr(torch, dtype))
    vocab = model.args.vocab_size
    print(f"processor {processor_class()}, dtype {dtype}")
    print(f"k={a.k} ctx={a.ctx} T={a.temperature} top_p={a.top_p} drafts={a.drafts} threads={a.threads} "
          f"{'unpacked' if a.unpacked else 'packed'} (ms, "
          f"median of {a.repeats}; post = everything after the LM head)")
    print(f"{'B':>3} {'mode':>10} {'fwd':>7} {'head':>7} {'post':>7} {'post/fwd+head':>13} "
          f"{'ar fwd':>7} {'ar head':>7} {'ar post':>7}  pieces of post")
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        for mode in ("rejection", "seed_exact"):
            eng = RolloutEngine(model, max_batch_size=b, max_seq_len=a.ctx + 256, verify=mode, packed=not a.unpacked)
            sp = SamplingParams(temperature=a.temperature, top_p=a.top_p)
            seqs = make_sequences([[1 + (i * 7 + j) % 1000 for j in range(a.ctx)] for i in range(b)], sp, vocab,
                                  eng.max_seq_len)
            for s in seqs:
                s.out.append(5)
            batch = eng._draft_batch(seqs)
            g = torch.Generator().manual_seed(0)
            drafts = torch.randint(0, vocab, (b, a.k), generator=g)
            last = torch.tensor([[s.out[-1]] for s in seqs])
            tokens = torch.cat([last, drafts], 1)
            pos = (batch.positions - 1)[:, None] + torch.arange(a.k + 1)[None, :]
            cache = eng.cache.slots(0, b)
            for _ in range(a.k if a.drafts == "greedy" else 0):  # k rounds make drafts the greedy continuation
                drafts = model.logits(model.forward_hidden(tokens, pos, cache)[0])[:, :a.k].argmax(-1)
                tokens = torch.cat([last, drafts], 1)
            times: dict[str, list[float]] = {}

            def tick(name, t0, times=times):
                t = time.perf_counter()
                times.setdefault(name, []).append((t - t0) * 1e3)
                return t

            for _ in range(a.repeats + 3):
                t0 = time.perf_counter()
                hidden, _ = model.forward_hidden(tokens, pos, cache)
                t0 = tick("fwd", t0)
                logits = model.logits(hidden)
                t0 = tick("head", t0)
                post_pieces(eng, logits, batch, drafts, tick)
                t0 = time.perf_counter()
                h1, _ = model.forward_hidden(last, pos[:, :1], cache)
                t0 = tick("ar fwd", t0)
                l1 = model.logits(h1[:, -1])
                t0 = tick("ar head", t0)
                eng._sample_rows(l1, seqs, batch.positions)
                tick("ar post", t0)
            med = {n: statistics.median(v[3:]) for n, v in times.items()}
            pieces = [n for n in med if n.startswith("p:")]
            post = sum(med[n] for n in pieces)
            print(f"{b:>3} {mode:>10} {med['fwd']:>7.2f} {med['head']:>7.2f} {post:>7.2f} "
                  f"{post / (med['fwd'] + med['head']):>13.3f} {med['ar fwd']:>7.2f} {med['ar head']:>7.2f} "
                  f"{med['ar post']:>7.2f}  " + " ".join(f"{n[2:]}={med[n]:.2f}" for n in pieces), flush=True)


if __name__ == "__main__":
    main()
