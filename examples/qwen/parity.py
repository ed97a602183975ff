#!/usr/bin/env python3
"""Parity of the `qwen` example against Hugging Face transformers' Qwen3ForCausalLM.

For each test config: build Qwen3ForCausalLM with random weights (norm weights perturbed so they
matter), save it as bf16 safetensors (+ config.json), and load it back in float32 as the reference,
so both sides use the same bf16-rounded weights. Then:

1. Teacher forcing: the reference's greedy continuation is fed to both; the logits of every one of
   64 steps must agree to relative L2 error < 2e-2 (||ours - ref|| / ||ref||).
2. Greedy under teacher forcing: our argmax must equal the reference's wherever the reference's
   top-2 margin exceeds tol * max|ref logits| (smaller margins are within the error budget).
3. Free greedy generation (eager and graph, which must be identical): tokens equal the reference's
   until the first step whose reference margin is within tolerance (after it, sequences may diverge).

The prompt has 8 random tokens; with --long-prompt N it has N (prefilled in chunks of up to 2048
tokens by the tensor-core prefill attention) and only the LONG_CONFIGS run.

With --tp N every run of the binary is tensor parallel over N GPUs (`qwen --tp N`): the same
tolerances against the reference, and eager == graph at TP N. The test configs have 2 kv heads, so
--tp 2 runs them all; a config whose heads, intermediate size or vocabulary do not split over N is
skipped with a note.

Usage: python3 parity.py --bin build/examples/qwen/qwen [--tp N] [--long-prompt 4096] [--out results.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

TOL = 2e-2
STEPS = 64
PROMPT = 8

CONFIGS = {
    # small, tied embeddings, head_dim 64, 2 query heads per kv head, one safetensors file
    "tied_hd64": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                      rope_theta=10000.0, shard=None),
    # untied lm_head, head_dim 128, 4 query heads per kv head (as Qwen3-4B), sharded checkpoint
    "untied_hd128_sharded": dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                 tie_word_embeddings=False, rope_theta=1000000.0, shard="2MB"),
    # 5 query heads per kv head (as Qwen3-14B: 40 over 8), head_dim 128, untied
    "untied_hd128_g5": dict(vocab_size=4096, hidden_size=640, intermediate_size=1280, num_hidden_layers=3,
                            num_attention_heads=10, num_key_value_heads=2, head_dim=128,
                            tie_word_embeddings=False, rope_theta=1000000.0, shard=None),
}


# The configs of a --long-prompt run: head_dim 64 with 2 query heads per kv head, and head_dim 128 with 4.
LONG_CONFIGS = ["tied_hd64", "untied_hd128_sharded"]


def build(name, spec, root, seed, max_positions):
    spec = dict(spec)
    shard = spec.pop("shard")
    cfg = Qwen3Config(max_position_embeddings=max_positions, rms_norm_eps=1e-6, initializer_range=0.02, **spec)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    path = os.path.join(root, name)
    kw = {"max_shard_size": shard} if shard else {}
    try:
        model.save_pretrained(path, safe_serialization=True, **kw)
    except TypeError:  # transformers >= 5 always writes safetensors
        model.save_pretrained(path, **kw)
    try:
        ref = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    except TypeError:
        ref = Qwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ref = ref.eval()
    files = sorted(os.listdir(path))
    return path, ref, files


def run_bin(args):
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout, r.stderr, file=sys.stderr)
        raise SystemExit(f"{' '.join(args[:3])}... exited {r.returncode}")
    return r.stdout


def splits(spec, tp):
    """Whether qwen --tp `tp` accepts this config (check_tp_split in options.hpp)."""
    return all(spec[k] % tp == 0 for k in ("num_key_value_heads", "num_attention_heads", "intermediate_size",
                                           "vocab_size")) and (spec["intermediate_size"] // tp) % 8 == 0


def check(name, spec, binary, root, seed, prompt_len=PROMPT, tp=1):
    tp_args = ["--tp", str(tp)] if tp > 1 else []
    context = max(256, prompt_len + STEPS + 8)  # --max-context of our runs
    path, ref, files = build(name, spec, root, seed, max(1024, context))
    V = spec["vocab_size"]
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, V, (prompt_len,), generator=g).tolist()
    with torch.no_grad():
        gen = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS,
                           pad_token_id=0, eos_token_id=None)[0, prompt_len:].tolist()
        full = prompt + gen[: STEPS - 1]
        ref_logits = ref(torch.tensor([full])).logits[0, prompt_len - 1:].double().numpy()  # [STEPS, V]
    assert ref_logits.shape == (STEPS, V), ref_logits.shape

    dump = os.path.join(root, f"{name}.f32")
    out = run_bin([binary, "--model", path, "--prompt", ",".join(map(str, full)), "--teacher-force", str(prompt_len),
                   "--dump-logits", dump, "--mode", "both", "--max-context", str(context), "--kv-mem-mb", "64"]
                  + tp_args)
    ours = np.fromfile(dump, dtype=np.float32).reshape(STEPS, V).astype(np.float64)
    rel = np.linalg.norm(ours - ref_logits, axis=1) / np.linalg.norm(ref_logits, axis=1)

    top2 = np.sort(ref_logits, axis=1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]) / np.abs(ref_logits).max(axis=1)
    decisive = margin > TOL
    ours_arg = ours.argmax(axis=1)
    ref_arg = ref_logits.argmax(axis=1)
    greedy_bad = int(np.sum(decisive & (ours_arg != ref_arg)))

    # Free generation with our binary (eager and graph, checked identical by the binary itself).
    jpath = os.path.join(root, f"{name}.json")
    run_bin([binary, "--model", path, "--prompt", ",".join(map(str, prompt)), "--gen", str(STEPS), "--mode", "both",
             "--json", jpath, "--max-context", str(context), "--kv-mem-mb", "64", "--quiet"] + tp_args)
    res = json.load(open(jpath))
    free = res["graph"]["tokens"][0]
    free_ok = res.get("identical_tokens", False)
    first_diff = next((i for i in range(STEPS) if free[i] != gen[i]), None)
    # Step i's token is predicted from the logits of teacher-forced step i (same prefix up to i).
    free_bad = first_diff is not None and bool(decisive[first_diff])

    ok = rel.max() < TOL and greedy_bad == 0 and free_ok and not free_bad
    summary = {
        "config": name, "prompt": prompt_len, "tp": tp, "files": files, "max_rel_l2": float(rel.max()), "median_rel_l2": float(np.median(rel)),
        "steps": STEPS, "decisive_steps": int(decisive.sum()), "greedy_mismatch_on_decisive": greedy_bad,
        "teacher_forced_argmax_agree": int(np.sum(ours_arg == ref_arg)),
        "free_greedy_first_divergence": first_diff, "free_eager_graph_identical": free_ok,
        "device": res.get("device"), "pass": bool(ok),
    }
    print(f"[{name}] files={files}, prompt {prompt_len} tokens" + (f", tensor parallel over {tp} GPUs" if tp > 1 else ""))
    print(f"[{name}] teacher-forced rel L2: max {rel.max():.3e}, median {np.median(rel):.3e} over {STEPS} steps "
          f"(tol {TOL}); argmax agree {summary['teacher_forced_argmax_agree']}/{STEPS}, decisive steps "
          f"{int(decisive.sum())}, mismatches there {greedy_bad}")
    print(f"[{name}] free greedy vs reference: first divergence at step {first_diff} "
          f"({'margin within tolerance' if first_diff is not None and not free_bad else 'none' if first_diff is None else 'DECISIVE STEP'})"
          f"; eager == graph: {free_ok}; binary said: {out.strip().splitlines()[-2:]}")
    print(f"[{name}] {'PASS' if ok else 'FAIL'}")
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="prompt tokens (random) before the teacher-forced steps; runs only the LONG_CONFIGS")
    ap.add_argument("--tp", type=int, default=1, help="run the binary tensor parallel over N GPUs (qwen --tp N)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    import transformers
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    results = []
    with tempfile.TemporaryDirectory() as root:
        for i, (name, spec) in enumerate(CONFIGS.items()):
            if not splits(spec, a.tp):
                print(f"[{name}] skipped: does not split over --tp {a.tp}")
                continue
            if a.long_prompt > 0 and name in LONG_CONFIGS:
                results.append(check(name, spec, a.bin, root, a.seed + 10 * i, prompt_len=a.long_prompt, tp=a.tp))
            elif a.long_prompt == 0:
                results.append(check(name, spec, a.bin, root, a.seed + 10 * i, tp=a.tp))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    ok = bool(results) and all(r["pass"] for r in results)
    print("PARITY", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
