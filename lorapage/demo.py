"""``lorapage demo``: the embedded engine on the built-in tiny model and its demo adapters.

Every demo adapter and the base answer the same prompt in one batch; each answer is its own.
"""

from __future__ import annotations

import time

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.errors import LorapageError
from lorapage.flags import fail, parser
from lorapage.tiny import TINY_BASE_DIR, demo_adapter_dirs

PROG = "lorapage demo"


def main(argv: list[str] | None = None) -> int:
    p = parser(PROG, __doc__)
    p.add_argument("--prompt", default="Hello! Who are you?", help="the prompt every row answers")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per row at most")
    args = p.parse_args(argv)
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    except LorapageError as exc:
        fail(PROG, f"--max-tokens: {exc.message}")
    engine = Engine(EngineConfig(model=str(TINY_BASE_DIR), max_loras=8, max_lora_rank=16))
    for name, path in demo_adapter_dirs().items():
        engine.add_adapter(name, path)
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    rows = [None, *demo_adapter_dirs()]
    start = time.perf_counter()
    outs = engine.generate_batch([(chat, a) for a in rows], sampling)
    elapsed = time.perf_counter() - start
    print(f"prompt: {args.prompt!r}  (one batch, {len(rows)} rows, {elapsed * 1000:.0f} ms)")
    for adapter, out in zip(rows, outs):
        print(f"  {adapter or '<base>':>10}: {out.text!r}")
    return 0
