"""Does a verify forward over k+1 tokens compute the same logits as k+1 plain one-token forwards?

seed_exact's token identity with plain decoding needs identical logits at every position. This prints, for the
embedded model in bf16 (or --dtype float32) and several (batch, k), whether the two agree bit for bit and the
largest logit difference when they do not (CPU GEMM kernels round differently for B and B*(k+1) rows).

    .venv/bin/python tools/forward_shape_drift.py [--dtype bfloat16] [--batches 1,3,16,32] [--ks 1,3,7]
"""

from __future__ import annotations

import argparse
import copy

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,3,16,32")
    ap.add_argument("--ks", default="1,3,7")
    a = ap.parse_args()
    from specrl.model.hf_checkpoint import parse_dtype
    from specrl.model.loader import load_model

    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m", dtype=parse_dtype(a.dtype))
    model.eval()
    ids = tok.encode("Compute 37 + 45 and explain each step carefully.")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b in (int(x) for x in a.batches.split(",")):
            for k in (int(x) for x in a.ks.split(",")):
                prompt = torch.tensor([ids] * b)
                n = prompt.shape[1]
                cache = model.new_cache(b, n + k + 8)
                model.forward_hidden(prompt, torch.arange(n).expand(b, n), cache)
                cont = torch.randint(100, 20000, (b, k + 1), generator=g)
                plain_cache, plain = copy.deepcopy(cache), []
                for j in range(k + 1):
                    h, _ = model.forward_hidden(cont[:, j:j + 1], torch.full((b, 1), n + j), plain_cache)
                    plain.append(model.logits(h[:, -1]).float())
                plain = torch.stack(plain, 1)
                h, _ = model.forward_hidden(cont, (n + torch.arange(k + 1)).expand(b, k + 1), cache)
                ver = model.logits(h).float()
                same = torch.equal(plain, ver)
                print(f"B={b:3d} k={k}: " + ("identical" if same else
                                             f"differ, max |logit diff| {float((plain - ver).abs().max()):.3g}"))


if __name__ == "__main__":
    main()
