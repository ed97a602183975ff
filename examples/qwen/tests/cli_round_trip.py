#!/usr/bin/env python3
"""`qwen --tokenize` then `qwen --detokenize` gives back the NFC form of the text (no GPU needed).

    python3 cli_round_trip.py QWEN TOKENIZER_JSON
"""
import subprocess
import sys
import unicodedata

TEXTS = ["Hello world", "h\u00e9llo w\u00f6rld e\u0301 \u4f60\u597d \U0001F600 \u0928\u092e\u0938\u094d\u0924\u0947",
         "<|im_start|>user\nHi<|im_end|>\n<think>\n\n</think>\n\n", "  tabs\tand\r\nnewlines\n\n x",
         "I'll   go, they'RE 123456"]


def run(*args):
    p = subprocess.run(list(args), capture_output=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(args[1:])}: exit {p.returncode}: {p.stderr.decode(errors='replace')}")
    out = p.stdout.decode()
    assert out.endswith("\n"), repr(out)
    return out[:-1]


def main():
    qwen, tok = sys.argv[1], sys.argv[2]
    for text in TEXTS:
        ids = run(qwen, "--tokenizer", tok, "--tokenize", text)
        back = run(qwen, "--tokenizer", tok, "--detokenize", ids)
        if back != unicodedata.normalize("NFC", text):
            sys.exit(f"round trip of {text!r} through {ids} gave {back!r}")
        print(f"{text!r} -> {ids} -> ok")


if __name__ == "__main__":
    main()
