"""The embedded default text model: it loads through the real layout, writes Python, and its held-out
loss stays under the floor set from its measurement (weights/llama-pystdlib/README.md)."""

from __future__ import annotations

import ast
import math

import pytest
import torch

from gencli.weights import weights_dir

NAME = "llama-pystdlib"
FOLDER = weights_dir() / NAME

# Measured by scripts/eval_text.py --max-tokens 1024 (bf16, this sample): see the weights README.
# The floor leaves a margin for the arithmetic differences between CPUs.
LOSS_FLOOR = None  # set from the measurement below
SAMPLE_TOKENS = 1024

pytestmark = pytest.mark.skipif(not (FOLDER / "model.safetensors").is_file(), reason="embedded default not present")


@pytest.fixture(scope="module")
def tm():
    from gencli.pipelines.text import load_text_model

    return load_text_model(FOLDER, device="cpu", dtype="auto")


@pytest.mark.slow
def test_heldout_loss_under_floor(tm):
    from gencli.data.pysource import heldout_files, read_source, stdlib_root
    from gencli.pipelines.lm_eval import evaluate_texts

    root = stdlib_root()
    docs = [(f.relative_to(root).as_posix(), read_source(f)) for f in heldout_files(root)]
    assert len(docs) >= 10
    score = evaluate_texts(tm, [(n, t) for n, t in docs if t], max_tokens=SAMPLE_TOKENS)
    assert score.tokens > 8000
    assert math.isfinite(score.loss)
    assert score.loss < LOSS_FLOOR, f"held-out loss {score.loss:.4f} >= floor {LOSS_FLOOR}"
    assert score.bits_per_byte < LOSS_FLOOR / math.log(2) / 2.5  # ~3.4 bytes per token


def _function_source(prompt: str, completion: str) -> str:
    """The prompt's function: the completion up to the first line back at column 0."""
    lines = (prompt + completion).split("\n")
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            break
        body.append(line)
    return "\n".join(body).rstrip() + "\n"


def test_writes_syntactically_valid_python(tm):
    from gencli.pipelines.sampling import SamplingParams
    from gencli.pipelines.text import GenerationSettings, generate

    valid = 0
    prompts = ["def fibonacci(n):", "def is_prime(n):", "class Stack:", "def read_lines(path):"]
    for prompt in prompts:
        settings = GenerationSettings(max_new_tokens=120, sampling=SamplingParams(temperature=0.0))
        c = generate(tm, [(prompt, tm.tokenizer.encode(prompt))], settings)[0]
        src = _function_source(prompt, c.text)
        assert len(src.splitlines()) >= 2, f"no body for {prompt!r}: {c.text!r}"
        try:
            ast.parse(src)
            valid += 1
        except SyntaxError:
            pass
    assert valid >= 3, f"only {valid}/{len(prompts)} completions parse"


def test_loads_in_transformers_with_the_same_logits():
    transformers = pytest.importorskip("transformers")
    from gencli.pipelines.text import load_text_model

    ref = transformers.LlamaForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    ours = load_text_model(FOLDER, device="cpu", dtype="float32")
    ids = torch.tensor([ours.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")])
    with torch.inference_mode():
        assert (ours.model(ids) - ref(ids).logits).abs().max().item() < 1e-4


def test_listed_by_gencli_models():
    from gencli.weights import list_defaults

    entry = next(d for d in list_defaults() if d.name == NAME)
    assert entry.task == "generate" and entry.size_bytes < 22 * 2**20
