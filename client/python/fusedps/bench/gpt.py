"""A small decoder-only transformer (GPT) over bytes: examples/train_gpt.py trains it, and
``python -m fusedps.bench e2e`` times it (fusedps/bench/e2e.py).

    model = GPT(GPTConfig(n_layer=6, d_model=512, n_head=8, context=256))
    logits = model(tokens)              # tokens: int64 [batch, time], time <= context
                                        # logits: [batch, time, vocab_size], float32 or the
                                        # autocast dtype (bf16 under torch.autocast)

Pre-LayerNorm blocks (attention, then a 4x GELU MLP), learned position embeddings, and an
output layer tied to the token embedding: the logits are ``F.linear(h, tok_emb.weight)``, so
the tied matrix is one Parameter and named_parameters() lists it once, as ``tok_emb.weight``.
Causal self-attention uses torch.nn.functional.scaled_dot_product_attention where torch has it
(2.0 and later) and an explicit lower-triangular mask otherwise (Debian's torch 1.13).
Initialisation is GPT-2's: N(0, 0.02), residual output projections N(0, 0.02 / sqrt(2 *
n_layer)), zero biases; it draws from torch's global generator, so torch.manual_seed(seed)
before GPT(...) gives the same weights on every device.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

HAS_SDPA = hasattr(F, "scaled_dot_product_attention")


@dataclasses.dataclass
class GPTConfig:
    """Model shape. vocab_size 256: one token per byte."""
    n_layer: int = 6
    d_model: int = 512
    n_head: int = 8
    context: int = 256
    vocab_size: int = 256
    dropout: float = 0.0

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")


class CausalSelfAttention(torch.nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = torch.nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = torch.nn.Linear(cfg.d_model, cfg.d_model)
        if not HAS_SDPA:
            mask = torch.tril(torch.ones(cfg.context, cfg.context, dtype=torch.bool))
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, time, d_model] -> [batch, time, d_model]."""
        b, t, d = x.shape
        # [batch, time, 3, heads, head_dim] -> 3 x [batch, heads, time, head_dim]
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if HAS_SDPA:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.causal_mask[:t, :t], float("-inf"))
            att = F.dropout(F.softmax(att, dim=-1), p=p)
            y = att @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)); [batch, time, d_model] in and out."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_attn = torch.nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = torch.nn.LayerNorm(cfg.d_model)
        self.fc = torch.nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = torch.nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = torch.nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_attn(x)))
        return x + self.dropout(self.proj(F.gelu(self.fc(self.ln_mlp(x)))))


class GPT(torch.nn.Module):
    """tokens int64 [batch, time] -> logits [batch, time, vocab_size]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = torch.nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_out = torch.nn.LayerNorm(cfg.d_model)
        self.dropout = torch.nn.Dropout(cfg.dropout)
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for block in self.blocks:
            torch.nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            torch.nn.init.normal_(block.proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct parameter elements (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.size(1)
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens exceeds the context of {self.cfg.context}")
        pos = torch.arange(t, device=tokens.device)
        x = self.dropout(self.tok_emb(tokens) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_out(x), self.tok_emb.weight)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n_new: int, generator: torch.Generator,
                 temperature: float = 1.0) -> torch.Tensor:
        """Samples n_new tokens after prompt (int64 [time]); returns int64 [time + n_new].

        Draws with torch.multinomial from ``generator`` (on prompt's device), so a seeded
        generator gives the same text for the same weights.
        """
        tokens = prompt.view(1, -1)
        for _ in range(n_new):
            logits = self(tokens[:, -self.cfg.context:])[0, -1].float()
            probs = F.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
        return tokens.view(-1)
