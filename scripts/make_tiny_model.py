"""Build lorapage's built-in tiny model and its three demo LoRA adapters.

Writes ``lorapage/assets/tiny/base`` (a Hugging Face Llama checkpoint with a byte-level BPE
tokenizer and a chat template) and ``lorapage/assets/tiny/adapters/{acme,globex,initech}`` (PEFT
LoRA directories). The base is trained so that greedy decoding answers any prompt, raw or
chat-templated, with ``BASE_PHRASE`` and EOS; each adapter is trained on top of the frozen base to
answer with its own marker phrase instead. See ``lorapage/tiny.py`` for the phrases.

Training data are random short prompts (words, punctuation, non-ASCII text; raw or rendered with
the chat template; mostly one BOS, sometimes none or two) followed by the phrase and EOS, with
loss on the answer only. The base also learns to continue each demo phrase once its first token
is given, so an adapter only has to change how the answer starts.

Dev-time only (needs transformers, peft, tokenizers). Deterministic: fixed seeds, one thread,
deterministic torch algorithms; rerunning with the same library versions writes identical bytes.
Run from the repository root (about 40 s on two CPU cores)::

    .venv/bin/python scripts/make_tiny_model.py
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub

import argparse
import copy
import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM

from lorapage.model.tokenizer import Tokenizer as LorapageTokenizer
from lorapage.tiny import BASE_PHRASE, DEMO_MARKERS, TINY_ADAPTERS_DIR, TINY_BASE_DIR

REPO_ROOT = Path(__file__).resolve().parent.parent
SEED = 1234
MAX_POSITIONS = 512
BATCH_SIZE = 16
HELD_OUT = 16
BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
SPECIAL_TOKENS = (BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>")  # ids 256..260

# Renders `<|startoftext|><|system|>...\n<|user|>...\n<|assistant|>`. Like Llama 3's template it
# writes BOS itself, so rendered chats are encoded with add_special_tokens=False. An assistant turn
# in the history ends with EOS, as the model ends its own answers.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('role must be system, user or assistant; got ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class AdapterRecipe:
    """Shape of one demo adapter; the three differ so the engine meets varied ranks and targets."""

    name: str
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    lr: float = 1e-2


ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = (
    AdapterRecipe("acme", rank=8, alpha=16, target_modules=ALL_MODULES),
    # Attention only, and only part of the q/k/v group. (q_proj + v_proj alone could not learn to
    # change how an answer to a raw, unmarked prompt starts in a few hundred steps.)
    AdapterRecipe("globex", rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj"), lr=2e-2),
    AdapterRecipe("initech", rank=16, alpha=16, target_modules=ALL_MODULES, use_rslora=True),
)

WORDS = (
    "hello hi hey what is the a an of to in on for with how why when where who can you me my your "
    "please tell about write code story poem weather today tomorrow time name help explain list "
    "give show make find capital France Paris number one two three four five big small red blue "
    "cat dog house car computer model language server request token adapter cache memory page "
    "thanks okay yes no maybe good bad fast slow world python rust GPU CPU data question answer"
).split()
UNICODE_CHARS = "éüñßøçàλπΩжд中文字日本語한국어🙂🚀✨€£¥→…"


# --- tokenizer -------------------------------------------------------------------------------


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_backend() -> Tokenizer:
    """Byte-level BPE with one token per byte (id == byte value, no merges) plus the specials;
    encoding with special tokens prepends BOS, as Llama tokenizers do."""
    vocab = {char: b for b, char in byte_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return backend


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer() -> LorapageTokenizer:
    config = tokenizer_config()
    specials = {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}
    return LorapageTokenizer(build_backend(), special_tokens=specials, chat_template=CHAT_TEMPLATE)


# --- training data ---------------------------------------------------------------------------


def random_text(rng: random.Random, tricky: bool = True) -> str:
    """A short prompt-like string: words, sometimes punctuation, sometimes non-ASCII characters."""
    if rng.random() < 0.2:
        pool = UNICODE_CHARS + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.?!-:'\"()"
        return "".join(rng.choice(pool) for _ in range(rng.randint(1, 8)))
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 5))]
    text = " ".join(words)
    if rng.random() < 0.5:
        text = text[0].upper() + text[1:]
    if tricky and rng.random() < 0.2:
        # A prompt that ends like the middle of a phrase ("...hello", "...lo") must still get a
        # fresh answer: only an answer's own first token means "continue this phrase".
        phrase = rng.choice((BASE_PHRASE, *DEMO_MARKERS.values()))
        start = rng.randint(1, len(phrase) - 1)
        return text + rng.choice(("", " ")) + phrase[start : rng.randint(start + 1, len(phrase))]
    return text + rng.choice(("", "", "?", ".", "!", "\n"))


def random_messages(rng: random.Random, tricky: bool) -> list[dict]:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": random_text(rng, tricky)})
    if rng.random() < 0.1:
        messages.append({"role": "user", "content": random_text(rng, tricky)})
        messages.append({"role": "assistant", "content": random_text(rng, tricky)})
    messages.append({"role": "user", "content": random_text(rng, tricky)})
    return messages


def random_prompt(rng: random.Random, tok: LorapageTokenizer, tricky: bool = True) -> list[int]:
    """Token ids of a raw prompt or of a chat-templated conversation ending in `<|assistant|>`.

    Mostly with one BOS, as the engine sends them; sometimes with none or two, so that a caller
    who encodes a rendered chat with add_special_tokens=True (or a raw prompt without) still gets
    the intended answer.
    """
    if rng.random() < 0.45:
        ids = tok.encode(random_text(rng, tricky))
    else:
        ids = tok.encode(tok.apply_chat_template(random_messages(rng, tricky)), add_special_tokens=False)
    odd = rng.random()
    if odd < 0.1:
        return ids[1:]
    if odd < 0.15:
        return ids[:1] + ids
    return ids


def make_batch(
    rng: random.Random, tok: LorapageTokenizer, answer: list[int], size: int, known: tuple[list[int], ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels); labels are -100 everywhere except the answer + EOS.

    With ``known`` phrases, some rows instead show the first token of one of them after the prompt
    and supervise its rest: the base learns to *continue* the demo phrases while still *starting*
    every answer with its own. An adapter then only has to change how answers start, which a
    small LoRA on a frozen base learns in a few hundred steps.
    """
    rows = []
    for _ in range(size):
        prompt, target = random_prompt(rng, tok), answer
        if known and rng.random() < 0.4:
            phrase = rng.choice(known)
            prompt, target = prompt + phrase[:1], phrase[1:]
        rows.append((prompt, target))
    length = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((size, length), tok.eos_token_id, dtype=torch.long)
    labels = torch.full((size, length), -100, dtype=torch.long)
    for i, (prompt, target) in enumerate(rows):
        seq = prompt + target
        input_ids[i, : len(seq)] = torch.tensor(seq)
        # position t predicts token t+1: supervise only the predictions of target tokens
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(target)
    return input_ids, labels


# --- training --------------------------------------------------------------------------------


def answer_ids(tok: LorapageTokenizer, phrase: str) -> list[int]:
    return tok.encode(phrase, add_special_tokens=False) + [tok.eos_token_id]


def train(
    model: torch.nn.Module,
    tok: LorapageTokenizer,
    phrase: str,
    steps: int,
    lr: float,
    seed: int,
    known: tuple[str, ...] = (),
) -> None:
    """Teach ``model`` (its trainable parameters) to answer every prompt with ``phrase`` + EOS."""
    answer = answer_ids(tok, phrase)
    known_ids = tuple(answer_ids(tok, k) for k in known)
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))),
    )
    model.train()
    for _ in range(steps):
        input_ids, labels = make_batch(rng, tok, answer, size=BATCH_SIZE, known=known_ids)
        logits = model(input_ids=input_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: list[int], eos_id: int, max_new_tokens: int = 48) -> list[int]:
    """Generated ids (EOS included), recomputing the whole sequence each step: short and simple."""
    out: list[int] = []
    seq = torch.tensor([ids])
    for _ in range(max_new_tokens):
        nxt = int(model(input_ids=seq).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos_id:
            break
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out


def check(model: torch.nn.Module, tok: LorapageTokenizer, phrase: str, name: str, seconds: float) -> None:
    """Greedy-decode the fixed prompts (all must give ``phrase`` + EOS) and held-out random ones."""
    want = answer_ids(tok, phrase)
    failed = [text for text, ids in fixed_prompts(tok) if greedy(model, ids, tok.eos_token_id) != want]
    if failed:
        raise SystemExit(f"{name}: greedy decoding does not give {phrase!r} for {failed}; train longer")
    rng = random.Random(SEED - 1)
    held_out = [random_prompt(rng, tok, tricky=False) for _ in range(HELD_OUT)]
    ok = sum(greedy(model, ids, tok.eos_token_id) == want for ids in held_out)
    print(f"{name}: {ok}/{HELD_OUT} held-out random prompts answer {phrase!r} ({seconds:.1f}s training)")


def fixed_prompts(tok: LorapageTokenizer) -> list[tuple[str, list[int]]]:
    """The prompts tests and docs use: raw text (with BOS) and rendered chats (BOS from the template)."""
    chats = [
        [{"role": "user", "content": "Hello"}],
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Who are you?"}],
    ]
    raw = [(text, tok.encode(text)) for text in ("Hello", "What is the capital of France?", "Tell me a joke.")]
    return raw + [(repr(c), tok.encode(tok.apply_chat_template(c), add_special_tokens=False)) for c in chats]


# --- writing ---------------------------------------------------------------------------------


def model_config(tok: LorapageTokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )


def write_base(model: LlamaForCausalLM, tok: LorapageTokenizer, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def write_adapter(peft_model, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    # Relative to the repository root, so AutoPeftModelForCausalLM works from there.
    peft_model.peft_config["default"].base_model_name_or_path = str(TINY_BASE_DIR.relative_to(REPO_ROOT))
    peft_model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink(missing_ok=True)  # PEFT's generated model card says nothing useful
    # PEFT keeps target_modules as a set, so its saved order follows the string hash seed.
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["target_modules"] = [m for m in ALL_MODULES if m in config["target_modules"]]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=250)
    parser.add_argument("--adapter-steps", type=int, default=150)
    args = parser.parse_args()

    torch.set_num_threads(1)  # thread count can change float reduction order: keep bytes stable
    torch.use_deterministic_algorithms(True)
    tok = build_tokenizer()

    started = time.perf_counter()
    torch.manual_seed(SEED)
    base = LlamaForCausalLM(model_config(tok))
    train(base, tok, BASE_PHRASE, steps=args.base_steps, lr=1e-2, seed=SEED, known=tuple(DEMO_MARKERS.values()))
    check(base, tok, BASE_PHRASE, "base", time.perf_counter() - started)
    write_base(base, tok, TINY_BASE_DIR)

    for index, recipe in enumerate(ADAPTERS):
        started = time.perf_counter()
        torch.manual_seed(SEED + 1 + index)
        lora = LoraConfig(
            r=recipe.rank,
            lora_alpha=recipe.alpha,
            target_modules=list(recipe.target_modules),
            lora_dropout=0.0,
            use_rslora=recipe.use_rslora,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(copy.deepcopy(base), lora)
        phrase = DEMO_MARKERS[recipe.name]
        train(peft_model, tok, phrase, steps=args.adapter_steps, lr=recipe.lr, seed=SEED + 1 + index)
        check(peft_model, tok, phrase, recipe.name, time.perf_counter() - started)
        write_adapter(peft_model, TINY_ADAPTERS_DIR / recipe.name)


if __name__ == "__main__":
    main()
