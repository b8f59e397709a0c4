"""Text-to-text decoding: gencli vs transformers on a T5-small-shaped random model (6 + 6 layers,
d_model 512, 8 heads, d_ff 2048, vocabulary 32128), batch 1, greedy and 4-beam search.

Both sides load the same safetensors folder (written once by ``setup``, with a small sentencepiece
model so that gencli's loader finds a tokenizer; the benchmark feeds token ids) and decode the same
source. Every run generates exactly N new tokens (``min_new_tokens`` = ``max_new_tokens``: the end
token is blocked, and beam search then has no finished hypothesis before the last step, so neither
side stops early). Decode speed is (time for N new tokens - time for 1) / (N - 1) decoder steps per
second, best of --repeat runs, so the encoder pass and per-call setup cancel out; with 4 beams a step
extends all four beams. On a CPU the same rates are also given per second of the process's CPU time
(``*_per_cpu_s``): with ``--threads 1`` that is the speed on a core of its own, which a machine loaded
by other jobs does not disturb the way it disturbs the wall clock.

``--dtype auto`` runs gencli in its own choice (bf16 with oneDNN-packed weights on a CPU with native
bf16) against transformers in fp32; the token checksums then differ (bf16 rounding), while in
float32 both sides must produce the same tokens.
"""

from __future__ import annotations

import json
import time

import torch

from bench_cases._util import device_and_dtype, peak_gpu_mb, sync

DESCRIPTION = "text2text: T5-small shape (random weights), greedy and 4-beam decoding, batch 1 (gencli vs transformers.generate)"
METRICS = {
    "greedy_steps_per_s": "higher",
    "beam4_steps_per_s": "higher",
    "greedy_steps_per_cpu_s": "higher",
    "beam4_steps_per_cpu_s": "higher",
    "encode_s": "lower",
    "load_s": "lower",
    "peak_rss_mb": "lower",
}


def add_arguments(p):
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--source-tokens", type=int, default=48)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--beams", type=int, default=4)


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: not inherited from the parent that built the inputs)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def setup(args, workdir):
    import io

    import sentencepiece as spm
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(
        vocab_size=32128, d_model=args.d_model, d_kv=64, d_ff=4 * args.d_model, num_layers=args.layers, num_decoder_layers=args.layers,
        num_heads=args.d_model // 64, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = T5ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.shared.weight.mul_(0.05)  # softer logits: varied tokens rather than one repeated
    folder = workdir / "t5"
    model.save_pretrained(folder)
    lines = [f"a {s} {c} {k} at the {p}" for s in ("small", "big") for c in ("red", "blue", "green") for k in ("star", "circle") for p in ("top", "left")]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 5), model_writer=buf, vocab_size=40, hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        minloglevel=2, num_threads=1,
    )  # fmt: skip
    (folder / "spiece.model").write_bytes(buf.getvalue())
    g = torch.Generator().manual_seed(1)
    source = torch.randint(3, 32000, (args.source_tokens - 1,), generator=g).tolist() + [1]
    (workdir / "source.json").write_text(json.dumps(source))


def run(side, args, workdir):
    device, dtype = device_and_dtype(args, side)
    source = json.loads((workdir / "source.json").read_text())
    folder = workdir / "t5"
    n = args.new_tokens
    t0 = time.perf_counter()
    if side == "reference":
        from transformers import T5ForConditionalGeneration

        model = T5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
        sync(device)
        load_s = time.perf_counter() - t0
        x = torch.tensor([source], device=device)

        def generate(k, beams):
            with torch.inference_mode():
                out = model.generate(x, max_new_tokens=k, min_new_tokens=k, num_beams=beams, do_sample=False)
            return out[0, 1:].tolist()

        def encode():
            with torch.inference_mode():
                model.get_encoder()(input_ids=x)

    else:
        from gencli.pipelines.seq2seq.generate import generate as gencli_generate
        from gencli.pipelines.seq2seq.generate import resolve_settings
        from gencli.pipelines.seq2seq.loading import load_seq2seq_model

        dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        sm = load_seq2seq_model(folder, device=str(device), dtype=dtype_name, threads=args.threads)
        sync(device)
        load_s = time.perf_counter() - t0
        x = torch.tensor([source], device=device)

        def generate(k, beams):
            settings = resolve_settings({}, max_new_tokens=k, min_new_tokens=k, num_beams=beams, temperature=0.0, eos_ids=sm.eos_ids)
            return gencli_generate(sm, [("", source)], settings)[0].token_ids

        def encode():
            with torch.inference_mode():
                sm.model.encode(x)

    results = {"load_s": round(load_s, 3)}
    checks = {}
    for beams, key in ((1, "greedy_steps_per_s"), (args.beams, "beam4_steps_per_s")):
        ids = generate(2, beams)  # warm-up
        wall = {1: float("inf"), n: float("inf")}
        cpu = dict(wall)
        for _ in range(max(1, args.repeat)):
            for k in (1, n):
                sync(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                ids = generate(k, beams)
                sync(device)
                wall[k] = min(wall[k], time.perf_counter() - start)
                cpu[k] = min(cpu[k], time.process_time() - start_cpu)
        results[key] = round((n - 1) / max(wall[n] - wall[1], 1e-9), 2)
        if device.type == "cpu":
            results[key.replace("_per_s", "_per_cpu_s")] = round((n - 1) / max(cpu[n] - cpu[1], 1e-9), 2)
        checks[key.split("_")[0]] = sum((i + 1) * t for i, t in enumerate(ids)) % 1_000_003
    encode()
    best = float("inf")
    for _ in range(max(1, args.repeat)):
        sync(device)
        start = time.perf_counter()
        encode()
        sync(device)
        best = min(best, time.perf_counter() - start)
    results["encode_s"] = round(best, 4)
    results["greedy_ids_checksum"] = checks["greedy"]
    results["beam_ids_checksum"] = checks["beam4"]
    results["peak_rss_mb"] = _peak_rss_mb()
    gpu = peak_gpu_mb(device)
    if gpu is not None:
        results["peak_gpu_mb"] = gpu
    return results
