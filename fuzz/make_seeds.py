#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz harnesses to fuzz/corpus/NAME/seed_*: small valid and
almost-valid files. Inputs that once failed are committed next to them as regress_* (kept forever).
Usage: python3 fuzz/make_seeds.py"""
import json
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))


def st(header, data=b""):
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(text)) + text + data


def put(harness, name, data):
    d = os.path.join(here, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed_" + name), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


f32 = lambda *v: struct.pack("<%df" % len(v), *v)
files = {
    "two_tensors": st({"__metadata__": {"format": "pt"},
                       "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                       "b": {"dtype": "BF16", "shape": [2], "data_offsets": [16, 20]}}, f32(1, 2, 3, 4) + b"\0" * 4),
    "scalar": st({"s": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]}}, b"\1" * 8),
    "empty_tensor": st({"e": {"dtype": "U8", "shape": [0, 5], "data_offsets": [0, 0]}}),
    "all_dtypes": st(dict(("t%d" % i, {"dtype": d, "shape": [1], "data_offsets": [8 * i, 8 * i + s]})
                          for i, (d, s) in enumerate([("F64", 8), ("F32", 4), ("F16", 2), ("BF16", 2), ("F8_E4M3", 1),
                                                      ("F8_E5M2", 1), ("I64", 8), ("I32", 4), ("I16", 2), ("I8", 1),
                                                      ("U64", 8), ("U32", 4), ("U16", 2), ("U8", 1), ("BOOL", 1)])),
                     b"\0" * 120),
    "overflow_shape": st({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}}),
    "overlap": st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
    "nested_metadata": st('{"__metadata__": {"k": [[[[[[1]]]]]]}}'),
    "duplicate": st('{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": 1}', b"\0"),
    "big_number": st('{"__metadata__": {"k": 1e308}}'),
    "short": b"\x10\0\0\0",
}
for name, data in files.items():
    put("safetensors_header", name, data)
    put("safetensors_file", name, data)

index = {"metadata": {"total_size": 24}, "weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}
put("sharded_index", "valid", json.dumps(index))
put("sharded_index", "unlisted", json.dumps({"weight_map": {"x": "a.safetensors", "z": "b.safetensors"}}))
put("sharded_index", "escape", json.dumps({"weight_map": {"x": "../a.safetensors"}}))
put("sharded_index", "missing_shard", json.dumps({"weight_map": {"x": "c.safetensors"}}))
put("sharded_index", "duplicate", '{"weight_map": {"x": "a.safetensors", "x": "b.safetensors"}}')
put("sharded_index", "nested", '{"metadata": {"a": [[[{"b": [1e10]}]]]}, "weight_map": {}}')

config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
          "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
          "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
          "rope_scaling": None, "tie_word_embeddings": True, "attention_bias": False, "torch_dtype": "bfloat16"}
put("hf_config", "qwen3_0_6b", json.dumps(config, indent=2))
put("hf_config", "tiny", json.dumps(dict(config, vocab_size=64, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=64, rope_parameters={"rope_theta": 10000.0})))
put("hf_config", "huge_heads", json.dumps(dict(config, num_attention_heads=2 ** 25, num_key_value_heads=2 ** 25)))
put("hf_config", "overflow", '{"model_type": "qwen3", "rope_theta": 1e309}')
put("hf_config", "minimal", '{"vocab_size": 8, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, '
                            '"num_attention_heads": 1}')
