"""An LLM job for scripts/bench_agent.py: a transformers Llama model built from a LlamaConfig with
random weights (nothing downloaded), bf16 on the GPU, running forward passes under
torch.no_grad() until $GPUOS_JOB_STOP exists. Writes "unix_time iters_per_s longest_iteration_s" per >= 100 ms
window to $GPUOS_JOB_LOG and, after warm-up, its pid to $GPUOS_JOB_READY (atomically): the
protocol of agent_job.py.

The model is Llama-2-7B-shaped (hidden 4096, 32 heads, MLP 11008, vocabulary 32000) with as many
layers as make its weights plus about 1 GiB of activations reach GPU_JOB_GIB (default 8) GiB
(GPU_JOB_LAYERS overrides); 8 GiB gives 18 layers, about 3.9 G parameters, 7.3 GiB of weights.
One iteration = one forward of GPU_JOB_BATCH x GPU_JOB_SEQ tokens (default 4 x 512, no KV cache
kept: a prefill), the greedy next token of each row appended to a sliding window of the input,
then a synchronize. Whatever the caching allocator holds after warm-up below GPU_JOB_GIB is
topped up with an untouched ballast (held like a KV cache between requests), so the process holds
at least GPU_JOB_GIB. No managed memory; stderr says what it holds.
"""

import math
import os
import sys
import time

HIDDEN, HEADS, MLP, VOCAB = 4096, 32, 11008, 32000
ACTIVATIONS = 1 << 30  # what a forward of 4 x 512 tokens needs besides the weights, about


def layers_for(gib: float) -> int:
    """Decoder layers whose bf16 weights, with the embeddings and ACTIVATIONS, reach ``gib`` GiB."""
    per_layer = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP + 2 * HIDDEN)
    fixed = 2 * (2 * VOCAB * HIDDEN + HIDDEN)  # embeddings, lm_head (untied), final norm
    return max(1, math.ceil((gib * (1 << 30) - fixed - ACTIVATIONS) / per_layer))


def main() -> None:
    gib = float(os.environ.get("GPU_JOB_GIB", "8"))
    batch = int(os.environ.get("GPU_JOB_BATCH", "4"))
    seq = int(os.environ.get("GPU_JOB_SEQ", "512"))
    layers = int(os.environ.get("GPU_JOB_LAYERS") or layers_for(gib))
    stop = os.environ["GPUOS_JOB_STOP"]
    log = open(os.environ["GPUOS_JOB_LOG"], "w", buffering=1)
    ready = os.environ["GPUOS_JOB_READY"]

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not torch.cuda.is_available():
        sys.exit("agent_job_llm: torch sees no CUDA device")
    dev = torch.device("cuda")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=4096,
                         tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    t = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters are created (and initialised) in bf16 on the GPU
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    if any(p.dtype != torch.bfloat16 or p.device.type != "cuda" for p in model.parameters()):
        model = model.to(device=dev, dtype=torch.bfloat16)
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"agent_job_llm: {layers} layers, {params / 1e9:.2f} G parameters, {weights / (1 << 30):.2f} GiB of "
          f"weights, built in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    ids = torch.randint(0, VOCAB, (batch, seq), device=dev)

    @torch.no_grad()
    def step(ids):
        logits = model(input_ids=ids, use_cache=False).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        return torch.cat([ids[:, 1:], nxt], dim=1)

    for _ in range(3):
        ids = step(ids)
    torch.cuda.synchronize()
    held = torch.cuda.memory_reserved()
    short = int(gib * (1 << 30)) - held
    ballast = torch.zeros(short, dtype=torch.uint8, device=dev) if short > 0 else None
    torch.cuda.synchronize()
    print(f"agent_job_llm: batch {batch} x {seq} tokens; the model and its activations hold "
          f"{held / (1 << 30):.2f} GiB, ballast {max(short, 0) / (1 << 30):.2f} GiB; reserved "
          f"{torch.cuda.memory_reserved() / (1 << 30):.2f} GiB", file=sys.stderr, flush=True)
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))  # the agent's socket is named after this process
    os.rename(ready + ".tmp", ready)
    window = last = time.perf_counter()
    count = 0
    gap = 0.0
    while not os.path.exists(stop):
        ids = step(ids)
        torch.cuda.synchronize()
        count += 1
        now = time.perf_counter()
        gap, last = max(gap, now - last), now  # the longest iteration of the window
        if now - window >= 0.1:
            log.write(f"{time.time():.6f} {count / (now - window):.1f} {gap:.6f}\n")
            window, count, gap = now, 0, 0.0
    torch.cuda.synchronize()
    del ballast


if __name__ == "__main__":
    main()
