"""The CLIP BPE tokenizer: ids identical to transformers' CLIPTokenizer, CLIP's file format, training."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest

from gencli.tokenizers.clip_bpe import BOS, EOS, CLIPTokenizer, bytes_to_unicode, normalize, pre_tokenize, train_bpe

transformers = pytest.importorskip("transformers")

TRICKY = [
    "a photo of a cat.",
    "A Photo Of A CAT",
    "Hello, WORLD!!! It's 2024-05-01: 3.14159 dollars",
    "  multiple   spaces\tand\nnewlines  \r\n",
    "naïve café résumé ΟΔΟΣ İstanbul Straße ẞ",
    "日本語のテキスト 😀👍🏽 emoji",
    "don't won't they're I've we'll he'd she's IT'S",
    "'s 's's ''s !'s 'S",
    "x" * 300,
    " ".join(["word"] * 100),
    "<|endoftext|> inside <|startoftext|> text",
    "<|ENDOFTEXT|> normalised into the pattern",
    "",
    "   ",
    "a\x1cb a\u200bb a\u00a0b a\u2028b",
    "A\u0301 e\u0301 (combining accents)",
    "1234567890 ½ Ⅻ ٣",
    "$100 & 50% #hashtag @user <html> {json: [1, 2]}",
    "ﬁ ligature",
    "a red star at the top left on a blue background",
]


def _corpus() -> list[str]:
    """Some English prose that is on every machine: the standard library's module docstrings."""
    libdir = Path(ast.__file__).parent
    texts = []
    for f in sorted(libdir.glob("*.py"))[:80]:
        try:
            doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if doc:
            texts.append(doc)
    return texts + TRICKY


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cliptok")
    tok = train_bpe(_corpus(), 1500)
    tok.save(folder)
    return folder, tok


@pytest.fixture(scope="module")
def reference(trained):
    folder, _ = trained
    return transformers.CLIPTokenizer.from_pretrained(str(folder))


def test_ids_match_transformers_on_tricky_strings(trained, reference):
    folder, _ = trained
    tok = CLIPTokenizer.from_folder(folder)
    for text in TRICKY:
        assert tok.encode(text) == reference(text, truncation=True, max_length=77)["input_ids"], text


def test_ids_match_transformers_on_random_strings(trained, reference):
    folder, _ = trained
    tok = CLIPTokenizer.from_folder(folder)
    rng = random.Random(1234)
    alphabet = list("abcXYZ019 '\t\n.,!?-<|>_") + [
        "é", "É", "Σ", "ß", "日", "😀", "\u0301", "\u00a0", "\x1c", "\u2028", "\u200b", "٣", "Ⅻ", "½", "İ", "ﬁ",
        "\r\n", "'s", "'LL", "'ve", BOS, EOS, "<|ENDOFTEXT|>",
    ]  # fmt: skip
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert tok.encode(text) == reference(text, truncation=True, max_length=77)["input_ids"], repr(text)


def test_batch_padding_matches_transformers(trained, reference):
    folder, _ = trained
    tok = CLIPTokenizer.from_folder(folder)
    texts = ["a b c d", "a", "the quick brown fox"]
    for padding in ("longest", "max_length"):
        ours = tok(texts, padding=padding)
        ref = reference(texts, padding=padding, truncation=True, max_length=77)
        assert ours.input_ids == ref["input_ids"]
        assert ours.attention_mask == ref["attention_mask"]


def test_truncation_keeps_the_end_token(trained):
    _, tok = trained
    ids = tok.encode("word " * 200)
    assert len(ids) == 77 and ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert len(tok.encode("word " * 200, max_length=16)) == 16
    assert len(tok.tokenize_ids("word " * 200)) == 200


def test_decode_round_trips_normalised_text(trained):
    _, tok = trained
    for text in ("a photo of a cat.", "Straße 123 日本 😀", "don't stop"):
        assert tok.decode(tok.encode(text)).replace(" ", "") == "".join(pre_tokenize(normalize(text)))


def test_normalisation_and_pre_tokenisation_rules():
    assert normalize("A\u0301  B\t\nC\x1c") == "á b c\x1c"  # NFC, white-space runs, lower case; U+001C is not white space
    assert normalize("ΟΔΟΣ") == "οδοσ"  # per character: no final-sigma rule
    assert pre_tokenize("it's 2024!! ok") == ["it", "'s", "2", "0", "2", "4", "!!", "ok"]
    assert pre_tokenize("<|endoftext|>") == ["<|", "endoftext", "|>"]


def test_trained_vocabulary_has_clips_layout(trained, reference):
    folder, tok = trained
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    table = bytes_to_unicode()
    assert [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1])][:512] == [table[b] for b in range(256)] + [table[b] + "</w>" for b in range(256)]
    assert vocab[BOS] == len(vocab) - 2 and vocab[EOS] == len(vocab) - 1
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#version") and len(lines) - 1 == len(tok.ranks)
    # frequent words of the corpus became single tokens
    assert len(tok.tokenize_ids("the")) == 1
    assert reference.bos_token_id == tok.bos_token_id and reference.eos_token_id == tok.eos_token_id


def test_reads_a_bpe_tokenizer_json(trained, reference, tmp_path):
    folder, tok = trained
    reference.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text())
    from_json = CLIPTokenizer.from_folder(tmp_path)
    for text in TRICKY:
        assert from_json.encode(text) == tok.encode(text)


def test_missing_files_are_a_user_error(tmp_path):
    from gencli.errors import UserError

    with pytest.raises(UserError, match="vocab.json"):
        CLIPTokenizer.from_folder(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c\n")
    with pytest.raises(UserError, match="line 2"):
        CLIPTokenizer.from_folder(tmp_path)
