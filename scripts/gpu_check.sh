#!/usr/bin/env bash
# The GPU checks in one call (about 8 minutes on one H100): what CUDA runs that the CPU test suite
# cannot, and the GPU benchmark cases whose figures docs/benchmarks.md records.
#
#   bash scripts/gpu_check.sh [OUT_DIR]
#
# 1. the CUDA tests: the accelerator cases of the test suite, and the compiled decoding step (a static
#    KV cache replayed as a CUDA graph) giving the token ids of the eager step, greedy and sampled;
# 2. decode speed on a Llama-3.2-1B-shaped model (random weights) in bf16 against transformers, with
#    the bytes a token reads and the GPU's share of its bandwidth;
# 3. Stable Diffusion (SD-1.5-shaped UNet at 512x512, fp16, CFG) and the AutoencoderKL against diffusers.
# Each step's output goes to OUT_DIR (default: ./gpu-check) and to stdout; a failing step does not stop
# the later ones, and the exit code counts the failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
failed=0
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "== $name: exit $rc"; failed=$((failed + 1)); }
}

step environment 60 python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
step cuda-tests 150 python -m pytest -q -n 0 -p no:cacheprovider tests/test_backend_layers.py -k "accelerator or cuda" tests/test_static_decoding.py
step compiled-decoding 150 python - <<'EOF'
import sys, time
from pathlib import Path
import torch
sys.path.insert(0, "tests")
from _text_fixtures import llama_checkpoint
from gencli.backend.random import make_generator
from gencli.pipelines.text.generate import GenerationSettings, generate
from gencli.pipelines.text.loading import load_text_model
from gencli.pipelines.text.sampling import SamplingParams

folder = Path("/tmp/gencli-gpu-llama")
llama_checkpoint(folder, kv_heads=2)
tm = load_text_model(folder, device="cuda", dtype="float32")
prompts = [("", [5, 9, 13]), ("", [8, 3, 11, 17, 2, 6, 30])]
for temperature in (0.0, 0.9):
    runs = {}
    for compile in (False, True):
        s = GenerationSettings(max_new_tokens=48, sampling=SamplingParams(temperature=temperature), ignore_eos=True, compile=compile)
        t = time.perf_counter()
        runs[compile] = [c.token_ids for c in generate(tm, prompts, s, generator=make_generator(4)[0], on_info=print)]
        print(f"temperature {temperature} compile {compile}: {time.perf_counter() - t:.2f} s")
    print("identical ids:", runs[False] == runs[True])
    assert runs[False] == runs[True]
EOF
step decode-llama-1b 240 python scripts/bench.py generate --device cuda --dtype bfloat16 --arch llama --hidden 2048 --layers 16 \
    --kv-heads 8 --vocab 128256 --intermediate 8192 --new-tokens 128 --rounds 2
step txt2img-512 150 python scripts/bench.py txt2img --device cuda --dtype float16 --latent 64 --steps 10 --rounds 1
step vae-decode 90 python scripts/bench.py vae --device cuda --dtype float16
echo "== $failed step(s) failed"
exit "$failed"
