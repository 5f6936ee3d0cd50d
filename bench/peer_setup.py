"""What the peer benchmarks share (``bench_llamacpp.py``, ``bench_peft.py``): the model, its tokenizer
and adapters, lorapage run through its public embedded API, transformers + PEFT run as a peer and as
the reference every engine's greedy tokens are checked against, and the table of rates.

The model has issue 27's shape (hidden 512, 4 layers, 8 heads / 4 KV heads, FFN 1,408, vocab 4,096,
float32, random weights) and a Llama-2-style tokenizer (byte-fallback BPE), the kind llama.cpp's
converter reads as an SPM vocabulary. Every engine is fed token ids, so the tokenizer only has to be
one the converters and engines accept. Adapters are rank-16 PEFT LoRA on all seven modules.
"""

from __future__ import annotations

import asyncio
import json
import string
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from harness import median
from make_llama import write_adapter, write_model
from workloads import prompt

from lorapage import Engine, EngineConfig, SamplingParams

SHAPE = dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408, vocab=4096)
RANK = 16
# A and B drawn at 0.03: the adapter moves the logits about as much as the base spreads them, so a
# wrong or missing adapter shows in the greedy tokens (at make_llama's 0.01 most first tokens stay the base's).
ADAPTER_STD = 0.03
PROMPT_LEN = 8
Rows = Sequence[tuple[list[int], str | None]]  # (prompt ids, adapter name or None for the base)


def write_llama_tokenizer(path: Path, vocab_size: int) -> Path:
    """A Llama-2-style ``tokenizer.json`` of exactly ``vocab_size`` tokens: ``<unk> <s> </s>``, the 256
    byte tokens, ``▁`` and the letters, then ``▁``-words grown a letter at a time (each with its merge)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    specials = ["<unk>", "<s>", "</s>"]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), "▁", *string.ascii_lowercase]
    merges: list[tuple[str, str]] = []
    words = ["▁"]
    while len(pieces) < vocab_size:
        words = [w + c for w in words for c in string.ascii_lowercase]
        for w in words[: vocab_size - len(pieces)]:
            pieces.append(w)
            merges.append((w[:-1], w[-1]))
    bpe = models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def make_model(root: Path, shape: dict[str, int] | None = None) -> Path:
    """The base checkpoint under ``root/base``: :data:`SHAPE`, or ``shape``."""
    shape = shape or SHAPE
    tokenizer = write_llama_tokenizer(root / "tokenizer", shape["vocab"])
    return write_model(root / "base", **shape, tokenizer_from=tokenizer)


def make_adapters(root: Path, model: Path, n: int) -> dict[str, Path]:
    """``n`` PEFT adapters ``a0``, ``a1``, ... under ``root``."""
    return {f"a{i}": write_adapter(root / f"a{i}", model, rank=RANK, seed=1 + i, std=ADAPTER_STD) for i in range(n)}


def prompts(n: int) -> list[list[int]]:
    """Request ``i``'s prompt for ``i < n``: ``PROMPT_LEN`` ids, the same in every engine and mode."""
    return [prompt(i, PROMPT_LEN) for i in range(n)]


# -- lorapage, through the public embedded API ----------------------------------------------------


def lorapage_engine(
    model: Path,
    adapters: dict[str, Path],
    *,
    scheduler: str,
    max_seqs: int,
    max_len: int,
    quantization: str | None = None,
    quantize_lm_head: bool = False,
    lora_dtype: str = "auto",
    num_scheduler_steps: int = 1,
) -> Engine:
    """An engine over ``model`` with ``adapters`` registered, room for all of them resident and
    ``max_seqs`` requests at once; prefix caching off (every pass repeats its prompts); the base's
    weights quantized as ``quantization`` names (None: float32), its ``lm_head`` too with
    ``quantize_lm_head``; the adapters' pages in ``lora_dtype``; ``num_scheduler_steps`` decode steps a plan."""
    config = EngineConfig(
        model=str(model),
        max_num_seqs=max_seqs,
        max_model_len=max_len,
        max_loras=max(1, len(adapters)),
        max_lora_rank=RANK,
        enable_prefix_caching=False,
        scheduler=scheduler,
        quantization=quantization,
        quantize_lm_head=quantize_lm_head,
        lora_dtype=lora_dtype,
        num_scheduler_steps=num_scheduler_steps,
        lora_side_thread=False,  # a thread count is the cores an engine uses: llama.cpp's are its threads
    )
    engine = Engine(config)
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    return engine


def lorapage_generate(engine: Engine, rows: Rows, new_tokens: int) -> tuple[float, list[list[int]]]:
    """Generated tokens/s of ``rows`` through ``Engine.generate_batch`` (greedy, EOS ignored; the whole
    call, prefill included), and each row's tokens. Token ids in, token ids out (``detokenize=False``),
    as the peers are fed and read them."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = engine.generate_batch(rows, params)
    elapsed = time.perf_counter() - start
    return len(rows) * new_tokens / elapsed, [list(o.token_ids) for o in outs]


def close(engine: Engine) -> None:
    """Close ``engine`` from a script (no event loop running)."""
    asyncio.run(engine.close())


# -- transformers + PEFT --------------------------------------------------------------------------

PEFT_MODES = ("mixed", "grouped", "single")


def load_peft(model: Path, adapters: dict[str, Path]):
    """transformers' ``LlamaForCausalLM`` with every adapter loaded into one ``PeftModel``, EOS disabled
    (every row generates its full count, as ``ignore_eos`` does)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    names = list(adapters)
    peft = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(adapters[name], adapter_name=name)
    return peft.eval()


def peft_generate(model, rows: Rows, new_tokens: int, mode: str) -> tuple[float, list[list[int]]]:
    """Greedy tokens of ``rows`` (prompts of one length) through PEFT's ``generate``, and tokens/s.

    ``mixed``: one batch of every row, each on its adapter (PEFT's ``adapter_names=``). ``grouped``:
    one batch per adapter, one after another, with ``set_adapter`` (how PEFT batches without mixed
    batches). ``single``: each row alone on its adapter (the reference the engines are checked against).
    """
    if mode == "mixed":
        batches = [list(range(len(rows)))]
    elif mode == "grouped":
        groups: dict[str | None, list[int]] = {}
        for i, (_, adapter) in enumerate(rows):
            groups.setdefault(adapter, []).append(i)
        batches = list(groups.values())
    elif mode == "single":
        batches = [[i] for i in range(len(rows))]
    else:
        raise ValueError(f"mode must be one of {PEFT_MODES}; got {mode!r}")
    tokens: list[list[int]] = [[] for _ in rows]
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids = torch.tensor([rows[i][0] for i in batch])
            names = [rows[i][1] or "__base__" for i in batch]
            kwargs = {}
            if mode == "mixed":
                kwargs["adapter_names"] = names
            elif names[0] == "__base__":
                kwargs["adapter_names"] = names  # the base rows of a group: PEFT's way to skip every adapter
            else:
                model.set_adapter(names[0])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )
            for i, row in zip(batch, out[:, ids.shape[1] :].tolist()):
                tokens[i] = row
    return len(rows) * new_tokens / (time.perf_counter() - start), tokens


def agreeing(tokens: Sequence[list[int]], reference: Sequence[list[int]]) -> int:
    """How many rows have exactly the reference's tokens."""
    return sum(a == b for a, b in zip(tokens, reference))


# -- measuring and reporting ------------------------------------------------------------------------

Run = Callable[[], tuple[float, list[list[int]]]]  # one pass of a configuration: its tokens/s and tokens


def interleaved(
    runs: dict[str, Run], rounds: int, warm: Sequence[str] | None = None
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """A warm-up pass of the runs named in ``warm`` (all when None: adapters loaded, kernels built),
    then ``rounds`` rounds of all of them, each round starting one later so no configuration always
    runs first. Rates per run, and the tokens of each run's last pass."""
    names = list(runs)
    for name in names if warm is None else warm:
        runs[name]()
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rate, tokens[name] = runs[name]()
            rates[name].append(rate)
    return rates, tokens


def agreement_table(agree: dict[str, dict[int, int]], threads: Sequence[int], of: int) -> str:
    """Per configuration and thread count, how many of ``of`` requests have the reference's tokens."""
    width = max(len(k) for k in agree) + 2
    lines = [f"{f'requests (of {of}) whose tokens equal PEFT':<{width}}" + "".join(f"{t:>14}" for t in _heads(threads))]
    lines += [f"{name:<{width}}" + "".join(f"{per[t]:>14}" for t in threads) for name, per in agree.items()]
    return "\n".join(lines)


def rate_table(rates: dict[str, dict[int, list[float]]], threads: Sequence[int], unit: str = "tokens/s") -> str:
    """Median rate per configuration (rows) and thread count (columns), with the rounds measured."""
    width = max(len(k) for k in rates) + 2
    lines = [f"{'configuration (' + unit + ', median)':<{width}}" + "".join(f"{h:>14}" for h in _heads(threads))]
    for name, per_thread in rates.items():
        cells = "".join(f"{median(per_thread[t]):>14,.0f}" for t in threads)
        lines.append(f"{name:<{width}}{cells}")
    return "\n".join(lines)


def medians(rates: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, float]]:
    """Each configuration's median per thread count."""
    return {name: {t: median(v) for t, v in per.items()} for name, per in rates.items()}


def round_ratios(ours: Sequence[float], *peers: Sequence[float]) -> list[float]:
    """Per round, ``ours`` over the best of ``peers`` in the same round: measured close together in
    time, these hold up better than a ratio of medians when the machine's load changes under the run."""
    return [o / max(p[r] for p in peers) for r, o in enumerate(ours)]


def _heads(threads: Sequence[int]) -> list[str]:
    return [f"{t} thread{'s' if t > 1 else ''}" for t in threads]
