#!/usr/bin/env python3
"""The hostile-input corpus of the nanogpt and qwen command lines.

Every case is one command line (with the files it needs) and what the program must do with it: exit
with a given code and print a given message fragment, before any GPU work. Control cases are valid
input: they must get past every check (exit 0, or the program's "no CUDA device" exit where there is
none).

    corpus.py names                  the case names, one a line (CMake registers one CTest per name)
    corpus.py pending                the cases kept disabled for now (pending=True, qwen flags)
    corpus.py build DIR              writes every case's files under DIR and DIR/manifest.json

run_case.py runs one case of DIR/manifest.json.

A case fails when the exit code or the message differs, when it runs past the timeout (a hang), or
when the output carries a sanitizer report. Standard library only (python3 in CI).
"""
import json
import os
import struct
import subprocess
import sys

# ---------------------------------------------------------------------------------------------
# Exit codes and messages of the two programs
# ---------------------------------------------------------------------------------------------
NANOGPT_ERROR = 1          # std::exception caught in main: "nanogpt: error: ..."
NANOGPT_NO_DEVICE = 2      # valid input, no CUDA device (run_case.py)
QWEN_INPUT_ERROR = 2       # qwen::input_error / safetensors_error: "error: ..."
QWEN_NO_DEVICE = 3         # valid input, no CUDA device (run_case.py)
CLI_CONVERSION = 104       # CLI11: a value of the wrong type ("Could not convert")
CLI_VALIDATION = 105       # CLI11: a value outside its check (range, member of a set)
CLI_EXTRAS = 109           # CLI11: unknown flags or positional arguments
CLI_ARG_MISMATCH = 114     # CLI11: an option without its value
OK = "ok"                  # control: exit 0 or the no-device exit


# ---------------------------------------------------------------------------------------------
# File writers
# ---------------------------------------------------------------------------------------------
DTYPE_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1}


def safetensors_bytes(tensors, metadata=None, pad=True):
    """tensors: list of (name, dtype, shape, data bytes). Like the Python package: header padded to 8."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, dt, shape, data in tensors:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


def raw_safetensors(header, data=b"", length=None):
    """A file with `header` (bytes or str) taken as is and an optional wrong length field."""
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def nested(depth, open_="[", close="]", inner="0"):
    return open_ * depth + inner + close * depth


def nested_objects(depth):
    return '{"a":' * depth + "0" + "}" * depth


# ---------------------------------------------------------------------------------------------
# nanogpt: the seed's parameters (examples/nanogpt/weights.hpp)
# ---------------------------------------------------------------------------------------------
def nanogpt_specs():
    v, e, t, f, layers = 65, 32, 64, 128, 4
    specs = [("token_embedding_table.weight", [v, e]), ("position_embedding_table.weight", [t, e])]
    for l in range(layers):
        p = "blocks.%d." % l
        specs += [(p + "ln1.weight", [e]), (p + "ln1.bias", [e]), (p + "sa.qkv.weight", [3 * e, e]),
                  (p + "sa.attn_proj.weight", [e, e]), (p + "sa.attn_proj.bias", [e]),
                  (p + "ln2.weight", [e]), (p + "ln2.bias", [e]), (p + "ffwd.net.0.weight", [f, e]),
                  (p + "ffwd.net.0.bias", [f]), (p + "ffwd.net.2.weight", [e, f]), (p + "ffwd.net.2.bias", [e])]
    specs += [("ln_f.weight", [e]), ("ln_f.bias", [e]), ("lm_head.weight", [v, e]), ("lm_head.bias", [v])]
    return specs


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def nanogpt_tensors(alter=None):
    """The parameters as (name, dtype, shape, bytes); alter(name, shape) -> None to drop, or a tuple."""
    out = []
    for i, (name, shape) in enumerate(nanogpt_specs()):
        n = numel(shape)
        values = [1.0] * n if name.endswith(".weight") and ("ln" in name) else \
            [((k * 7 + i) % 13 - 6) * 0.01 for k in range(n)]
        t = (name, "F32", shape, f32(values))
        if alter is not None:
            t = alter(t)
            if t is None:
                continue
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------
# qwen: a small valid Hugging Face checkpoint (config.json + BF16 weights)
# ---------------------------------------------------------------------------------------------
QWEN_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "attention_bias": False,
}
QWEN_LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight"]


def qwen_tensors(cfg=QWEN_CONFIG, alter=None, extra=()):
    h, i, d, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"input_layernorm.weight": [h], "post_attention_layernorm.weight": [h],
              "self_attn.q_proj.weight": [q, h], "self_attn.k_proj.weight": [kv, h],
              "self_attn.v_proj.weight": [kv, h], "self_attn.o_proj.weight": [h, q],
              "self_attn.q_norm.weight": [d], "self_attn.k_norm.weight": [d],
              "mlp.gate_proj.weight": [i, h], "mlp.up_proj.weight": [i, h], "mlp.down_proj.weight": [h, i]}
    specs = [("model.embed_tokens.weight", [v, h]), ("model.norm.weight", [h])]
    for l in range(cfg["num_hidden_layers"]):
        specs += [("model.layers.%d.%s" % (l, s), shapes[s]) for s in QWEN_LAYER]
    one = b"\x80\x3f"  # bf16 1.0
    out = []
    for name, shape in specs:
        t = (name, "BF16", shape, one * numel(shape))
        if alter is not None:
            t = alter(t)
            if t is None:
                continue
        out.append(t)
    for name, dt, shape in extra:
        out.append((name, dt, shape, b"\0" * (numel(shape) * DTYPE_SIZE[dt])))
    return out


def qwen_dir(d, config=None, weights=None):
    """A model directory: config.json (dict or text) and model.safetensors (bytes), defaults valid."""
    os.makedirs(d, exist_ok=True)
    cfg = QWEN_CONFIG if config is None else config
    write(os.path.join(d, "config.json"), cfg if isinstance(cfg, (str, bytes)) else json.dumps(cfg, indent=1))
    if weights is not False:
        write(os.path.join(d, "model.safetensors"), safetensors_bytes(qwen_tensors()) if weights is None else weights)


def cfg_with(**changes):
    c = dict(QWEN_CONFIG)
    for k, v in changes.items():
        if v is DROP:
            c.pop(k, None)
        else:
            c[k] = v
    return c


DROP = object()


def cfg_text_with(key, raw):
    """config.json text with `key`'s value replaced by the raw JSON text `raw`."""
    c = dict(QWEN_CONFIG)
    c[key] = "@@RAW@@"
    return json.dumps(c).replace('"@@RAW@@"', raw)


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
CASES = []


def case(name, prog, args, rc, msg, setup=None):
    """args: list of strings; '{d}' stands for the case's own directory. setup(d) makes its files."""
    CASES.append({"name": name, "prog": prog, "args": args, "rc": rc, "msg": msg, "setup": setup})


def files(mapping):
    """setup that writes {relative path: bytes or str}."""
    def setup(d):
        for rel, data in mapping.items():
            write(os.path.join(d, rel), data)
    return setup


def compose(*setups):
    def setup(d):
        for s in setups:
            s(d)
    return setup


def symlink(target, rel):
    def setup(d):
        os.makedirs(os.path.dirname(os.path.join(d, rel)) or d, exist_ok=True)
        os.symlink(target.replace("{d}", d), os.path.join(d, rel))
    return setup


def fifo(rel):
    def setup(d):
        os.makedirs(os.path.dirname(os.path.join(d, rel)) or d, exist_ok=True)
        os.mkfifo(os.path.join(d, rel))
    return setup


def mkdir(rel):
    return lambda d: os.makedirs(os.path.join(d, rel), exist_ok=True)


def sparse(rel, size):
    def setup(d):
        write(os.path.join(d, rel), b"")
        os.truncate(os.path.join(d, rel), size)
    return setup


# ---- safetensors files: each one goes through nanogpt --weights FILE and qwen --model DIR -------
# (name, setup writing "w.safetensors" for nanogpt, message). For qwen the same bytes become
# DIR/model.safetensors next to a valid config.json; the header checks come before any tensor check,
# so both programs must give the same message.
FILE_CASES = []


def file_case(name, data, msg, both=True):
    FILE_CASES.append((name, data, msg, both))


good_nano = nanogpt_tensors()
file_case("empty_file", b"", "truncated")
file_case("seven_bytes", b"\x08\0\0\0\0\0\0", "truncated")
file_case("header_length_2e63", struct.pack("<Q", 1 << 63) + b"{}", "implausible")
file_case("header_length_max", b"\xff" * 8 + b"{}", "implausible")
file_case("header_length_past_end", raw_safetensors("{}", length=1000), "truncated")
file_case("header_length_zero", raw_safetensors("", length=0), "not valid JSON")
file_case("header_not_json", raw_safetensors("hello"), "not valid JSON")
file_case("header_truncated_json", raw_safetensors('{"a": {"dtype": "F32"'), "not valid JSON")
file_case("header_array", raw_safetensors("[]"), "not an object")
file_case("header_string", raw_safetensors('"x"'), "not an object")
file_case("header_number", raw_safetensors("12"), "not an object")
file_case("header_null", raw_safetensors("null"), "not an object")
file_case("header_trailing_garbage", raw_safetensors("{} x"), "not valid JSON")
file_case("header_two_documents", raw_safetensors("{}{}"), "not valid JSON")
file_case("header_nul_byte", raw_safetensors(b'{"a\0": 1}'), "not valid JSON")
file_case("header_bad_utf8", raw_safetensors(b'{"\xff\xfe": 1}'), "not valid JSON")
file_case("header_overlong_utf8", raw_safetensors(b'{"\xc0\xaf": 1}'), "not valid JSON")
file_case("header_lone_surrogate", raw_safetensors('{"\\ud800": 1}'), "not valid JSON")
file_case("header_single_quotes", raw_safetensors("{'a': 1}"), "not valid JSON")
file_case("header_comment", raw_safetensors('{/* c */}'), "not valid JSON")
file_case("header_trailing_comma", raw_safetensors('{"__metadata__": {},}'), "not valid JSON")
file_case("metadata_deep_arrays", raw_safetensors('{"__metadata__": {"k": %s}}' % nested(100000)),
          "nested more than 64 levels")
file_case("metadata_deep_objects", raw_safetensors('{"__metadata__": %s}' % nested_objects(100000)),
          "nested more than 64 levels")
file_case("header_deep_arrays_top", raw_safetensors(nested(200000)), "nested more than 64 levels")
file_case("metadata_65_levels", raw_safetensors('{"__metadata__": {"k": %s}}' % nested(63)), "nested more than 64")
file_case("shape_deep", raw_safetensors('{"a": {"dtype": "F32", "shape": %s, "data_offsets": [0, 4]}}' % nested(5000)),
          "nested more than 64")
file_case("metadata_not_object", raw_safetensors('{"__metadata__": [1, 2]}'), "__metadata__ is not an object")
file_case("metadata_number_overflow", raw_safetensors('{"__metadata__": {"k": 1e309}}'), "1e309 is out of range")
file_case("metadata_negative_overflow", raw_safetensors('{"__metadata__": {"k": -1e999}}'), "out of range")
file_case("shape_number_overflow", raw_safetensors('{"a": {"dtype": "F32", "shape": [1e309], "data_offsets": [0, 4]}}'),
          "out of range")
file_case("offsets_number_overflow", raw_safetensors('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4e400]}}'),
          "out of range")
file_case("duplicate_tensor", raw_safetensors(
    '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
    '"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8), "key \"a\" appears twice")
file_case("duplicate_dtype_field", raw_safetensors(
    '{"a": {"dtype": "F32", "dtype": "F64", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4), "appears twice")
file_case("duplicate_metadata", raw_safetensors('{"__metadata__": {"k": "1"}, "__metadata__": {"k": "2"}}'),
          "appears twice")
file_case("duplicate_metadata_key", raw_safetensors('{"__metadata__": {"k": "1", "k": "2"}}'), "appears twice")
file_case("shape_element_count_wraps", raw_safetensors(
    '{"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}}'), "overflows")
file_case("shape_byte_size_wraps", raw_safetensors(
    '{"a": {"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]}}'), "overflows")
file_case("shape_wraps_to_four", raw_safetensors(
    '{"a": {"dtype": "U8", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 0]}}'), "overflows")
file_case("shape_int64_max", raw_safetensors(
    '{"a": {"dtype": "U8", "shape": [9223372036854775807, 2], "data_offsets": [0, 0]}}'), "overflows")
file_case("shape_u64_max", raw_safetensors(
    '{"a": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 0]}}'), "not a non-negative integer")
file_case("shape_negative", raw_safetensors('{"a": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 0]}}'),
          "not a non-negative integer")
file_case("shape_fraction", raw_safetensors('{"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 10]}}'),
          "not a non-negative integer")
file_case("shape_string", raw_safetensors('{"a": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}'),
          "not a non-negative integer")
file_case("shape_bool", raw_safetensors('{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}'),
          "not a non-negative integer")
file_case("shape_not_array", raw_safetensors('{"a": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}}'),
          "non-array \"shape\"")
file_case("shape_missing", raw_safetensors('{"a": {"dtype": "F32", "data_offsets": [0, 4]}}'), "\"shape\"")
file_case("dtype_missing", raw_safetensors('{"a": {"shape": [1], "data_offsets": [0, 4]}}'), "\"dtype\"")
file_case("dtype_number", raw_safetensors('{"a": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}}'), "\"dtype\"")
file_case("dtype_unknown", raw_safetensors('{"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}'),
          "unknown dtype \"F128\"")
file_case("dtype_lowercase", raw_safetensors('{"a": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}}'),
          "unknown dtype \"f32\"")
file_case("dtype_empty", raw_safetensors('{"a": {"dtype": "", "shape": [1], "data_offsets": [0, 4]}}'), "unknown dtype")
file_case("offsets_missing", raw_safetensors('{"a": {"dtype": "F32", "shape": [1]}}'), "data_offsets")
file_case("offsets_three", raw_safetensors('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}'),
          "data_offsets")
file_case("offsets_object", raw_safetensors('{"a": {"dtype": "F32", "shape": [1], "data_offsets": {"b": 0}}}'),
          "data_offsets")
file_case("offsets_negative", raw_safetensors('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}'),
          "not non-negative integers")
file_case("offsets_fraction", raw_safetensors('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0.5, 4.5]}}'),
          "not non-negative integers")
file_case("offsets_reversed", raw_safetensors('{"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}', b"\0" * 8),
          "begin after end")
file_case("offsets_past_end", raw_safetensors('{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', b"\0" * 8),
          "truncated")
file_case("offsets_u64_max", raw_safetensors(
    '{"a": {"dtype": "U8", "shape": [1], "data_offsets": [18446744073709551614, 18446744073709551615]}}'), "truncated")
file_case("offsets_wrong_size", raw_safetensors('{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', b"\0" * 8),
          "needs 8 bytes")
file_case("tensors_overlap", raw_safetensors(
    '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
    '"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}', b"\0" * 12), "overlap")
file_case("tensors_same_bytes", raw_safetensors(
    '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
    '"b": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}', b"\0" * 8), "overlap")
file_case("entry_not_object", raw_safetensors('{"a": [1, 2]}'), "entry is not an object")
file_case("entry_string", raw_safetensors('{"a": "F32"}'), "entry is not an object")
file_case("entry_unknown_field", raw_safetensors(
    '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}}', b"\0" * 4), "unknown field \"extra\"")
file_case("tensor_name_empty", raw_safetensors('{"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', b"\0" * 4),
          "the tensor name is empty")
file_case("huge_header_within_limit_but_past_end", raw_safetensors("{}", length=99999999), "truncated")

# nanogpt-only: the model's own checks (shapes, dtypes, missing tensors, values, alignment).
NANO_ONLY = []
NANO_ONLY.append(("missing_tensor", safetensors_bytes(nanogpt_tensors(lambda t: None if t[0] == "ln_f.bias" else t)),
                  "missing tensor ln_f.bias"))
NANO_ONLY.append(("missing_all", safetensors_bytes([("x", "F32", [1], f32([0.0]))]), "50 of 50 parameters missing"))
NANO_ONLY.append(("wrong_shape", safetensors_bytes(nanogpt_tensors(
    lambda t: (t[0], "F32", [65, 16], t[3][: 65 * 16 * 4]) if t[0] == "lm_head.weight" else t)),
    "expected shape [65, 32] dtype F32, file has [65, 16] F32"))
NANO_ONLY.append(("transposed", safetensors_bytes(nanogpt_tensors(
    lambda t: (t[0], "F32", [32, 128], t[3]) if t[0] == "blocks.0.ffwd.net.0.weight" else t)),
    "expected shape [128, 32]"))
NANO_ONLY.append(("wrong_dtype_f64", safetensors_bytes(nanogpt_tensors(
    lambda t: (t[0], "F64", t[2], t[3] * 2) if t[0] == "ln_f.weight" else t)), "dtype F32, file has [32] F64"))
NANO_ONLY.append(("wrong_dtype_bf16", safetensors_bytes(nanogpt_tensors(
    lambda t: (t[0], "BF16", t[2], t[3][: len(t[3]) // 2]) if t[0] == "lm_head.bias" else t)), "file has [65] BF16"))
NANO_ONLY.append(("scalar_for_vector", safetensors_bytes(nanogpt_tensors(
    lambda t: (t[0], "F32", [], t[3][:4]) if t[0] == "ln_f.bias" else t)), "file has [] F32"))
NANO_ONLY.append(("nan_weight", safetensors_bytes(nanogpt_tensors(
    lambda t: (t[0], t[1], t[2], f32([float("nan")]) + t[3][4:]) if t[0] == "lm_head.bias" else t)), "NaN or infinity"))
NANO_ONLY.append(("inf_weight", safetensors_bytes(nanogpt_tensors(
    lambda t: (t[0], t[1], t[2], f32([float("inf")]) + t[3][4:]) if t[0] == "ln_f.weight" else t)), "NaN or infinity"))


def misaligned_nanogpt():
    """The valid parameters with a header one byte longer than a multiple of 4: floats misaligned."""
    header = {}
    offset = 0
    for name, dt, shape, data in good_nano:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((-len(text) % 8) + 1)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in good_nano)


NANO_ONLY.append(("misaligned", misaligned_nanogpt(), "not 4-byte aligned"))
NANO_ONLY.append(("qwen_checkpoint", safetensors_bytes(qwen_tensors()), "50 of 50 parameters missing"))

for name, data, msg, both in FILE_CASES:
    case("nanogpt_file_" + name, "nanogpt", ["--weights", "{d}/w.safetensors"], NANOGPT_ERROR, msg,
         files({"w.safetensors": data}))
    if both:
        case("qwen_file_" + name, "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, msg,
             lambda d, data=data: qwen_dir(os.path.join(d, "m"), weights=data))
for name, data, msg in NANO_ONLY:
    case("nanogpt_weights_" + name, "nanogpt", ["--weights", "{d}/w.safetensors"], NANOGPT_ERROR, msg,
         files({"w.safetensors": data}))

# ---- paths that are not regular files, for both programs ----------------------------------------
VALID_NANO = safetensors_bytes(good_nano, metadata={"format": "pt"})
for prog, flag in (("nanogpt", "--weights"),):
    case("nanogpt_path_missing", prog, [flag, "{d}/absent.safetensors"], NANOGPT_ERROR, "no such file")
    case("nanogpt_path_fifo", prog, [flag, "{d}/pipe"], NANOGPT_ERROR, "FIFO", fifo("pipe"))
    case("nanogpt_path_dev_null", prog, [flag, "/dev/null"], NANOGPT_ERROR, "character device")
    case("nanogpt_path_dev_zero", prog, [flag, "/dev/zero"], NANOGPT_ERROR, "character device")
    case("nanogpt_path_dev_stdin", prog, [flag, "/dev/stdin"], NANOGPT_ERROR, "/dev/stdin")
    case("nanogpt_path_proc_dir", prog, [flag, "/proc/self"], NANOGPT_ERROR, "neither")
    case("nanogpt_path_symlink_loop", prog, [flag, "{d}/a"], NANOGPT_ERROR, "symbolic link loop",
         compose(symlink("{d}/b", "a"), symlink("{d}/a", "b")))
    case("nanogpt_path_self_loop", prog, [flag, "{d}/a"], NANOGPT_ERROR, "symbolic link loop", symlink("{d}/a", "a"))
    case("nanogpt_path_dangling", prog, [flag, "{d}/a"], NANOGPT_ERROR, "no such file", symlink("{d}/nowhere", "a"))
    case("nanogpt_path_symlink_to_fifo", prog, [flag, "{d}/a"], NANOGPT_ERROR, "FIFO",
         compose(fifo("pipe"), symlink("{d}/pipe", "a")))
    case("nanogpt_path_through_file", prog, [flag, "{d}/f/w.safetensors"], NANOGPT_ERROR, "not a directory",
         files({"f": "x"}))
    case("nanogpt_path_empty_dir", prog, [flag, "{d}/dir"], NANOGPT_ERROR, "neither", mkdir("dir"))
    case("nanogpt_path_too_long", prog, [flag, "{d}/" + "x" * 5000], NANOGPT_ERROR, "too long")
    case("nanogpt_weights_empty_path", prog, [flag, ""], NANOGPT_ERROR, "--weights: the path is empty")

# A model directory (nanogpt --weights DIR): model.safetensors or an index with shards.
SHARD_A = [t for t in good_nano if not t[0].startswith("blocks.")]
SHARD_B = [t for t in good_nano if t[0].startswith("blocks.")]
GOOD_INDEX = {"metadata": {"total_size": 0},
              "weight_map": dict([(t[0], "a.safetensors") for t in SHARD_A] + [(t[0], "b.safetensors") for t in SHARD_B])}


def sharded(index=None, a=None, b=None, extra=None):
    """A sharded nanogpt directory under {d}/m: index (dict or text), shards a and b (bytes)."""
    def setup(d):
        m = os.path.join(d, "m")
        os.makedirs(m, exist_ok=True)
        idx = GOOD_INDEX if index is None else index
        if idx is not False:
            write(os.path.join(m, "model.safetensors.index.json"), idx if isinstance(idx, (str, bytes)) else json.dumps(idx))
        if a is not False:
            write(os.path.join(m, "a.safetensors"), safetensors_bytes(SHARD_A) if a is None else a)
        if b is not False:
            write(os.path.join(m, "b.safetensors"), safetensors_bytes(SHARD_B) if b is None else b)
        if extra:
            extra(d)
    return setup


def index_with(**shard_of):
    """GOOD_INDEX with some tensors moved: {tensor: shard name or DROP}."""
    wm = dict(GOOD_INDEX["weight_map"])
    for k, v in shard_of.items():
        k = k.replace("__", ".")
        if v is DROP:
            wm.pop(k, None)
        else:
            wm[k] = v
    return {"metadata": GOOD_INDEX["metadata"], "weight_map": wm}


def nano_dir_case(name, rc, msg, setup):
    case("nanogpt_dir_" + name, "nanogpt", ["--weights", "{d}/m"], rc, msg, setup)


nano_dir_case("single_fifo", NANOGPT_ERROR, "FIFO", compose(mkdir("m"), fifo("m/model.safetensors")))
nano_dir_case("single_directory", NANOGPT_ERROR, "a directory", mkdir("m/model.safetensors"))
nano_dir_case("single_loop", NANOGPT_ERROR, "symbolic link loop",
              compose(mkdir("m"), symlink("{d}/m/model.safetensors", "m/model.safetensors")))
nano_dir_case("single_outside", NANOGPT_ERROR, "outside the directory",
              compose(files({"elsewhere.safetensors": VALID_NANO}), mkdir("m"),
                      symlink("{d}/elsewhere.safetensors", "m/model.safetensors")))
nano_dir_case("single_dev_null", NANOGPT_ERROR, "outside the directory",
              compose(mkdir("m"), symlink("/dev/null", "m/model.safetensors")))
nano_dir_case("single_dangling", NANOGPT_ERROR, "no such file",
              compose(mkdir("m"), symlink("{d}/m/none", "m/model.safetensors")))
nano_dir_case("index_not_json", NANOGPT_ERROR, "not valid JSON", sharded(index="{"))
nano_dir_case("index_empty", NANOGPT_ERROR, "not valid JSON", sharded(index=""))
nano_dir_case("index_deep", NANOGPT_ERROR, "nested more than 64 levels",
              sharded(index='{"metadata": {"x": %s}, "weight_map": {}}' % nested(100000)))
nano_dir_case("index_deep_objects", NANOGPT_ERROR, "nested more than 64 levels", sharded(index=nested_objects(100000)))
nano_dir_case("index_duplicate_tensor", NANOGPT_ERROR, "appears twice",
              sharded(index='{"weight_map": {"ln_f.bias": "a.safetensors", "ln_f.bias": "b.safetensors"}}'))
nano_dir_case("index_duplicate_weight_map", NANOGPT_ERROR, "appears twice",
              sharded(index='{"weight_map": {}, "weight_map": {}}'))
nano_dir_case("index_number_overflow", NANOGPT_ERROR, "out of range",
              sharded(index='{"metadata": {"total_size": 1e309}, "weight_map": {}}'))
nano_dir_case("index_no_weight_map", NANOGPT_ERROR, "no \"weight_map\"", sharded(index={"metadata": {}}))
nano_dir_case("index_weight_map_array", NANOGPT_ERROR, "no \"weight_map\"", sharded(index={"weight_map": []}))
nano_dir_case("index_array", NANOGPT_ERROR, "no \"weight_map\"", sharded(index="[]"))
nano_dir_case("index_weight_map_empty", NANOGPT_ERROR, "weight_map is empty", sharded(index={"weight_map": {}}))
nano_dir_case("index_shard_number", NANOGPT_ERROR, "is not a file name", sharded(index=index_with(ln_f__bias=3)))
nano_dir_case("index_shard_null", NANOGPT_ERROR, "is not a file name", sharded(index=index_with(ln_f__bias=None)))
nano_dir_case("index_shard_slash", NANOGPT_ERROR, "not a plain file name",
              sharded(index=index_with(ln_f__bias="sub/a.safetensors")))
nano_dir_case("index_shard_dotdot", NANOGPT_ERROR, "not a plain file name", sharded(index=index_with(ln_f__bias="..")))
nano_dir_case("index_shard_dot", NANOGPT_ERROR, "not a plain file name", sharded(index=index_with(ln_f__bias=".")))
nano_dir_case("index_shard_empty_name", NANOGPT_ERROR, "not a plain file name", sharded(index=index_with(ln_f__bias="")))
nano_dir_case("index_shard_absolute", NANOGPT_ERROR, "not a plain file name",
              sharded(index=index_with(ln_f__bias="/etc/passwd")))
nano_dir_case("index_shard_parent", NANOGPT_ERROR, "not a plain file name",
              sharded(index=index_with(ln_f__bias="../m/a.safetensors")))
nano_dir_case("index_shard_missing", NANOGPT_ERROR, "does not exist",
              sharded(index=index_with(ln_f__bias="c.safetensors")))
nano_dir_case("index_shard_fifo", NANOGPT_ERROR, "FIFO",
              sharded(index=index_with(ln_f__bias="c.safetensors"), extra=fifo("m/c.safetensors")))
nano_dir_case("index_shard_directory", NANOGPT_ERROR, "a directory",
              sharded(index=index_with(ln_f__bias="c.safetensors"), extra=mkdir("m/c.safetensors")))
nano_dir_case("index_shard_loop", NANOGPT_ERROR, "symbolic link loop",
              sharded(index=index_with(ln_f__bias="c.safetensors"),
                      extra=symlink("{d}/m/c.safetensors", "m/c.safetensors")))
nano_dir_case("index_shard_outside", NANOGPT_ERROR, "outside the directory",
              sharded(b=False, extra=compose(files({"b.safetensors": safetensors_bytes(SHARD_B)}),
                                             symlink("{d}/b.safetensors", "m/b.safetensors"))))
nano_dir_case("index_shard_outside_relative", NANOGPT_ERROR, "outside the directory",
              sharded(b=False, extra=compose(files({"b.safetensors": safetensors_bytes(SHARD_B)}),
                                             symlink("../b.safetensors", "m/b.safetensors"))))
nano_dir_case("index_shard_to_dev_zero", NANOGPT_ERROR, "outside the directory",
              sharded(b=False, extra=symlink("/dev/zero", "m/b.safetensors")))
nano_dir_case("index_unlisted_tensor", NANOGPT_ERROR, "does not list",
              sharded(index=index_with(ln_f__bias=DROP)))
nano_dir_case("index_stowaway_tensor", NANOGPT_ERROR, "does not list",
              sharded(a=safetensors_bytes(SHARD_A + [("stowaway", "F32", [1], f32([1.0]))])))
nano_dir_case("index_wrong_shard", NANOGPT_ERROR, "does not list",
              sharded(index=index_with(ln_f__bias="b.safetensors")))
nano_dir_case("index_tensor_in_two_shards", NANOGPT_ERROR, "does not list",
              sharded(b=safetensors_bytes(SHARD_B + [SHARD_A[-1]])))
nano_dir_case("index_listed_not_held", NANOGPT_ERROR, "does not hold it",
              sharded(index=index_with(ghost="a.safetensors")))
nano_dir_case("index_fifo", NANOGPT_ERROR, "FIFO", sharded(index=False, extra=fifo("m/model.safetensors.index.json")))
nano_dir_case("index_directory", NANOGPT_ERROR, "a directory",
              sharded(index=False, extra=mkdir("m/model.safetensors.index.json")))
nano_dir_case("index_outside", NANOGPT_ERROR, "outside the directory",
              sharded(index=False, extra=compose(files({"i.json": json.dumps(GOOD_INDEX)}),
                                                 symlink("{d}/i.json", "m/model.safetensors.index.json"))))
nano_dir_case("index_too_large", NANOGPT_ERROR, "larger than",
              sharded(index=False, extra=sparse("m/model.safetensors.index.json", 100 << 20)))
nano_dir_case("index_shard_truncated", NANOGPT_ERROR, "truncated",
              sharded(b=safetensors_bytes(SHARD_B)[:-100]))
nano_dir_case("index_shard_deep", NANOGPT_ERROR, "nested more than 64",
              sharded(b=raw_safetensors('{"__metadata__": {"k": %s}}' % nested(100000))))

# ---- nanogpt command-line flags ----------------------------------------------------------------
def nano(name, args, rc, msg):
    case("nanogpt_cli_" + name, "nanogpt", args, rc, msg)


R = ["--random-init"]
nano("seed_negative", ["--seed", "-1"] + R, CLI_VALIDATION, "--seed")
nano("seed_text", ["--seed", "abc"] + R, CLI_VALIDATION, "--seed")
nano("seed_overflow", ["--seed", "18446744073709551616"] + R, CLI_VALIDATION, "--seed")
nano("seed_fraction", ["--seed", "1.5"] + R, CLI_VALIDATION, "--seed")
nano("seed_plus", ["--seed", "+5"] + R, CLI_VALIDATION, "--seed")
nano("seed_hex", ["--seed", "0x10"] + R, CLI_VALIDATION, "--seed")
nano("seed_space", ["--seed", " 5"] + R, CLI_VALIDATION, "--seed")
nano("seed_missing_value", ["--seed"], CLI_ARG_MISMATCH, "--seed")
nano("init_seed_negative", ["--init-seed", "-3"] + R, CLI_VALIDATION, "--init-seed")
nano("tokens_negative", ["--tokens", "-1"] + R, NANOGPT_ERROR, "--tokens must be at least 1")
nano("tokens_zero", ["--tokens", "0"] + R, NANOGPT_ERROR, "--tokens must be at least 1")
nano("tokens_int_overflow", ["--tokens", "99999999999"] + R, CLI_CONVERSION, "--tokens")
nano("tokens_huge", ["--tokens", "2147483647"] + R, NANOGPT_ERROR, "past the context of 64")
nano("tokens_min_int", ["--tokens", "-2147483648"] + R, NANOGPT_ERROR, "--tokens must be at least 1")
nano("tokens_text", ["--tokens", "ten"] + R, CLI_CONVERSION, "--tokens")
nano("tokens_fraction", ["--tokens", "1.5"] + R, CLI_CONVERSION, "--tokens")
nano("tokens_past_context", ["--prompt", "ROMEO:", "--tokens", "59"] + R, NANOGPT_ERROR, "at most 58 new tokens fit")
nano("temperature_nan", ["--temperature", "nan"] + R, NANOGPT_ERROR, "temperature must be a positive number")
nano("temperature_inf", ["--temperature", "inf"] + R, NANOGPT_ERROR, "temperature must be a positive number")
nano("temperature_neg_inf", ["--temperature", "-inf"] + R, NANOGPT_ERROR, "temperature must be a positive number")
nano("temperature_negative", ["--temperature", "-0.5"] + R, NANOGPT_ERROR, "temperature must be a positive number")
nano("temperature_zero", ["--temperature", "0"] + R, NANOGPT_ERROR, "temperature must be a positive number")
nano("temperature_float_overflow", ["--temperature", "1e39"] + R, NANOGPT_ERROR, "temperature must be a positive number")
nano("temperature_denormal_zero", ["--temperature", "1e-50"] + R, NANOGPT_ERROR, "temperature must be a positive number")
nano("temperature_text", ["--temperature", "warm"] + R, CLI_CONVERSION, "--temperature")
nano("prompt_empty", ["--prompt", ""] + R, NANOGPT_ERROR, "the prompt is empty")
nano("prompt_too_long", ["--prompt", "a" * 65] + R, NANOGPT_ERROR, "the prompt has 65 tokens")
nano("prompt_very_long", ["--prompt", "a" * 100000] + R, NANOGPT_ERROR, "the prompt has 100000 tokens")
nano("prompt_digits", ["--prompt", "abc123"] + R, NANOGPT_ERROR, "outside the model's 65-character vocabulary")
nano("prompt_tab", ["--prompt", "a\tb"] + R, NANOGPT_ERROR, "'\\t' (U+0009)")
nano("prompt_unicode", ["--prompt", "caf\u00e9"] + R, NANOGPT_ERROR, "U+00E9")
nano("prompt_emoji", ["--prompt", "hi \U0001F600"] + R, NANOGPT_ERROR, "U+1F600")
nano("prompt_invalid_utf8", ["--prompt", b"a\xffb"] + R, NANOGPT_ERROR, "U+00FF")
nano("prompt_truncated_utf8", ["--prompt", b"ab\xe2\x82"] + R, NANOGPT_ERROR, "outside the model's")
nano("prompt_control", ["--prompt", "a\x01b"] + R, NANOGPT_ERROR, "U+0001")
nano("prompt_carriage_return", ["--prompt", "a\r\nb"] + R, NANOGPT_ERROR, "'\\r' (U+000D)")
nano("prefill_len_negative", ["--parity-dump", "{d}/out.json", "--prefill-len", "-1", "--prompt", "ROMEO"] + R,
     NANOGPT_ERROR, "--prefill-len -1 must be in 1..5")
nano("prefill_len_zero", ["--parity-dump", "{d}/out.json", "--prefill-len", "0", "--prompt", "ROMEO"] + R,
     NANOGPT_ERROR, "--prefill-len 0 must be in 1..5")
nano("prefill_len_past_prompt", ["--parity-dump", "{d}/out.json", "--prefill-len", "6", "--prompt", "ROMEO"] + R,
     NANOGPT_ERROR, "--prefill-len 6 must be in 1..5")
nano("prefill_len_huge", ["--parity-dump", "{d}/out.json", "--prefill-len", "2147483647"] + R,
     NANOGPT_ERROR, "--prefill-len 2147483647 must be in")
nano("prefill_len_overflow", ["--prefill-len", "4294967296"] + R, CLI_CONVERSION, "--prefill-len")
nano("prefill_len_without_dump", ["--prefill-len", "3"] + R, NANOGPT_ERROR, "--prefill-len is used only with --parity-dump")
nano("parity_empty_prompt", ["--parity-dump", "{d}/out.json", "--prompt", ""] + R, NANOGPT_ERROR, "the prompt is empty")
nano("parity_long_prompt", ["--parity-dump", "{d}/out.json", "--prompt", "a" * 70] + R, NANOGPT_ERROR,
     "the prompt has 70 tokens")
nano("parity_empty_path", ["--parity-dump", ""] + R, NANOGPT_ERROR, "--parity-dump: the path is empty")
case("nanogpt_cli_parity_to_directory", "nanogpt", ["--parity-dump", "{d}"] + R, NANOGPT_ERROR,
     "exists and is not a regular file", mkdir(""))
case("nanogpt_cli_parity_to_fifo", "nanogpt", ["--parity-dump", "{d}/pipe"] + R, NANOGPT_ERROR,
     "exists and is not a regular file", fifo("pipe"))
nano("parity_to_dev_null", ["--parity-dump", "/dev/null"] + R, NANOGPT_ERROR, "exists and is not a regular file")
nano("parity_missing_directory", ["--parity-dump", "{d}/no/such/dir/out.json"] + R, NANOGPT_ERROR,
     "does not exist")
nano("parity_with_bench", ["--parity-dump", "{d}/out.json", "--bench"] + R, NANOGPT_ERROR, "exclude each other")
nano("bench_with_tokens", ["--bench", "--tokens", "5"] + R, NANOGPT_ERROR, "--tokens has no effect with --bench")
nano("repeats_without_bench", ["--repeats", "5"] + R, NANOGPT_ERROR, "--repeats is used only with --bench")
nano("repeats_zero", ["--bench", "--repeats", "0"] + R, CLI_VALIDATION, "--repeats")
nano("repeats_negative", ["--bench", "--repeats", "-4"] + R, CLI_VALIDATION, "--repeats")
nano("repeats_huge", ["--bench", "--repeats", "1000000000"] + R, CLI_VALIDATION, "--repeats")
nano("mode_unknown", ["--mode", "fast"] + R, CLI_VALIDATION, "--mode")
nano("mode_empty", ["--mode", ""] + R, CLI_VALIDATION, "--mode")
nano("meta_unknown", ["--meta", "host"] + R, CLI_VALIDATION, "--meta")
nano("weights_and_random_init", ["--weights", "{d}/w.safetensors"] + R, NANOGPT_ERROR, "exclude each other")
nano("unknown_flag", ["--frobnicate"] + R, CLI_EXTRAS, "--frobnicate")
nano("positional_extra", ["extra"] + R, CLI_EXTRAS, "extra")
nano("prompt_missing_value", ["--prompt"], CLI_ARG_MISMATCH, "--prompt")

# Controls: valid input gets past every check.
case("nanogpt_control_random_init", "nanogpt", ["--random-init", "--tokens", "1", "--greedy"], OK, "")
case("nanogpt_control_file", "nanogpt", ["--weights", "{d}/w.safetensors", "--tokens", "2"], OK, "",
     files({"w.safetensors": VALID_NANO}))
case("nanogpt_control_dir_single", "nanogpt", ["--weights", "{d}/m", "--tokens", "2"], OK, "",
     files({"m/model.safetensors": VALID_NANO}))
case("nanogpt_control_dir_sharded", "nanogpt", ["--weights", "{d}/m", "--tokens", "2"], OK, "", sharded())
case("nanogpt_control_symlink_inside", "nanogpt", ["--weights", "{d}/m", "--tokens", "2"], OK, "",
     sharded(b=False, extra=compose(files({"m/real_b.safetensors": safetensors_bytes(SHARD_B)}),
                                    symlink("real_b.safetensors", "m/b.safetensors"))))
case("nanogpt_control_parity", "nanogpt", ["--parity-dump", "{d}/out.json", "--prefill-len", "2", "--prompt", "ROMEO"] + R,
     OK, "")

# ---- qwen: config.json through --model DIR -----------------------------------------------------
def qcfg(name, config, msg, rc=QWEN_INPUT_ERROR):
    case("qwen_config_" + name, "qwen", ["--model", "{d}/m"], rc, msg,
         lambda d, config=config: qwen_dir(os.path.join(d, "m"), config=config))


qcfg("not_json", "{", "not valid JSON")
qcfg("empty", "", "not valid JSON")
qcfg("array", "[]", "expected a JSON object")
qcfg("deep_arrays", '{"x": %s}' % nested(100000), "nested more than 64 levels")
qcfg("deep_objects", nested_objects(100000), "nested more than 64 levels")
qcfg("duplicate_key", json.dumps(QWEN_CONFIG)[:-1] + ', "hidden_size": 128}', "key \"hidden_size\" appears twice")
qcfg("duplicate_nested_key", cfg_text_with("rope_scaling", '{"rope_type": "default", "rope_type": "yarn"}'),
     "appears twice")
qcfg("rope_theta_overflow", cfg_text_with("rope_theta", "1e309"), "1e309 is out of range")
qcfg("unused_field_overflow", cfg_text_with("some_future_field", "-1e309"), "out of range")
qcfg("eps_overflow", cfg_text_with("rms_norm_eps", "1e400"), "out of range")
qcfg("bad_utf8", b'{"model_type": "qwen3\xff"}', "not valid JSON")
qcfg("nul_byte", b'{"model_type": "qwen3"}\0', "not valid JSON")
qcfg("trailing_comma", json.dumps(QWEN_CONFIG)[:-1] + ",}", "not valid JSON")
qcfg("missing_hidden_size", cfg_with(hidden_size=DROP), "missing field 'hidden_size'")
qcfg("missing_vocab", cfg_with(vocab_size=DROP), "missing field 'vocab_size'")
qcfg("hidden_size_string", cfg_with(hidden_size="64"), "'hidden_size' must be an integer")
qcfg("hidden_size_fraction", cfg_with(hidden_size=64.5), "'hidden_size' must be an integer")
qcfg("hidden_size_float_integral", cfg_text_with("hidden_size", "64.0"), "'hidden_size' must be an integer")
qcfg("hidden_size_exponent", cfg_text_with("hidden_size", "1e20"), "'hidden_size' must be an integer")
qcfg("hidden_size_bool", cfg_with(hidden_size=True), "'hidden_size' must be an integer")
qcfg("hidden_size_zero", cfg_with(hidden_size=0), "'hidden_size' out of range")
qcfg("hidden_size_negative", cfg_with(hidden_size=-64), "'hidden_size' out of range")
qcfg("hidden_size_2e31", cfg_with(hidden_size=2 ** 31), "'hidden_size' out of range")
qcfg("hidden_size_2e63", cfg_text_with("hidden_size", "9223372036854775808"), "'hidden_size' out of range")
qcfg("hidden_size_u64_max", cfg_text_with("hidden_size", "18446744073709551615"), "'hidden_size' out of range")
qcfg("hidden_size_huge", cfg_with(hidden_size=2 ** 30), "hidden_size 1073741824 exceeds")
qcfg("hidden_size_odd", cfg_with(hidden_size=60), "multiple of 8")
qcfg("heads_wrap_int", cfg_with(num_attention_heads=2 ** 25, num_key_value_heads=2 ** 25, head_dim=128),
     "num_attention_heads 33554432 exceeds")
qcfg("heads_times_dim_wraps", cfg_with(num_attention_heads=16777216, num_key_value_heads=16777216, head_dim=256),
     "exceeds")
qcfg("heads_times_dim_large", cfg_with(num_attention_heads=1024, num_key_value_heads=1024, head_dim=512),
     "num_attention_heads x head_dim = 524288 exceeds")
qcfg("kv_heads_huge", cfg_with(num_key_value_heads=2 ** 31 - 1), "num_key_value_heads 2147483647 exceeds")
qcfg("head_dim_huge", cfg_with(head_dim=2 ** 31 - 1), "head_dim 2147483647 exceeds")
qcfg("head_dim_96", cfg_with(head_dim=96), "head_dim must be 64 or 128")
qcfg("kv_heads_not_divisor", cfg_with(num_attention_heads=3, num_key_value_heads=2), "multiple of num_key_value_heads")
qcfg("kv_heads_zero", cfg_with(num_key_value_heads=0), "'num_key_value_heads' out of range")
qcfg("heads_zero", cfg_with(num_attention_heads=0), "'num_attention_heads' out of range")
qcfg("vocab_zero", cfg_with(vocab_size=0), "'vocab_size' out of range")
qcfg("vocab_huge", cfg_with(vocab_size=2 ** 31 - 1), "vocab_size 2147483647 exceeds")
qcfg("layers_huge", cfg_with(num_hidden_layers=1000000), "num_hidden_layers 1000000 exceeds")
qcfg("layers_zero", cfg_with(num_hidden_layers=0), "'num_hidden_layers' out of range")
qcfg("intermediate_huge", cfg_with(intermediate_size=2 ** 31 - 8), "intermediate_size 2147483640 exceeds")
qcfg("positions_zero", cfg_with(max_position_embeddings=0), "'max_position_embeddings' out of range")
qcfg("positions_huge", cfg_with(max_position_embeddings=2 ** 31 - 1), "max_position_embeddings 2147483647 exceeds")
qcfg("eps_zero", cfg_with(rms_norm_eps=0), "'rms_norm_eps' must be a positive number")
qcfg("eps_negative", cfg_with(rms_norm_eps=-1e-6), "'rms_norm_eps' must be a positive number")
qcfg("eps_string", cfg_with(rms_norm_eps="1e-6"), "'rms_norm_eps' must be a number")
qcfg("rope_theta_zero", cfg_with(rope_theta=0), "'rope_theta' must be a positive number")
qcfg("rope_theta_bool", cfg_with(rope_theta=False), "'rope_theta' must be a number")
qcfg("rope_parameters_string", cfg_with(rope_parameters={"rope_theta": "1e4"}), "rope_parameters.rope_theta")
qcfg("rope_parameters_zero", cfg_with(rope_parameters={"rope_theta": 0}), "rope_theta must be positive")
qcfg("rope_scaling_yarn", cfg_with(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling other than 'default'")
qcfg("rope_scaling_type_number", cfg_with(rope_scaling={"rope_type": 1}), "rope_scaling other than 'default'")
qcfg("tie_string", cfg_with(tie_word_embeddings="true"), "tie_word_embeddings must be a boolean")
qcfg("attention_bias_true", cfg_with(attention_bias=True), "attention_bias=true is not supported")
qcfg("attention_bias_string", cfg_with(attention_bias="false"), "attention_bias must be a boolean")
qcfg("model_type_llama", cfg_with(model_type="llama"), "model_type is 'llama', expected 'qwen3'")
qcfg("model_type_number", cfg_with(model_type=3), "model_type is 3, expected 'qwen3'")
qcfg("model_type_null", cfg_with(model_type=None), "model_type is null")
case("qwen_config_missing", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "no such file",
     lambda d: (qwen_dir(os.path.join(d, "m")), os.remove(os.path.join(d, "m", "config.json"))))
case("qwen_config_fifo", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "FIFO",
     lambda d: (qwen_dir(os.path.join(d, "m")), os.remove(os.path.join(d, "m", "config.json")),
                os.mkfifo(os.path.join(d, "m", "config.json"))))
case("qwen_config_directory", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "a directory",
     lambda d: (qwen_dir(os.path.join(d, "m")), os.remove(os.path.join(d, "m", "config.json")),
                os.mkdir(os.path.join(d, "m", "config.json"))))
case("qwen_config_loop", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "symbolic link loop",
     lambda d: (qwen_dir(os.path.join(d, "m")), os.remove(os.path.join(d, "m", "config.json")),
                os.symlink("config.json", os.path.join(d, "m", "config.json"))))
case("qwen_config_outside", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "outside the directory",
     lambda d: (qwen_dir(os.path.join(d, "m")), write(os.path.join(d, "c.json"), json.dumps(QWEN_CONFIG)),
                os.remove(os.path.join(d, "m", "config.json")),
                os.symlink(os.path.join(d, "c.json"), os.path.join(d, "m", "config.json"))))
case("qwen_config_dev_zero", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "outside the directory",
     lambda d: (qwen_dir(os.path.join(d, "m")), os.remove(os.path.join(d, "m", "config.json")),
                os.symlink("/dev/zero", os.path.join(d, "m", "config.json"))))
case("qwen_config_too_large", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "larger than",
     lambda d: (qwen_dir(os.path.join(d, "m")), os.truncate(os.path.join(d, "m", "config.json"), 2 << 20)))
case("qwen_model_missing", "qwen", ["--model", "{d}/none"], QWEN_INPUT_ERROR, "no such file")
case("qwen_model_is_fifo", "qwen", ["--model", "{d}/pipe"], QWEN_INPUT_ERROR, "FIFO", fifo("pipe"))
case("qwen_model_is_config_file", "qwen", ["--model", "{d}/m/config.json"], QWEN_INPUT_ERROR, "not a safetensors file",
     lambda d: qwen_dir(os.path.join(d, "m")))
case("qwen_model_dir_loop", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "symbolic link loop", symlink("{d}/m", "m"))
case("qwen_model_no_weights", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, "neither",
     lambda d: qwen_dir(os.path.join(d, "m"), weights=False))

# ---- qwen: weights against the config ----------------------------------------------------------
def qweights(name, msg, alter=None, extra=(), cfg=None):
    c = QWEN_CONFIG if cfg is None else cfg
    case("qwen_weights_" + name, "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, msg,
         lambda d: qwen_dir(os.path.join(d, "m"), config=c,
                            weights=safetensors_bytes(qwen_tensors(QWEN_CONFIG, alter, extra))))


BF = "BF16"
qweights("layer_minus_one", "'-1' is not a layer index", extra=[("model.layers.-1.mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_abc", "'abc' is not a layer index", extra=[("model.layers.abc.mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_leading_zero", "'01' is not a layer index", extra=[("model.layers.01.mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_plus", "'+1' is not a layer index", extra=[("model.layers.+1.mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_space", "' 1' is not a layer index", extra=[("model.layers. 1.mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_empty", "'' is not a layer index", extra=[("model.layers..mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_hex", "'0x1' is not a layer index", extra=[("model.layers.0x1.mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_no_dot", "is not a layer index", extra=[("model.layers.1", BF, [1])])
qweights("layer_int_overflow", "'4294967296' is not a layer index",
         extra=[("model.layers.4294967296.mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_beyond_config", "belongs to layer 2, but the config has 2 layers",
         extra=[("model.layers.2.mlp.up_proj.weight", BF, [128, 64])])
qweights("layer_unknown_suffix", "is not a parameter of a Qwen3 layer",
         extra=[("model.layers.0.mlp.extra.weight", BF, [4])])
qweights("layer_bias", "is a bias", extra=[("model.layers.0.self_attn.q_proj.bias", BF, [128])])
qweights("unknown_tensor", "tensor rogue is not a parameter", extra=[("rogue", BF, [1])])
qweights("missing_norm", "missing tensor model.norm.weight", alter=lambda t: None if t[0] == "model.norm.weight" else t)
qweights("missing_layer_tensor", "missing tensor model.layers.1.mlp.down_proj.weight",
         alter=lambda t: None if t[0] == "model.layers.1.mlp.down_proj.weight" else t)
qweights("embed_f32", "dtype BF16", alter=lambda t: (t[0], "F32", t[2], t[3] * 2) if t[0] == "model.embed_tokens.weight" else t)
qweights("embed_shape", "expected shape [64, 64]",
         alter=lambda t: (t[0], t[1], [32, 64], t[3][: len(t[3]) // 2]) if t[0] == "model.embed_tokens.weight" else t)
qweights("untied_no_lm_head", "missing tensor lm_head.weight", cfg=cfg_with(tie_word_embeddings=False))
qweights("config_more_layers", "missing tensor model.layers.2", cfg=cfg_with(num_hidden_layers=3))
qweights("config_wider_heads", "expected shape [256, 64]", cfg=cfg_with(num_attention_heads=4))
case("qwen_weights_nanogpt_file", "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR,
     "missing tensor model.embed_tokens.weight",
     lambda d: qwen_dir(os.path.join(d, "m"), weights=safetensors_bytes(nanogpt_tensors())))
case("qwen_control_model", "qwen", ["--model", "{d}/m", "--prompt", "1,2,3", "--gen", "2"], OK, "",
     lambda d: qwen_dir(os.path.join(d, "m")))
case("qwen_control_untied", "qwen", ["--model", "{d}/m", "--prompt", "1,2,3", "--gen", "2"], OK, "",
     lambda d: qwen_dir(os.path.join(d, "m"), config=cfg_with(tie_word_embeddings=False),
                        weights=safetensors_bytes(qwen_tensors(extra=[("lm_head.weight", BF, [64, 64])]))))


# ---- qwen: sharded checkpoints ------------------------------------------------------------------
def qwen_sharded(index=None, shards=None):
    def setup(d):
        m = os.path.join(d, "m")
        qwen_dir(m, weights=False)
        ts = qwen_tensors()
        a = [t for t in ts if not t[0].startswith("model.layers.1.")]
        b = [t for t in ts if t[0].startswith("model.layers.1.")]
        wm = dict([(t[0], "s1.safetensors") for t in a] + [(t[0], "s2.safetensors") for t in b])
        idx = {"metadata": {"total_size": 1}, "weight_map": wm} if index is None else index(wm)
        write(os.path.join(m, "model.safetensors.index.json"), idx if isinstance(idx, str) else json.dumps(idx))
        sh = {"s1.safetensors": safetensors_bytes(a), "s2.safetensors": safetensors_bytes(b)}
        if shards is not None:
            shards(d, sh)
        for k, v in sh.items():
            if v is not None:
                write(os.path.join(m, k), v)
    return setup


def qshard(name, msg, **kw):
    case("qwen_sharded_" + name, "qwen", ["--model", "{d}/m"], QWEN_INPUT_ERROR, msg, qwen_sharded(**kw))


def wm_with(key, value):
    def f(wm):
        wm = dict(wm)
        if value is DROP:
            wm.pop(key)
        else:
            wm[key] = value
        return {"weight_map": wm}
    return f


qshard("unlisted_tensor", "does not list", index=wm_with("model.norm.weight", DROP))
qshard("shard_escape", "not a plain file name", index=wm_with("model.norm.weight", "../../etc/passwd"))
qshard("shard_absolute", "not a plain file name", index=wm_with("model.norm.weight", "/etc/passwd"))
qshard("deep_index", "nested more than 64", index=lambda wm: '{"weight_map": %s}' % nested(100000))
qshard("duplicate_index_key", "appears twice",
       index=lambda wm: '{"weight_map": {"model.norm.weight": "s1.safetensors", "model.norm.weight": "s1.safetensors"}}')
qshard("overflow_index", "out of range", index=lambda wm: '{"metadata": {"total_size": 1e999}, "weight_map": {}}')


def _outside(d, sh):
    write(os.path.join(d, "s2.safetensors"), sh["s2.safetensors"])
    os.symlink(os.path.join(d, "s2.safetensors"), os.path.join(d, "m", "s2.safetensors"))
    sh["s2.safetensors"] = None


def _fifo_shard(d, sh):
    os.mkfifo(os.path.join(d, "m", "s2.safetensors"))
    sh["s2.safetensors"] = None


def _loop_shard(d, sh):
    os.symlink("s2.safetensors", os.path.join(d, "m", "s2.safetensors"))
    sh["s2.safetensors"] = None


def _stowaway(d, sh):
    sh["s2.safetensors"] = safetensors_bytes(
        [t for t in qwen_tensors() if t[0].startswith("model.layers.1.")] + [("model.layers.1.extra", "BF16", [2], b"\0" * 4)])


qshard("shard_outside", "outside the directory", shards=_outside)
qshard("shard_fifo", "FIFO", shards=_fifo_shard)
qshard("shard_loop", "symbolic link loop", shards=_loop_shard)
qshard("stowaway_tensor", "does not list", shards=_stowaway)
case("qwen_control_sharded", "qwen", ["--model", "{d}/m", "--prompt", "1,2,3", "--gen", "2"], OK, "", qwen_sharded())

# ---- qwen command-line flags -------------------------------------------------------------------
# Flags of the qwen CLI, checked in examples/qwen/main.cu and options.hpp. A case marked pending=True
# is registered disabled until the CLI checks it (see docs/hostile-input.md).
def qflag(name, args, rc, msg, pending=False, preset=True):
    case("qwen_cli_" + name, "qwen", (["--preset", "tiny"] if preset else []) + args, rc, msg)
    if pending:
        CASES[-1]["pending"] = True


qflag("token_out_of_vocab", ["--prompt", "5,99999", "--gen", "4"], QWEN_INPUT_ERROR, "out of range")
qflag("token_negative", ["--prompt", "5,-7"], QWEN_INPUT_ERROR, "--prompt: '-7' at position 1 is not a non-negative integer")
qflag("token_text", ["--prompt", "1,two,3"], QWEN_INPUT_ERROR, "'two' at position 1 is not a non-negative integer")
qflag("token_overflow", ["--prompt", "99999999999999999999"], QWEN_INPUT_ERROR, "is out of range")
qflag("token_int_overflow", ["--prompt", "4294967296"], QWEN_INPUT_ERROR, "is out of range")
qflag("token_fraction", ["--prompt", "1.5"], QWEN_INPUT_ERROR, "is not a non-negative integer")
qflag("token_plus", ["--prompt", "+1"], QWEN_INPUT_ERROR, "is not a non-negative integer")
qflag("token_space", ["--prompt", "1, 2"], QWEN_INPUT_ERROR, "is not a non-negative integer")
qflag("prompt_empty", ["--prompt", ""], QWEN_INPUT_ERROR, "--prompt: empty prompt")
qflag("prompt_only_commas", ["--prompt", ",,,"], QWEN_INPUT_ERROR, "--prompt: empty entry at position 0")
qflag("prompt_trailing_comma", ["--prompt", "1,2,"], QWEN_INPUT_ERROR, "--prompt: empty entry at position 2")
qflag("too_long", ["--random-prompt", "2000", "--gen", "100"], QWEN_INPUT_ERROR, "exceeds the context")
qflag("random_prompt_huge", ["--random-prompt", "2000000000"], QWEN_INPUT_ERROR, "--random-prompt 2000000000 must be in")
qflag("random_prompt_negative", ["--random-prompt", "-5"], QWEN_INPUT_ERROR, "--random-prompt -5 must be in")
qflag("random_prompt_overflow", ["--random-prompt", "99999999999"], QWEN_INPUT_ERROR, "--random-prompt 99999999999 must be in")
qflag("gen_zero", ["--gen", "0"], QWEN_INPUT_ERROR, "--gen 0 must be in 1..1048576")
qflag("gen_negative", ["--gen", "-5"], QWEN_INPUT_ERROR, "--gen -5 must be in")
qflag("gen_huge", ["--gen", "2000000000"], QWEN_INPUT_ERROR, "--gen 2000000000 must be in")
qflag("gen_text", ["--gen", "many"], CLI_CONVERSION, "--gen")
qflag("batch_zero", ["--batch", "0"], QWEN_INPUT_ERROR, "--batch 0 must be in 1..1024")
qflag("batch_huge", ["--batch", "100000"], QWEN_INPUT_ERROR, "--batch 100000 must be in")
qflag("kv_mem_negative", ["--kv-mem-mb", "-1"], QWEN_INPUT_ERROR, "--kv-mem-mb -1 must be a positive number")
qflag("kv_mem_zero", ["--kv-mem-mb", "0"], QWEN_INPUT_ERROR, "--kv-mem-mb 0 must be a positive number")
qflag("kv_mem_1e30", ["--kv-mem-mb", "1e30"], QWEN_INPUT_ERROR, "--kv-mem-mb 1e+30 must be a positive number")
qflag("kv_mem_nan", ["--kv-mem-mb", "nan"], QWEN_INPUT_ERROR, "--kv-mem-mb nan must be a positive number")
qflag("kv_mem_inf", ["--kv-mem-mb", "inf"], QWEN_INPUT_ERROR, "--kv-mem-mb inf must be a positive number")
qflag("kv_mem_huge", ["--kv-mem-mb", "1e12"], QWEN_INPUT_ERROR, "--kv-mem-mb 1000000000000 must be a positive number")
qflag("kv_mem_tiny", ["--kv-mem-mb", "0.001"], QWEN_INPUT_ERROR, "at least 2 are needed")
qflag("kv_mem_text", ["--kv-mem-mb", "lots"], CLI_CONVERSION, "--kv-mem-mb")
qflag("max_context_one", ["--max-context", "1"], QWEN_INPUT_ERROR, "--max-context 1 must be in 2..16777216")
qflag("max_context_negative", ["--max-context", "-5"], QWEN_INPUT_ERROR, "--max-context -5 must be in")
qflag("max_context_huge", ["--max-context", "2147483647"], QWEN_INPUT_ERROR, "--max-context 2147483647 must be in")
qflag("max_context_past_model", ["--max-context", "4096"], QWEN_INPUT_ERROR, "exceeds the model's max_position_embeddings")
qflag("max_context_text", ["--max-context", "x"], CLI_CONVERSION, "--max-context")
qflag("max_bucket_zero", ["--max-bucket", "0"], QWEN_INPUT_ERROR, "--max-bucket 0 must be in")
qflag("seed_negative", ["--seed", "-1"], QWEN_INPUT_ERROR, "--seed -1 must be non-negative")
qflag("seed_text", ["--seed", "abc"], CLI_CONVERSION, "--seed")
qflag("preset_unknown", ["--preset", "qwen9"], QWEN_INPUT_ERROR, "unknown preset", preset=False)
qflag("preset_twice", ["--preset", "qwen9"], CLI_ARG_MISMATCH, "--preset")
qflag("mode_unknown", ["--mode", "fast"], CLI_VALIDATION, "--mode")
qflag("unknown_flag", ["--frobnicate"], CLI_EXTRAS, "--frobnicate")
qflag("bench_steps_negative", ["--bench", "--bench-steps", "-1"], QWEN_INPUT_ERROR, "--bench-steps must be in")
qflag("long_prompt_negative", ["--bench", "--long-prompt", "-1"], QWEN_INPUT_ERROR, "--long-prompt must be in")
qflag("bench_batches_bad", ["--bench", "--bench-batches", "1,x"], QWEN_INPUT_ERROR, "is not a non-negative integer")
# Pending: accepted today; registered disabled until the CLI refuses them.
qflag("model_empty_path", ["--model", ""], QWEN_INPUT_ERROR, "--model")


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def expand(args, d):
    out = []
    for a in args:
        out.append(a.replace(b"{d}", d.encode()) if isinstance(a, bytes) else a.replace("{d}", d))
    return out


def build(root):
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    manifest = []
    for c in CASES:
        d = os.path.join(root, c["name"])
        if os.path.lexists(d):
            subprocess.run(["chmod", "-R", "u+rwx", d], check=False)
            subprocess.run(["rm", "-rf", d], check=True)
        os.makedirs(d)
        if c["setup"] is not None:
            c["setup"](d)
        args = [a.decode("latin-1") if isinstance(a, bytes) else a for a in expand(c["args"], d)]
        raw = [isinstance(a, bytes) for a in c["args"]]
        manifest.append({"name": c["name"], "prog": c["prog"], "args": args, "raw": raw, "rc": c["rc"],
                         "msg": c["msg"], "pending": c.get("pending", False)})
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print("hostile corpus: %d cases in %s" % (len(manifest), root))


def main(argv):
    if len(argv) >= 2 and argv[1] == "names":
        print("\n".join(c["name"] for c in CASES if not c.get("pending")))
        return 0
    if len(argv) >= 2 and argv[1] == "pending":
        print("\n".join(c["name"] for c in CASES if c.get("pending")))
        return 0
    if len(argv) == 3 and argv[1] == "build":
        build(argv[2])
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
