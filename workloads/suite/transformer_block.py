"""Accuracy suite: one GPT-2 transformer block (attention, MLP, layer norms) forward and backward,
random weights from a config (no downloads), eager attention."""

import os

import torch
from transformers import GPT2Config, GPT2Model

torch.manual_seed(0)
cfg = GPT2Config(n_layer=1, n_embd=128, n_head=4, n_positions=64, vocab_size=512,
                 attn_implementation="eager")
model = GPT2Model(cfg).cuda()
T = 32 * int(os.environ.get("GPUOS_SUITE_SCALE", "1"))  # sequence length: learning (1), scoring (2)
ids = torch.randint(0, 512, (2, T), device="cuda")
out = model(input_ids=ids).last_hidden_state
out.square().mean().backward()
torch.cuda.synchronize()
print(float(out.sum()))
