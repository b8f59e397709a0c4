"""Builders for the text family's tests: random transformers checkpoints with real tokenizer files.

Each builder writes a folder laid out like a downloaded checkpoint (config.json, safetensors via
``save_pretrained``, tokenizer files, optional generation_config.json) and returns the reference
transformers model, so tests load the folder through gencli's own loading path.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café — ok.\n",
    "if x is None:\n    raise ValueError('x must be given')\n",
] * 20

QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1), encoding="utf-8")


def gpt2_bpe_files(folder: Path, vocab_size: int = 300) -> int:
    """GPT-2 style vocab.json + merges.txt (byte-level BPE) trained on CORPUS; returns the vocab size."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_model(str(folder))
    return tok.get_vocab_size()


def hf_json_tokenizer(folder: Path, specials: list[str], vocab_size: int = 300) -> int:
    """A byte-level BPE tokenizer.json with special tokens; returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


def sentencepiece_model(folder: Path, vocab_size: int = 320, add_dummy_prefix: bool = True) -> int:
    """A sentencepiece BPE tokenizer.model with byte fallback (Llama 2 conventions); returns the vocab size."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        add_dummy_prefix=add_dummy_prefix,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    return vocab_size


def gpt2_checkpoint(folder: Path, seed: int = 0, n_positions: int = 96):
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab = gpt2_bpe_files(folder)
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def llama_checkpoint(folder: Path, seed: int = 1, *, rope=None, tie: bool = False, kv_heads: int = 2, max_shard_size=None, max_positions: int = 128):
    """A Llama with GQA, untied embeddings and (by default) llama3 rope scaling, plus a sentencepiece tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = sentencepiece_model(folder)
    write_json(
        folder / "tokenizer_config.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "tokenizer_class": "LlamaTokenizer"},
    )
    if rope is None:
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=500000.0,
        rope_scaling=rope,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model


def qwen2_checkpoint(folder: Path, seed: int = 2):
    """A Qwen2-style model (q/k/v bias, tied embeddings) with a tokenizer.json and a chat template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = hf_json_tokenizer(folder, specials)
    write_json(
        folder / "tokenizer_config.json",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": QWEN_TEMPLATE, "tokenizer_class": "Qwen2Tokenizer"},
    )
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        bos_token_id=0,
        eos_token_id=2,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def three_text_models(root: Path) -> Path:
    """A GPT-2 (64 positions), a Llama and a Qwen2-style model under ``root`` (gpt2/, llama/, qwen2/)."""
    gpt2_checkpoint(root / "gpt2", n_positions=64)
    llama_checkpoint(root / "llama")
    qwen2_checkpoint(root / "qwen2")
    return root
