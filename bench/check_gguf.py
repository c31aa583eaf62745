"""Check that a GGUF model run with its blocks kept quantized computes exactly what the same model
dequantized to float32 computes, and that its greedy output equals HF ``generate`` on the
dequantized model.

  python bench/check_gguf.py MODEL.gguf [--prompt "..."] [--tokens 25]

Prints the weight formats found, whether the prefill logits are bit-identical (quantized vs
dequantized), whether the greedy continuations are equal, and exits non-zero if not.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def greedy(model, ids, tokens: int):
    import torch
    n = ids.shape[1]
    cache = model.new_cache(n + tokens + 1)
    logits = model.forward(ids, torch.arange(n)[None], cache, 0)
    out = [int(logits[0, -1].argmax())]
    for i in range(tokens - 1):
        step = model.forward(torch.tensor([[out[-1]]]), torch.tensor([[n + i]]), cache, n + i)
        out.append(int(step[0, -1].argmax()))
    return logits, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a .gguf file")
    p.add_argument("--prompt", default="Write a Python function that reverses a string.")
    p.add_argument("--tokens", type=int, default=25)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from turbospec.model import loader
    from turbospec.ops import reference
    torch.set_num_threads(args.threads)
    t = time.time()
    q = loader.load_model(args.model)
    fmts = collections.Counter(reference.WEIGHT_FORMATS[f][0] for layer in q.layers for lin in layer.linears()
                               for f in lin.formats)
    print(f"quantized load {time.time() - t:.1f} s; layer weight formats {dict(fmts)}; LM head "
          f"{[reference.WEIGHT_FORMATS[f][0] for f in q.lm_head.formats]}")
    d = loader.load_model(args.model, weights="dense")
    tok = loader.load_tokenizer(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    (lq, oq), (ld, od) = greedy(q, ids, args.tokens), greedy(d, ids, args.tokens)
    same_logits, same_tokens = torch.equal(lq, ld), oq == od
    hf = loader.load_hf_model(args.model, torch.float32)
    with torch.no_grad():
        g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, do_sample=False)
    same_hf = g[0, ids.shape[1]:].tolist() == oq
    print(f"prefill logits bit-identical (quantized vs dequantized): {same_logits}")
    print(f"{args.tokens} greedy tokens equal (quantized vs dequantized): {same_tokens}")
    print(f"greedy equal to HF generate on the dequantized model: {same_hf}")
    print(repr(tok.decode(oq)))
    return 0 if same_logits and same_tokens and same_hf else 1


if __name__ == "__main__":
    sys.exit(main())
