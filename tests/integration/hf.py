"""Tiny Hugging Face models built from configs (no downloads), their data, and one training step the way Hugging
Face loops write it. Shared by the integration tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may try the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 128
SEQ = 16


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)  # deterministic: runs are compared bit for bit
    return GPT2LMHeadModel(cfg)


def tokens(step: int, rank: int = 0, micro: int = 0, batch: int = 4) -> torch.Tensor:
    """A fresh random batch of token ids [batch, SEQ] per (step, rank, micro-batch)."""
    g = torch.Generator().manual_seed(100_003 * step + 1009 * rank + micro)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def flat_weights(model) -> torch.Tensor:
    """Every parameter of the model, flattened and concatenated in named_parameters() order, as fp32."""
    return torch.cat([p.detach().float().reshape(-1) for _, p in model.named_parameters()])


@torch.no_grad()
def eval_loss(model, seed: int = 12345) -> float:
    return float(lm_loss(model, tokens(seed, batch=8)))
