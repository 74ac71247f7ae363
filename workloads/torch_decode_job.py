"""LLM decode for `gpu-prefetch-sched run`: a transformers Llama built from a
LlamaConfig with random weights (nothing downloaded), bf16 on the GPU, greedy decoding with a
KV cache for a fixed number of tokens.

The model: --hidden, --layers, --mlp (intermediate size), --heads, --vocab; weights are
2 * (layers * (4 * hidden^2 + 3 * hidden * mlp) + 2 * vocab * hidden) bytes (untied
embeddings). A prompt of --prompt random token ids (seeded) is prefilled, then --tokens tokens
are generated one at a time, each the argmax of the last logits fed back with the cache
(own loop, no `generate`: no sampling, no compilation, the same Python on every run).

--cache static (default): transformers' StaticCache, preallocated for prompt + tokens, so
every decode step issues the same launches on the same memory (as a serving engine's
preallocated KV cache); --cache dynamic: DynamicCache, which concatenates (new memory) per
token and layer. Falls back to dynamic when this transformers cannot build a StaticCache
(the output says which).

Deterministic: torch.manual_seed(0), CUBLAS_WORKSPACE_CONFIG=:4096:8 (set before torch is
imported, unless already set), cuDNN deterministic, torch.use_deterministic_algorithms(True,
warn_only=True). The output (one JSON line to --out, stdout without it): the generated token
ids and their sha256 (what a run under any memory manager must reproduce), the decode loop's
wall time (synchronised before and after; the first generated token, from the prefill, is not
in it) and tokens/s, the same over the loop's second half alone (`late_tokens_per_s`: a longer
decode's rate once a manager has learned the token), the weights' bytes, the cache kind; under
`gpu-prefetch-sched run`, what its executor
did inside the decode loop (`sched_loop`: bytes in and out, evictions, stalls, ...).

--accelerate offload|map: what a user would pick instead of a memory manager, Hugging Face
accelerate's offloading (the model is built on the GPU as above, so its weights are the same
bits, then moved to the host): ``offload`` is ``accelerate.cpu_offload`` (every weight on the
host, each module's copied in for its forward); ``map`` is ``dispatch_model`` over
``infer_auto_device_map`` with --gpu-bytes of GPU memory for weights (whole decoder layers; the
rest stay on the host and are copied in for each forward, as ``device_map`` with offload does).
The output adds ``gpu_peak_bytes`` (torch's peak allocated bytes inside the decode loop) and,
for ``map``, ``gpu_weight_bytes``.

--managed FRACTION: the fault-driven managed-memory baseline (scripts/bench_online_torch.py
--um), an EMULATION of the driver's eviction under pressure (gpuos_tools/memory/managed.py):
torch allocates CUDA managed memory (a CUDAPluggableAllocator over csrc/gpuos_um.c; the job
exits with status 81 rather than hold more managed memory than the GPU had free less
--managed-reserve), and a software budget of FRACTION of the managed bytes is kept by a
TorchDispatchMode from the model's construction to the end of the decode loop: before each
aten operation the blocks of its tensors are marked used and the least recently used whole
blocks are pushed to the host (cuMemPrefetchAsync, stream-ordered) until they fit; nothing is
prefetched back, so kernels fault evicted blocks in. --managed 1 evicts nothing (the hook's
own cost). The output adds `um` (the whole run's counts) and `um_loop` (inside the loop).
"""

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def sched_counts():
    """The counts of `gpu-prefetch-sched run`'s executor when this runs under it, else None
    (gpuos_tools.sched.executor.current_counts; the module is loaded only under the agent)."""
    mod = sys.modules.get("gpuos_tools.sched.executor")
    return mod.current_counts() if mod is not None else None


def delta(before, after):
    """What the executor did between two sched_counts() (None when not under it)."""
    if before is None or after is None:
        return None
    return {k: round(after[k] - before[k], 6) for k in before if k != "t"}


def make_cache(kind: str, config, length: int, dev, dtype):
    """(cache, kind used)."""
    from transformers import DynamicCache

    if kind == "static":
        try:
            from transformers import StaticCache

            params = inspect.signature(StaticCache.__init__).parameters
            kw = {"config": config, "max_cache_len": length}
            for name, value in (("max_batch_size", 1), ("batch_size", 1), ("device", dev), ("dtype", dtype)):
                if name in params:
                    kw[name] = value
            return StaticCache(**kw), "static"
        except Exception as exc:  # noqa: BLE001 (an older or newer transformers: say so, go on)
            print(f"torch_decode_job: no StaticCache ({type(exc).__name__}: {exc}); DynamicCache instead",
                  file=sys.stderr)
    return DynamicCache(), "dynamic"


def offload_with_accelerate(model, args, dev, dtype):
    """The model offloaded by accelerate (--accelerate): its weights moved to the host, then
    ``cpu_offload`` or ``dispatch_model`` over a device map with --gpu-bytes on the GPU."""
    import accelerate
    import torch

    model = model.to("cpu")
    torch.cuda.empty_cache()
    if args.accelerate == "offload":
        accelerate.cpu_offload(model, execution_device=dev)
        return model
    layer = type(model.model.layers[0]).__name__
    device_map = accelerate.infer_auto_device_map(model, max_memory={0: args.gpu_bytes, "cpu": 1 << 40},
                                                  no_split_module_classes=[layer], dtype=dtype)
    return accelerate.dispatch_model(model, device_map=device_map, main_device=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--mlp", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--cache", choices=("static", "dynamic"), default="static")
    ap.add_argument("--managed", type=float, default=0.0, metavar="FRACTION",
                    help="managed memory under a software budget of FRACTION of it (docstring)")
    ap.add_argument("--managed-reserve", type=int, default=1 << 30, metavar="BYTES",
                    help="--managed: GPU memory left free of managed memory (for what is not managed)")
    ap.add_argument("--accelerate", choices=("offload", "map"), default="",
                    help="Hugging Face accelerate's offloading instead (docstring)")
    ap.add_argument("--gpu-bytes", type=int, default=0, metavar="BYTES",
                    help="--accelerate map: GPU memory for weights (the rest offloaded to the host)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.accelerate == "map" and args.gpu_bytes <= 0:
        ap.error("--accelerate map needs --gpu-bytes")
    if args.accelerate and args.managed:
        ap.error("--accelerate and --managed are two different baselines: one at a time")

    import torch

    um = None
    hooked = contextlib.ExitStack()
    if args.managed:  # before torch's first CUDA allocation (and before transformers touches torch)
        from gpuos_tools.memory import managed

        um = managed.install_torch(args.managed, reserve=args.managed_reserve)
    from transformers import LlamaConfig, LlamaForCausalLM

    if um is not None:
        hooked.enter_context(um.mode())

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.mlp,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=max(4096, args.prompt + args.tokens),
                         tie_word_embeddings=False, use_cache=True)
    torch.manual_seed(0)
    t = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters created (and initialised) in bf16 on the GPU
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to(device=dev, dtype=dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    accel: dict = {}
    if args.accelerate:
        model = offload_with_accelerate(model, args, dev, dtype)
        accel = {"accelerate": args.accelerate, "accelerate_version": __import__("accelerate").__version__,
                 "gpu_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)}
    build_s = time.perf_counter() - t
    gen = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=gen).to(dev)
    cache, kind = make_cache(args.cache, config, args.prompt + args.tokens, dev, dtype)
    with torch.no_grad():
        pos = torch.arange(args.prompt, device=dev)
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, cache_position=pos)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks = [nxt]
        pos = pos[-1:] + 1
        torch.cuda.synchronize()
        if args.accelerate:
            torch.cuda.reset_peak_memory_stats()
        c0 = sched_counts()
        u0 = um.counts() if um else None
        n = args.tokens - 1
        t0 = t_half = time.perf_counter()
        for i in range(n):
            if i == n // 2:
                t_half = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True, cache_position=pos)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
            pos = pos + 1
        torch.cuda.synchronize()
        t_end = time.perf_counter()
        loop_s = t_end - t0
        late_s = t_end - t_half  # the second half: the final synchronize is in it, as in loop_s
        if args.accelerate:
            accel["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
        region = delta(c0, sched_counts())
        um_loop = delta(u0, um.counts() if um else None)
    hooked.close()
    ids = torch.cat(toks, dim=1)[0].tolist()
    res = {"workload": "llm_decode", "tokens": ids, "digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest(),
           "loop_s": round(loop_s, 6), "sched_loop": region, "decode_tokens": args.tokens - 1,
           "tokens_per_s": round((args.tokens - 1) / loop_s, 3) if loop_s > 0 else None,
           "late_tokens_per_s": round((n - n // 2) / late_s, 3) if late_s > 0 and n >= 2 else None,
           "weights_bytes": weights, "cache": kind, "build_s": round(build_s, 3),
           "layers": args.layers, "hidden": args.hidden, "mlp": args.mlp, "prompt": args.prompt,
           "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    res.update(accel)
    if um is not None:
        res.update(um=um.summary(), um_loop=um_loop)
    print(f"torch_decode_job: {weights / 2**30:.2f} GiB of weights, {kind} cache, {args.tokens - 1} tokens in "
          f"{loop_s:.3f} s", file=sys.stderr)
    text = json.dumps(res)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
