"""Text generation: gencli vs transformers on a GPT-2-124M-shaped (or, with ``--arch llama``, a
Llama-shaped) random model, greedy (or sampled: ``--temperature``, ``--top-k``, ``--top-p``), batch 1.

``--quantize int8|int4`` runs gencli with weight-only quantized linear layers against the reference
in the dtype given (fp32 by default): the ratio is then quantized gencli over fp32 transformers. A
list (``--quantize none,int8,int4``) runs one gencli side per mode in the same rounds. ``bf16`` in the
list is the gencli side loaded with ``--dtype bfloat16`` (on a CPU: bf16 linear weights, fp32
activations), beside the others; its llama.cpp counterpart is BF16.

``--llama-cpp`` adds llama.cpp (the ``llama_cpp`` Python bindings, llama-cpp-python) on the same
weights: the folder is converted to GGUF by llama.cpp's own ``convert_hf_to_gguf.py`` (from the
source tree ``--llama-cpp-source`` or ``$LLAMA_CPP_SOURCE``, e.g. the ``vendor/llama.cpp`` folder of
the llama-cpp-python source distribution) in F32 (BF16 with ``--dtype bfloat16``) and quantized by
``llama_model_quantize`` to Q8_0 and Q4_0 with llama.cpp's defaults; each gencli mode is compared
with its llama.cpp counterpart (none: F32, int8: Q8_0, int4: Q4_0), same prompt ids, greedy, the
same thread count. Without the bindings or the converter these sides are skipped with one line.

With ``--temperature`` above 0 every side samples with the same settings, each with its own sampler:
transformers' ``generate(do_sample=True)``, gencli's (a seeded generator), llama.cpp's sampler chain
(temperature, top-k, top-p, then its seeded draw, one native call a token), so the sides' tokens differ.

Both sides load the same safetensors folder (written once by ``setup``) and generate the same number
of new tokens from the same prompt, ignoring end-of-sequence. Decode speed is measured the same way
on both sides: (time for N new tokens - time for 1 new token) / (N - 1), best of --repeat runs, so
prefill and per-call setup cancel out.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_cases._util import device_and_dtype, peak_gpu_mb, sync

DESCRIPTION = "generate: GPT-2 124M shape or --arch llama (random weights), greedy or sampled, batch 1, --quantize int8|int4 (gencli vs transformers.generate)"
METRICS = {
    "decode_tokens_per_s": "higher",
    "decode_tokens_per_cpu_s": "higher",
    "prefill_tokens_per_s": "higher",
    "first_token_s": "lower",
    "first_token_cpu_s": "lower",
    "load_s": "lower",
}


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
    p.add_argument(
        "--quantize", type=_modes, default=None, help="gencli: int8, int4, bf16 (--dtype bfloat16), or a list such as none,bf16,int8,int4 (a side each)"
    )
    p.add_argument("--group-size", type=int, default=None, help="int4 group size (default 32)")
    p.add_argument("--head-screen", choices=("auto", "off"), default="auto", help="gencli: screen a large dense head (greedy, 128+ tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature on every side (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (1: off)")
    p.add_argument("--saved", action="store_true", help="gencli's quantized sides load folders 'gencli quantize' wrote (default: quantize on loading)")
    p.add_argument("--llama-cpp", action="store_true", help="add llama.cpp sides (llama-cpp-python) for the same modes: F32, Q8_0, Q4_0")
    p.add_argument("--llama-cpp-source", default=os.environ.get("LLAMA_CPP_SOURCE"), help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")


MODES = ("none", "bf16", "int8", "int4")
LLAMA_CPP_TYPES = {"none": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}  # the llama.cpp counterpart of each gencli mode


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes are {', '.join(MODES)}")
    return list(dict.fromkeys(modes))


def _gencli_modes(args) -> list[str]:
    return args.quantize or ["none"]


def _gencli_side(mode: str) -> str:
    return "gencli" if mode == "none" else f"gencli-{mode}"


def _llama_cpp_type(args, mode: str) -> str:
    return ("BF16" if args.dtype == "bfloat16" else "F32") if mode == "none" else LLAMA_CPP_TYPES[mode]


def _llama_cpp_missing(args) -> str | None:
    """Why the llama.cpp sides cannot run (None: they can)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # ImportError, or OSError when its shared library does not load
        return f"llama_cpp is not importable ({type(exc).__name__}: {exc}); build llama-cpp-python to add them"
    if args.device != "cpu":
        return "llama.cpp sides run on the CPU only"
    if not args.llama_cpp_source or not (Path(args.llama_cpp_source) / "convert_hf_to_gguf.py").is_file():
        return "no convert_hf_to_gguf.py: give --llama-cpp-source (or $LLAMA_CPP_SOURCE), a llama.cpp source tree"
    return None


def sides(args) -> list[str]:
    out = ["reference", *(_gencli_side(m) for m in _gencli_modes(args))]
    if args.llama_cpp:
        missing = _llama_cpp_missing(args)
        if missing is None:
            out += [f"llama.cpp-{_llama_cpp_type(args, m)}" for m in _gencli_modes(args)]
        elif not args.worker:
            print(f"llama.cpp sides skipped: {missing}", file=sys.stderr)
    return out


def comparisons(args) -> list[tuple[str, str]]:
    """Each gencli mode against transformers, and against its llama.cpp counterpart."""
    pairs = [(_gencli_side(m), "reference") for m in _gencli_modes(args)]
    pairs += [(_gencli_side(m), f"llama.cpp-{_llama_cpp_type(args, m)}") for m in _gencli_modes(args)]
    return pairs


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
    if args.saved:
        from gencli.pipelines.text.quantized_folder import quantize_checkpoint

        for mode in _gencli_modes(args):
            if mode not in ("none", "bf16"):
                quantize_checkpoint(workdir / "gpt2", _saved_folder(workdir, mode), mode, group_size=args.group_size)
    if args.llama_cpp and _llama_cpp_missing(args) is None:
        _write_gguf(args, workdir)


def _saved_folder(workdir: Path, mode: str) -> Path:
    return workdir / f"gpt2-{mode}"


# convert_hf_to_gguf.py names the BPE pre-tokenizer from the hash of a test string's tokens; the random
# byte-level vocabulary above is not one it knows, so it is told GPT-2's (the vocabulary is GPT-2 style
# and the benchmark feeds token ids, never text); a Llama folder without a SentencePiece model falls
# back to the same GPT-2 style vocabulary.
_CONVERT = """
import runpy, sys
source = sys.argv[1]
sys.path[:0] = [source, source + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [source + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _gguf_path(workdir: Path, kind: str) -> Path:
    return workdir / "gguf" / f"model-{kind}.gguf"


def _write_gguf(args, workdir: Path) -> None:
    """The benchmark folder as GGUF files, one per llama.cpp side (converted once, then quantized)."""
    import llama_cpp

    stage = workdir / "gguf" / "hf"
    stage.mkdir(parents=True)
    for f in (workdir / "gpt2").iterdir():
        if f.name != "config.json":
            (stage / f.name).symlink_to(f.resolve())
    config = json.loads((workdir / "gpt2" / "config.json").read_text())
    if config.get("model_type") == "gpt2":  # the converter reads GPT-2's context as n_ctx (older configs wrote it)
        config.setdefault("n_ctx", config["n_positions"])
    (stage / "config.json").write_text(json.dumps(config))
    # the converter reads the vocabulary through AutoTokenizer: a Llama config alone would ask for a
    # SentencePiece model, the files are GPT-2's byte-level BPE
    (stage / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    base = "bf16" if args.dtype == "bfloat16" else "f32"
    dense = _gguf_path(workdir, base.upper())
    cmd = [sys.executable, "-c", _CONVERT, str(Path(args.llama_cpp_source).resolve()), str(stage), "--outtype", base, "--outfile", str(dense)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not dense.is_file():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit("convert_hf_to_gguf.py failed")
    ftypes = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16}
    for mode in _gencli_modes(args):
        kind = _llama_cpp_type(args, mode)
        if kind in ftypes and kind != base.upper():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftypes[kind]
            params.nthread = args.threads or 0
            if llama_cpp.llama_model_quantize(str(dense).encode(), str(_gguf_path(workdir, kind)).encode(), params) != 0:
                raise SystemExit(f"llama_model_quantize to {kind} failed")


def _llama_cpp_generator(args, workdir: Path, kind: str, prompt: list[int]):
    """``(generate(k) -> ids, load seconds)`` for llama.cpp: greedy on the last position's logits, the
    prompt evaluated in one batch, one ``eval`` per further token (as gencli's prefill + decode steps)."""
    import llama_cpp
    import numpy as np

    threads = args.threads or os.cpu_count() or 1
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        str(_gguf_path(workdir, kind)), n_ctx=len(prompt) + args.new_tokens + 8, n_batch=max(512, len(prompt)),
        n_ubatch=max(512, len(prompt)), n_threads=threads, n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    sampler = None
    if args.temperature > 0:  # llama.cpp's own sampler chain, sampling natively from the last logits
        sampler = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(sampler, llama_cpp.llama_sampler_init_temp(args.temperature))
        if args.top_k > 0:
            llama_cpp.llama_sampler_chain_add(sampler, llama_cpp.llama_sampler_init_top_k(args.top_k))
        if args.top_p < 1.0:
            llama_cpp.llama_sampler_chain_add(sampler, llama_cpp.llama_sampler_init_top_p(args.top_p, 1))
        llama_cpp.llama_sampler_chain_add(sampler, llama_cpp.llama_sampler_init_dist(1234))

    def generate(k):
        llm.reset()  # the next eval drops the cached positions
        llm.eval(prompt)
        ids = []
        for i in range(k):
            if sampler is not None:
                ids.append(int(llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1)))
            else:
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
                ids.append(int(logits.argmax()))
            if i < k - 1:
                llm.eval([ids[-1]])
        return ids

    return generate, load_s


def _module_bytes_per_token(model: torch.nn.Module) -> int:
    """The bytes of weights one decoding step reads: every parameter and buffer once (the codes and
    scales of quantized layers as stored, the bf16 weights of packed layers), except an input
    embedding table not tied to the head, of which a token reads one row."""
    from gencli.backend.packed_linear import PackedLinear

    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen and t.numel() > 1:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, PackedLinear):  # its weight (oneDNN's layout) and bias are plain attributes
            total += 2 * m.in_features * m.out_features + (0 if m.bias is None else 2 * m.out_features)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    if embed is not None and getattr(head, "weight", None) is not None and embed.weight.data_ptr() != head.weight.data_ptr():
        total -= embed.weight.numel() * embed.weight.element_size() - embed.weight[0].numel() * embed.weight.element_size()
    return total


def _gguf_bytes_per_token(workdir: Path, kind: str, folder: Path) -> int:
    """llama.cpp's counterpart of :func:`_module_bytes_per_token`, from the GGUF file's size: the share
    of an untied input embedding table (read one row a token) taken out in proportion."""
    size = _gguf_path(workdir, kind).stat().st_size
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("tie_word_embeddings", True) and cfg.get("model_type") == "gpt2":
        return size
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    params = sum(int(torch.tensor(s).prod()) for s in shapes.values())
    embed = next((s for k, s in shapes.items() if k.endswith("embed_tokens.weight")), None)
    return int(size * (1 - embed[0] * embed[1] / params)) if embed else size


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    prompt = json.loads((workdir / "prompt.json").read_text())
    folder = workdir / "gpt2"
    n = args.new_tokens
    t0 = time.perf_counter()
    if side.startswith("llama.cpp-"):
        generate, load_s = _llama_cpp_generator(args, workdir, side[len("llama.cpp-") :], prompt)
    elif side == "reference":
        model = _reference_class(args).from_pretrained(folder, dtype=dtype).to(device).eval()
        sync(device)
        load_s = time.perf_counter() - t0
        x = torch.tensor([prompt], device=device)
        sampling = {"do_sample": False}
        if args.temperature > 0:
            sampling = {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}

        def generate(k):
            with torch.inference_mode():
                out = model.generate(x, max_new_tokens=k, min_new_tokens=k, eos_token_id=None, pad_token_id=0, **sampling)
            return out[0, len(prompt) :].tolist()

    else:
        from gencli.pipelines.text.generate import GenerationSettings
        from gencli.pipelines.text.generate import generate as gencli_generate
        from gencli.pipelines.text.loading import load_text_model
        from gencli.pipelines.text.sampling import SamplingParams

        dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        mode = side[len("gencli-") :] if side.startswith("gencli-") else None
        if mode == "bf16":  # not a quantization: the model loaded in bf16 (on a CPU: bf16 linear weights, fp32 activations)
            dtype_name, mode = "bfloat16", None
        if mode is not None and args.saved:  # quantized already: loads without quantizing again
            folder, mode = _saved_folder(workdir, mode), None
        tm = load_text_model(folder, device=str(device), dtype=dtype_name, threads=args.threads, quantize=mode, group_size=args.group_size)
        if args.head_screen == "off":  # the whole head every step (native or from Python)
            from gencli.pipelines.text import generate as generate_module

            generate_module.screens_natively = lambda *a, **k: False
            generate_module.screen_for = lambda *a, **k: None
        sync(device)
        load_s = time.perf_counter() - t0

        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)

        def generate(k):
            settings = GenerationSettings(max_new_tokens=k, sampling=params, ignore_eos=True)
            gen = torch.Generator().manual_seed(1234) if args.temperature > 0 else None
            return gencli_generate(tm, [("", prompt)], settings, generator=gen)[0].token_ids

    if side.startswith("llama.cpp-"):
        weight_bytes = _gguf_bytes_per_token(workdir, side[len("llama.cpp-") :], folder)
    else:
        weight_bytes = _module_bytes_per_token(model if side == "reference" else tm.model)
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
        # time to the first token: the prompt's prefill and the first choice (process CPU time too)
        "first_token_s": round(wall[1], 4),
        "first_token_cpu_s": round(cpu[1], 4),
        "load_s": round(load_s, 3),
        "new_tokens": len(ids),
        "ids_checksum": sum((i + 1) * t for i, t in enumerate(ids)) % 1_000_003,
        "peak_rss_mb": _peak_rss_mb(),
        # bytes of weights one decoded token reads (bench.py turns it into a share of the bandwidth)
        "weight_bytes_per_token": weight_bytes,
    }
    gpu = peak_gpu_mb(device)
    if gpu is not None:
        result["peak_gpu_mb"] = gpu
    return result
