"""lorapage's Tokenizer agrees with transformers, and streamed text agrees with decode()."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers, processors

from lorapage.errors import InvalidRequestError
from lorapage.model.tokenizer import IncrementalDecoder, Tokenizer
from lorapage.tiny import TINY_BASE_DIR

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello",
    "",
    " leading and trailing spaces ",
    "multi\nline\n\ttabs",
    "emoji 🙂🚀✨ and CJK 中文字 日本語 한국어",
    "accents: éèêë ñ ß ø",
    "special <|user|> inline<|endoftext|>",
    "That's it!! (really?) 12345",
]
CHATS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you? 🙂"}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "This is the tiny base model."},
        {"role": "user", "content": "again"},
    ],
]
LLAMA2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


# --- tokenizers built here, shaped like real model families ----------------------------------


def write_tokenizer_dir(path: Path, backend: Backend, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    return path


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory) -> Path:
    """A Llama-2-style tokenizer.json: BPE with byte fallback, '▁' for spaces, BOS added."""
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzHTW.,!?'"]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w"), ("o", "r"), ("l", "d"), ("▁w", "or"), ("▁wor", "ld")]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in pieces + ["".join(m) for m in merges]:
        vocab.setdefault(piece, len(vocab))
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": LLAMA2_TEMPLATE,
    }
    return write_tokenizer_dir(tmp_path_factory.mktemp("sentencepiece"), backend, config)


def byte_chars(text: str) -> str:
    """``text`` in byte-level BPE's alphabet (one printable character per UTF-8 byte)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]


@pytest.fixture(scope="module")
def bytelevel_bpe_dir(tmp_path_factory) -> Path:
    """A Llama-3/Qwen2-style byte-level BPE whose merges stop inside multi-byte characters."""
    zhong, smile = byte_chars("中"), byte_chars("🙂")  # 3 and 4 bytes
    merges = [
        ("t", "h"),
        ("th", "e"),
        (byte_chars(" "), "w"),
        (zhong[0], zhong[1]),
        (smile[0], smile[1]),
        (smile[2], smile[3]),
    ]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|begin_of_text|>", "<|eot_id|>")]
    )
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True}
    path = write_tokenizer_dir(tmp_path_factory.mktemp("bytelevel"), backend, config)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [bos + 1, 0]}))
    return path


@pytest.fixture(scope="module", params=["tiny", "sentencepiece", "bytelevel_bpe"])
def pair(request) -> tuple[Tokenizer, object]:
    """(ours, transformers') for the same directory."""
    path = TINY_BASE_DIR if request.param == "tiny" else request.getfixturevalue(f"{request.param}_dir")
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


# --- agreement with transformers -------------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair, skip_special_tokens):
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.backend.decode(ids, skip_special_tokens) == hf.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), text


def test_tiny_chat_template_matches_transformers():
    ours, hf = Tokenizer.from_dir(TINY_BASE_DIR), transformers.AutoTokenizer.from_pretrained(TINY_BASE_DIR)
    for chat in CHATS:
        for gen in (True, False):
            expected = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected
    rendered = ours.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert rendered == "<|startoftext|><|system|>S\n<|user|>U\n<|assistant|>"


def test_template_exceptions_are_request_errors(sentencepiece_dir):
    ours = Tokenizer.from_dir(sentencepiece_dir)
    hf = transformers.AutoTokenizer.from_pretrained(sentencepiece_dir)
    chat = [
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "x"},
    ]
    assert ours.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False)
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])
    with pytest.raises(InvalidRequestError, match="role must be"):
        Tokenizer.from_dir(TINY_BASE_DIR).apply_chat_template([{"role": "tool", "content": "x"}])


def test_special_ids_and_vocab(pair):
    ours, hf = pair
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.vocab_size == len(hf)


def test_eos_ids_include_the_model_configs(bytelevel_bpe_dir):
    ours = Tokenizer.from_dir(bytelevel_bpe_dir)
    eot = ours.backend.token_to_id("<|eot_id|>")
    assert ours.eos_token_ids == (eot, 0)  # tokenizer_config's <|eot_id|> first, then generation_config's
    assert Tokenizer.from_dir(TINY_BASE_DIR).eos_token_ids == (257,)


def test_no_chat_template_is_a_clear_error(bytelevel_bpe_dir):
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_dir(bytelevel_bpe_dir).apply_chat_template([{"role": "user", "content": "x"}])


# --- streaming -------------------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int] = (), skip_special_tokens: bool = True) -> list[str]:
    dec = IncrementalDecoder(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    return [dec.push(t) for t in ids] + [dec.flush()]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_concatenates_to_decode(pair, skip_special_tokens):
    ours, _ = pair
    for text in TEXTS:
        ids = ours.encode(text)
        deltas = stream(ours, ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == ours.backend.decode(ids, skip_special_tokens), text
        assert not any("\ufffd" in d for d in deltas), text  # valid text never shows a half character


def test_stream_holds_back_a_split_character():
    tok = Tokenizer.from_dir(TINY_BASE_DIR)
    ids = tok.encode("a🙂b", add_special_tokens=False)  # one token per byte: the emoji is 4 tokens
    assert len(ids) == 6
    assert stream(tok, ids) == ["a", "", "", "", "🙂", "b", ""]


def test_bytelevel_stream_across_merged_partial_characters(bytelevel_bpe_dir):
    tok = Tokenizer.from_dir(bytelevel_bpe_dir)
    ids = tok.encode("the 中🙂 world", add_special_tokens=False)
    assert "\ufffd" in tok.backend.decode(ids[2:3])  # a token that is only part of 中
    assert "".join(stream(tok, ids)) == "the 中🙂 world"
    assert stream(tok, ids)[2:5] == ["", "中", ""]


def test_stream_with_prompt_context():
    tok = Tokenizer.from_dir(TINY_BASE_DIR)
    prompt = tok.encode(tok.apply_chat_template(CHATS[1]), add_special_tokens=False)
    answer = tok.encode("中文 🙂 ok", add_special_tokens=False) + [tok.eos_token_id]
    assert "".join(stream(tok, answer, prompt)) == tok.backend.decode(answer)


def test_sentencepiece_stream_keeps_the_leading_space_after_a_prompt(sentencepiece_dir):
    tok = Tokenizer.from_dir(sentencepiece_dir)
    prompt = tok.encode("Hello")
    answer = tok.encode("the world 🙂", add_special_tokens=False)
    assert "".join(stream(tok, answer)) == tok.backend.decode(answer) == "the world 🙂"
    assert "".join(stream(tok, answer, prompt)) == " the world 🙂"


def test_stream_of_random_bytes_concatenates_to_decode():
    """Any id sequence, invalid UTF-8 included: what is streamed is exactly what decode() gives."""
    tok = Tokenizer.from_dir(TINY_BASE_DIR)
    rng = random.Random(0)
    utf8_heavy = [*range(0x80, 0xC0), *range(0xC2, 0xF5), *b"ab "]
    for _ in range(200):
        ids = [
            rng.choice(utf8_heavy) if rng.random() < 0.9 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(1, 24))
        ]
        for skip in (True, False):
            assert "".join(stream(tok, ids, skip_special_tokens=skip)) == tok.backend.decode(ids, skip)
