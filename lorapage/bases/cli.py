"""``lorapage base check OLD NEW``: would each adapter behave the same on the new base?

Both bases are loaded in this process (one engine each); every ``--lora-modules`` adapter is
registered on both and checked on its prompts: ``--prompts FILE``, one JSON object a line,
``{"adapter": NAME, "prompt": TEXT}`` (a line without ``adapter`` applies to every adapter).
Prints one row per adapter (token agreement, mean |d logprob|, KL, answers changed, verdict),
the notice each customer would get, and, last, one JSON object with all of it. Exit status: 0
when every adapter passed, 1 when one did not, 2 for a usage error. The check is the one place an
adapter meets a base it was not trained on: each is registered on both engines as trained on that
engine's base (``expected_base_digest``), whatever its metadata says, to measure how it behaves.

With ``--state-dir DIR`` (a server's, while no server holds it: the same lock), each adapter is
an id of that registry whose current version is bound to OLD: its stored check prompts are
checked too (``--prompts`` may then be left out), and its migration state toward NEW (passed or
failed, the numbers, the notice) is recorded there as ``POST /v1/bases/{digest}/validate``
records it, so a server's ``POST /v1/bases/{digest}/migrate`` can move the ones that passed.

``lorapage base digest DIR...`` prints each base's digest (``sha256:HEX``), the value a
``--base-names`` table and a registration's ``expected_base_digest`` take.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from lorapage.bases.drift import DriftReport, DriftThresholds, verdict
from lorapage.bases.stored import StoredStates
from lorapage.config import QUANTIZATIONS
from lorapage.flags import HelpFormatter, fail, parser

PROG = "lorapage base check"


def build_parser() -> argparse.ArgumentParser:
    top = parser("lorapage base", "Base upgrades: check that adapters behave the same on a new base.")
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "check",
        help="the drift check of every adapter, old base vs new",
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=HelpFormatter,
    )
    digest = sub.add_parser("digest", help="print each base's digest (sha256 over its weight files)")
    digest.add_argument("dirs", nargs="+", metavar="DIR", help="Hugging Face model directories")
    p.add_argument("old", help="the current base: a Hugging Face model directory")
    p.add_argument("new", help="the candidate base: a Hugging Face model directory with the same tokenizer")
    p.add_argument("--lora-modules", nargs="+", required=True, metavar="NAME=DIR", help="the adapters to check")
    p.add_argument("--prompts", metavar="FILE", help="JSON lines of {adapter, prompt} (required without --state-dir)")
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="a server's state dir: check each adapter's stored prompts too, and record its migration state there",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens compared per prompt")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="serve the new base quantized (EngineConfig.quantization): with old = new, whether each adapter "
        "survives the quantized base",
    )
    d = DriftThresholds()
    p.add_argument("--min-token-agreement", type=float, default=d.min_token_agreement, help="pass at or above")
    p.add_argument("--max-dlogprob", type=float, default=d.max_mean_abs_dlogprob, help="pass at or below")
    p.add_argument("--max-kl", type=float, default=d.max_kl, help="pass at or below")
    p.add_argument(
        "--max-changed", type=float, default=d.max_changed_fraction, help="answers changed, pass at or below"
    )
    return top


def read_prompts(path: str | None, adapters: list[str]) -> dict[str, list[str]]:
    """Each adapter's prompts from the JSON-lines file (an error ends the command; none: none)."""
    out: dict[str, list[str]] = {a: [] for a in adapters}
    if path is None:
        return out
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        fail(PROG, f"--prompts {path}: {exc.strerror or exc}")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, adapter = row["prompt"], row.get("adapter")
        except (ValueError, KeyError, TypeError, AttributeError):
            fail(PROG, f'--prompts {path}:{n}: expected {{"adapter": NAME, "prompt": TEXT}}')
        if adapter is not None and adapter not in out:
            fail(PROG, f"--prompts {path}:{n}: adapter {adapter!r} is not among --lora-modules")
        for name in [adapter] if adapter is not None else adapters:
            out[name].append(str(prompt))
    return out


async def run(args: argparse.Namespace) -> dict[str, DriftReport]:
    from lorapage.bases.check import prompt_drifts
    from lorapage.config import EngineConfig
    from lorapage.engine import Engine
    from lorapage.engine.flags import check_model_dir, lora_modules

    for model in (args.old, args.new):
        check_model_dir(model, PROG)
    if args.prompts is None and args.state_dir is None:
        fail(PROG, "give --prompts FILE, or --state-dir DIR to use the adapters' stored check prompts")
    modules = lora_modules(argparse.Namespace(lora_modules=args.lora_modules, model=args.old), PROG)
    prompts = read_prompts(args.prompts, list(modules))
    limits = DriftThresholds(args.min_token_agreement, args.max_dlogprob, args.max_kl, args.max_changed)
    states = StoredStates.open(args.state_dir, args.old, args.new, list(modules)) if args.state_dir else None
    if states is not None:
        for name in modules:
            prompts[name].extend(states.prompts[name])
    # The check compares outputs; what the shared pool would serve is not its question (no envelope).
    slots = max(1, len(modules))
    old, new = (
        Engine(EngineConfig(model=m, max_loras=slots, shared_envelope="", quantization=q))
        for m, q in ((args.old, None), (args.new, args.quantization))
    )
    try:
        for engine in (old, new):
            for name, path in modules.items():
                engine.add_adapter(name, path, expected_base_digest=engine.digest)
        reports = {}
        for name in modules:
            drifts = await prompt_drifts(old, new, name, name, prompts[name], max_tokens=args.max_tokens)
            reports[name] = verdict(drifts, limits)
        if states is not None:
            states.record(reports)
        return reports
    finally:
        await old.close()
        await new.close()
        if states is not None:
            states.close()


def print_digests(dirs: list[str]) -> int:
    """``lorapage base digest``: one ``sha256:HEX  DIR`` line per base; 1 when one could not be read."""
    from lorapage.adapters.binding import shown_digest
    from lorapage.model.loader import model_digest

    status = 0
    for path in dirs:
        try:
            print(f"{shown_digest(model_digest(path))}  {path}")
        except OSError as exc:
            print(f"lorapage base digest: {path}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "digest":
        return print_digests(args.dirs)
    reports = asyncio.run(run(args))
    print(f"{'adapter':<20} {'prompts':>7} {'agreement':>9} {'|dlogprob|':>10} {'KL':>8} {'changed':>7}  verdict")
    for name, r in reports.items():
        outcome = "pass" if r.passed else "FAIL: " + "; ".join(r.reasons)
        print(
            f"{name:<20} {r.prompts:>7} {r.token_agreement:>9.3f} {r.mean_abs_dlogprob:>10.4f} {r.kl:>8.4f} "
            f"{r.changed_fraction:>7.0%}  {outcome}"
        )
    print()
    for name, r in reports.items():
        print(r.notice(name, Path(args.old).name, Path(args.new).name))
    print(json.dumps({"old": args.old, "new": args.new, "adapters": {n: asdict(r) for n, r in reports.items()}}))
    return 0 if all(r.passed for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
