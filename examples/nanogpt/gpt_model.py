"""The seed's character-level GPT in PyTorch (the model of the "NanoGPT: CUDA Graph Replay" post).

Used by train.py (training) and parity.py (reference logits). Parameter and buffer names are the
ones the C++ decoder loads (examples/nanogpt/weights.hpp):

  token_embedding_table.weight, position_embedding_table.weight,
  blocks.{l}.ln1.*, blocks.{l}.sa.qkv.weight, blocks.{l}.sa.attn_proj.*, blocks.{l}.ln2.*,
  blocks.{l}.ffwd.net.0.*, blocks.{l}.ffwd.net.2.*, ln_f.*, lm_head.*
  (+ buffers blocks.{l}.sa.tril and blocks.{l}.sa.kv_indices, which the C++ loader ignores)

Besides the training forward it keeps the seed's inference machinery: a static KV cache of
block_size slots written by index, the static input buffers and the graph-safe decode_one_token().
"""
import torch
import torch.nn as nn
from torch.nn import functional as F

# Hyper-parameters of the seed's model (C++: nanogpt::Config).
vocab_size = 65
n_embd = 32
n_head = 4
n_layer = 4
block_size = 64
dropout = 0.0

# tiny-shakespeare's 65 characters, sorted (C++: nanogpt::vocab_chars)
CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
assert len(CHARS) == vocab_size
STOI = {c: i for i, c in enumerate(CHARS)}


def encode(s):
    return [STOI[c] for c in s]


def decode(ids):
    return "".join(CHARS[i] for i in ids)


class CausalSelfAttention(nn.Module):
    """Fused QKV attention with the seed's pre-allocated KV cache."""

    def __init__(self, num_heads, head_size, device):
        super().__init__()
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.attn_proj = nn.Linear(n_embd, n_embd)
        self.num_heads = num_heads
        self.head_size = head_size
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        # Pre-allocated KV cache: fixed address, never reallocated (not part of the state_dict)
        self.key_cache = torch.zeros(1, num_heads, block_size, head_size, device=device)
        self.value_cache = torch.zeros(1, num_heads, block_size, head_size, device=device)
        # Static buffer for decode masking: avoids torch.arange in the graph
        self.register_buffer("kv_indices", torch.arange(block_size))

    def _split(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(n_embd, dim=2)
        shape = (B, T, self.num_heads, self.head_size)
        return (q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2))

    def forward(self, x, cache_pos=None):
        B, T, C = x.shape
        q, k, v = self._split(x)
        scale = self.head_size ** -0.5
        if not self.training and cache_pos is not None:
            # Write into the pre-allocated cache at the right slots, attend over the full cache
            self.key_cache[:, :, cache_pos:cache_pos + T, :] = k
            self.value_cache[:, :, cache_pos:cache_pos + T, :] = v
            attn = (q @ self.key_cache.transpose(-2, -1)) * scale
            q_positions = torch.arange(cache_pos, cache_pos + T, device=x.device)
            mask = self.kv_indices.unsqueeze(0) <= q_positions.unsqueeze(1)
            attn = attn.masked_fill(~mask.unsqueeze(0).unsqueeze(0), float("-inf"))
            out = F.softmax(attn, dim=-1) @ self.value_cache
        else:
            attn = (q @ k.transpose(-2, -1)) * scale
            attn = attn.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
            out = F.softmax(attn, dim=-1) @ v
        out = out.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_proj(out)

    def decode_cached(self, x, cache_pos):
        """Graph-safe single-token decode: cache_pos is a 1-element tensor, no Python ints."""
        q, k, v = self._split(x)
        self.key_cache.index_copy_(2, cache_pos, k)
        self.value_cache.index_copy_(2, cache_pos, v)
        attn = (q @ self.key_cache.transpose(-2, -1)) * (self.head_size ** -0.5)
        mask = self.kv_indices <= cache_pos  # (block_size,)
        attn = attn.masked_fill(~mask, float("-inf"))
        out = F.softmax(attn, dim=-1) @ self.value_cache
        B, T, C = x.shape
        return self.attn_proj(out.transpose(1, 2).contiguous().view(B, T, C))


class FeedFoward(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, device):
        super().__init__()
        head_size = n_embd // n_head
        self.sa = CausalSelfAttention(n_head, head_size, device)
        self.ffwd = FeedFoward(n_embd)
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x, cache_pos=None):
        x = x + self.sa(self.ln1(x), cache_pos)
        return x + self.ffwd(self.ln2(x))

    def decode_cached(self, x, cache_pos):
        x = x + self.sa.decode_cached(self.ln1(x), cache_pos)
        return x + self.ffwd(self.ln2(x))


class GPTLanguageModel(nn.Module):
    def __init__(self, device="cuda"):
        super().__init__()
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, device) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)
        self.apply(self._init_weights)
        # Static buffers for CUDA graph replay: allocated once, addresses never change
        self.static_input_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.static_position = torch.zeros(1, dtype=torch.long, device=device)
        self.static_cache_pos = torch.zeros(1, dtype=torch.long, device=device)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, cache_pos=None):
        B, T = idx.shape
        start = 0 if cache_pos is None else cache_pos
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.token_embedding_table(idx) + self.position_embedding_table(pos)
        for block in self.blocks:
            x = block(x, cache_pos)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss

    def decode_one_token(self):
        """Graph-safe decode: reads only the static buffers."""
        tok_emb = self.token_embedding_table(self.static_input_ids)
        pos_emb = self.position_embedding_table(self.static_position)
        x = tok_emb + pos_emb
        for block in self.blocks:
            x = block.decode_cached(x, self.static_cache_pos)
        return self.lm_head(self.ln_f(x))
