"""A GPT-2-style language model in plain PyTorch: token and position embeddings, pre-LayerNorm
blocks of causal self-attention and a GELU MLP, and an output head tied to the token embedding.

Nothing here knows about Strata: the same class trains with torch.optim.AdamW (the tests'
reference) and under strata.initialize. Its shapes are those of strata-train's built-in GPT, so
the two can be timed against each other.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab_size, seq_len, d_model, dropout):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.empty(seq_len, d_model))
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.tok.weight, 0.0, 0.02)
        nn.init.normal_(self.pos, 0.0, 0.02)

    def forward(self, tokens):
        return self.drop(self.tok(tokens) + self.pos[: tokens.size(1)])


def _linear(d_in, d_out):
    layer = nn.Linear(d_in, d_out)
    nn.init.normal_(layer.weight, 0.0, 0.02)
    nn.init.zeros_(layer.bias)
    return layer


class Block(nn.Module):
    def __init__(self, d_model, n_heads, dropout):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = _linear(d_model, 3 * d_model)
        self.proj = _linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = _linear(d_model, 4 * d_model)
        self.out = _linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        B, T, D = x.shape
        hd = D // self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, hd).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if mask is not None:
            att = att.masked_fill(~mask, float("-inf"))
        y = (self.drop(att.softmax(-1)) @ v).transpose(1, 2).contiguous().view(B, T, D)
        h = x + self.drop(self.proj(y))
        return h + self.drop(self.out(F.gelu(self.fc(self.ln2(h)))))


class Head(nn.Module):
    """Final LayerNorm and the output projection, whose weight is the token embedding's."""

    def __init__(self, d_model, tied_weight):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.weight = tied_weight

    def forward(self, x):
        return F.linear(self.ln(x), self.weight)


class GPT2(nn.Module):
    def __init__(self, vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4,
                 dropout=0.0, checkpoint_fn=None):
        """checkpoint_fn: None, or a function like strata.checkpointing.checkpoint through which
        every block runs (activation checkpointing)."""
        super().__init__()
        self.embed = Embedding(vocab_size, seq_len, d_model, dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.head = Head(d_model, self.embed.tok.weight)
        self.register_buffer("mask", torch.ones(seq_len, seq_len).tril().bool(), persistent=False)
        self.checkpoint_fn = checkpoint_fn

    def forward(self, tokens, targets=None):
        T = tokens.size(1)
        mask = self.mask[:T, :T]
        x = self.embed(tokens)
        for block in self.blocks:
            if self.checkpoint_fn is not None:
                x = self.checkpoint_fn(block, x, mask)
            else:
                x = block(x, mask=mask)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
