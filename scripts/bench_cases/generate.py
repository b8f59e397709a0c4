"""Text generation: gencli vs transformers on a GPT-2-124M-shaped (or, with ``--arch llama``, a
Llama-shaped) random model, greedy, batch 1.

``--quantize int8|int4`` runs gencli with weight-only quantized linear layers against the reference
in the dtype given (fp32 by default): the ratio is then quantized gencli over fp32 transformers.

Both sides load the same safetensors folder (written once by ``setup``) and generate the same number
of new tokens from the same prompt, ignoring end-of-sequence. Decode speed is measured the same way
on both sides: (time for N new tokens - time for 1 new token) / (N - 1), best of --repeat runs, so
prefill and per-call setup cancel out.
"""

from __future__ import annotations

import json
import random
import time

import torch

from bench_cases._util import device_and_dtype, peak_gpu_mb, sync

DESCRIPTION = "generate: GPT-2 124M shape or --arch llama (random weights), greedy, batch 1, --quantize int8|int4 (gencli vs transformers.generate)"
METRICS = {"decode_tokens_per_s": "higher", "decode_tokens_per_cpu_s": "higher", "prefill_tokens_per_s": "higher", "load_s": "lower"}


def _peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM belongs to the address space, which exec replaces:
    unlike getrusage's ru_maxrss it does not inherit the peak of the parent that built the inputs."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def add_arguments(p):
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2", help="llama: a Llama shape (--intermediate, --kv-heads, --vocab)")
    p.add_argument("--intermediate", type=int, default=None, help="llama: MLP width (default 2.75 x hidden)")
    p.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (default: all)")
    p.add_argument("--vocab", type=int, default=32000, help="llama: vocabulary size")
    p.add_argument("--quantize", choices=("int8", "int4"), default=None, help="gencli side: quantize the linear layers")
    p.add_argument("--group-size", type=int, default=None, help="int4 group size (default 32)")


def _byte_level_vocab(size: int, seed: int = 0) -> tuple[dict[str, int], list[str]]:
    """A valid GPT-2 style byte-level BPE vocabulary of ``size`` entries, built from random merges."""
    # GPT-2's printable stand-ins for the 256 bytes
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = [chr(c) for c in cs]
    seen = set(tokens)
    merges = []
    rng = random.Random(seed)
    while len(tokens) < size - 1:
        a, b = rng.choice(tokens[: min(len(tokens), 4000)]), rng.choice(tokens[:256])
        if len(a) + len(b) > 12 or (a + b) in seen:
            continue
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        seen.add(a + b)
    tokens.append("<|endoftext|>")
    return {t: i for i, t in enumerate(tokens)}, merges


def _reference_class(args):
    import transformers

    return transformers.LlamaForCausalLM if args.arch == "llama" else transformers.GPT2LMHeadModel


def setup(args, workdir):
    from transformers import GPT2Config, LlamaConfig

    torch.manual_seed(0)
    if args.arch == "llama":
        heads = args.hidden // 64
        cfg = LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or int(2.75 * args.hidden) // 64 * 64,
            num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=args.kv_heads or heads,
            max_position_embeddings=1024, tie_word_embeddings=False,
        )  # fmt: skip
    else:
        cfg = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64)  # vocab 50257, context 1024
    _reference_class(args)(cfg).save_pretrained(workdir / "gpt2", safe_serialization=True)
    vocab, merges = _byte_level_vocab(cfg.vocab_size)
    (workdir / "gpt2" / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (workdir / "gpt2" / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size - 1, (args.prompt_tokens,), generator=g).tolist()
    (workdir / "prompt.json").write_text(json.dumps(ids))


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    prompt = json.loads((workdir / "prompt.json").read_text())
    folder = workdir / "gpt2"
    n = args.new_tokens
    t0 = time.perf_counter()
    if side == "reference":
        model = _reference_class(args).from_pretrained(folder, dtype=dtype).to(device).eval()
        sync(device)
        load_s = time.perf_counter() - t0
        x = torch.tensor([prompt], device=device)

        def generate(k):
            with torch.inference_mode():
                out = model.generate(x, max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None, pad_token_id=0)
            return out[0, len(prompt) :].tolist()

    else:
        from gencli.pipelines.sampling import SamplingParams
        from gencli.pipelines.text import GenerationSettings, load_text_model
        from gencli.pipelines.text import generate as gencli_generate

        dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        tm = load_text_model(folder, device=str(device), dtype=dtype_name, threads=args.threads, quantize=args.quantize, group_size=args.group_size)
        sync(device)
        load_s = time.perf_counter() - t0

        def generate(k):
            settings = GenerationSettings(max_new_tokens=k, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
            return gencli_generate(tm, [("", prompt)], settings)[0].token_ids

    ids = generate(n)  # warm-up (and the ids to compare)
    generate(1)
    # wall-clock (what a user sees) and process CPU time (stable on a busy machine: with --threads 1
    # it is the work this side does, whatever else runs)
    wall = {1: float("inf"), n: float("inf")}
    cpu = {1: float("inf"), n: float("inf")}
    for _ in range(max(1, args.repeat)):
        for k in (1, n):
            sync(device)
            w, c = time.perf_counter(), time.process_time()
            generate(k)
            sync(device)
            wall[k] = min(wall[k], time.perf_counter() - w)
            cpu[k] = min(cpu[k], time.process_time() - c)
    result = {
        "decode_tokens_per_s": round((n - 1) / max(wall[n] - wall[1], 1e-9), 2),
        "decode_tokens_per_cpu_s": round((n - 1) / max(cpu[n] - cpu[1], 1e-9), 2),
        "prefill_tokens_per_s": round(len(prompt) / wall[1], 1),
        "load_s": round(load_s, 3),
        "new_tokens": len(ids),
        "ids_checksum": sum((i + 1) * t for i, t in enumerate(ids)) % 1_000_003,
        "peak_rss_mb": _peak_rss_mb(),
    }
    gpu = peak_gpu_mb(device)
    if gpu is not None:
        result["peak_gpu_mb"] = gpu
    return result
