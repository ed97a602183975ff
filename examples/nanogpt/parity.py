#!/usr/bin/env python3
"""Parity: the C++ decoder's logits against the seed's PyTorch model with the same weights.

For each prompt, `nanogpt --parity-dump` prefills the first K tokens and then feeds the rest one
decode step at a time (teacher forcing), in eager mode and by graph replay, and writes the logits of
positions K-1 .. T-1. This script computes the same logits with the seed's PyTorch model
(gpt_model.py) three ways and reports the largest absolute difference of each:

  torch forward   the training forward over the whole prompt (causal mask), fp32 on the GPU
  torch KV cache  the seed's inference path: forward(prompt[:K], cache_pos=0), then
                  decode_one_token() with the static buffers for every later position
  fp64 CPU        the training forward in double precision (how far both are from exact)

Pass: every difference against the fp32 PyTorch paths is below --tol (1e-4).

  python3 examples/nanogpt/parity.py --exe build/examples/nanogpt/nanogpt \
      --weights examples/nanogpt/weights/shakespeare_char.safetensors
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_model as gm  # noqa: E402

PROMPTS = [
    ("\n", 1),
    ("ROMEO:\nBut, soft! what light through yonder window breaks?", 9),
    ("First Citizen:\nBefore we proceed any further, hear me speak.", 30),
    ("To be, or not to be, that is the question:\nWhether 'tis nobler", 1),
    ("KING LEAR. Meantime we shall express our darker purpose.", 56),
]


def load_model(weights, device):
    model = gm.GPTLanguageModel(device).to(device)
    state = load_file(weights)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith((".tril", ".kv_indices"))]  # C++-written files lack buffers
    if missing or unexpected:
        sys.exit(f"state_dict mismatch: missing {missing}, unexpected {unexpected}")
    return model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exe", required=True, help="the nanogpt program")
    ap.add_argument("--weights", required=True)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda"
    model = load_model(args.weights, device)
    model64 = load_model(args.weights, "cpu").double()

    results = []
    ok = True
    print(f"weights {args.weights}; tolerance {args.tol}")
    print(f"{'prompt':<32} {'T':>3} {'K':>3} | {'eager vs fwd':>12} {'graph vs fwd':>12} {'eager vs KV':>12} "
          f"{'graph vs KV':>12} | {'C++ vs fp64':>11} {'torch vs fp64':>13}")
    for text, k in PROMPTS:
        tokens = gm.encode(text)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "logits.json")
            subprocess.run([args.exe, "--weights", args.weights, "--prompt", text, "--prefill-len", str(k),
                            "--parity-dump", path], check=True, stdout=subprocess.DEVNULL)
            dump = json.load(open(path))
        assert dump["tokens"] == tokens, "the C++ program tokenised the prompt differently"
        eager = torch.tensor(dump["logits_eager"], dtype=torch.float64)
        graph = torch.tensor(dump["logits_graph"], dtype=torch.float64)
        idx = torch.tensor([tokens], dtype=torch.long, device=device)
        with torch.no_grad():
            fwd = model(idx)[0][0, k - 1:].double().cpu()
            fwd64 = model64(idx.cpu())[0][0, k - 1:]
            # The seed's KV-cache inference path: eager prefill, then graph-safe single-token decode.
            rows = [model(idx[:, :k], cache_pos=0)[0][0, -1]]
            for pos in range(k, len(tokens)):
                model.static_input_ids.fill_(tokens[pos])
                model.static_position.fill_(pos)
                model.static_cache_pos.fill_(pos)
                rows.append(model.decode_one_token()[0, -1])
            kv = torch.stack(rows).double().cpu()
        d = {
            "prompt": text, "tokens": len(tokens), "prefill_len": k,
            "eager_vs_forward": (eager - fwd).abs().max().item(),
            "graph_vs_forward": (graph - fwd).abs().max().item(),
            "eager_vs_kv": (eager - kv).abs().max().item(),
            "graph_vs_kv": (graph - kv).abs().max().item(),
            "eager_vs_graph": (eager - graph).abs().max().item(),
            "cpp_vs_fp64": (eager - fwd64).abs().max().item(),
            "torch_vs_fp64": (fwd - fwd64).abs().max().item(),
            "logit_range": [fwd.min().item(), fwd.max().item()],
        }
        results.append(d)
        worst = max(d["eager_vs_forward"], d["graph_vs_forward"], d["eager_vs_kv"], d["graph_vs_kv"])
        ok = ok and worst < args.tol
        shown = text.replace("\n", "\\n")
        shown = shown if len(shown) <= 30 else shown[:27] + "..."
        print(f"{shown:<32} {len(tokens):>3} {k:>3} | {d['eager_vs_forward']:>12.2e} {d['graph_vs_forward']:>12.2e} "
              f"{d['eager_vs_kv']:>12.2e} {d['graph_vs_kv']:>12.2e} | {d['cpp_vs_fp64']:>11.2e} "
              f"{d['torch_vs_fp64']:>13.2e}")
    print(f"eager vs graph logits: max difference {max(r['eager_vs_graph'] for r in results):.1e} (bit-identical if 0)")
    print("PARITY PASS" if ok else "PARITY FAIL")
    if args.json:
        json.dump({"tolerance": args.tol, "pass": ok, "results": results}, open(args.json, "w"), indent=2)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
