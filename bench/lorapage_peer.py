"""lorapage as a peer process: the worker ``bench_llamacpp.py`` runs lorapage in (``peer_proc``).

    python bench/lorapage_peer.py --threads N

Sets the ``lorapage`` command's OpenMP settings for ``N`` threads before torch loads
(``lorapage.configure_threads``), then serves: ``load`` an engine by name (model, adapters,
max_seqs, max_len, quantization, quantize_lm_head, lora_dtype, num_scheduler_steps) through the
public embedded API, default scheduler; ``run`` greedy batches of ``(prompt ids, adapter)`` rows on
it: the tokens and the seconds they took, prefill included. Nothing else runs in the process, so
lorapage's OpenMP runtime is its own.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, required=True)
    threads = p.parse_args().threads

    import lorapage

    lorapage.configure_threads(threads)  # before torch loads: the command's spin setting
    import torch

    torch.set_num_threads(threads)
    from peer_proc import serve
    from peer_setup import close, lorapage_engine, lorapage_generate

    engines: dict[str, Any] = {}

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        if req["op"] == "load":
            adapters = {name: Path(path) for name, path in req["adapters"].items()}
            engines[req["name"]] = lorapage_engine(
                Path(req["model"]),
                adapters,
                scheduler="vtc",
                max_seqs=req["max_seqs"],
                max_len=req["max_len"],
                quantization=req.get("quantization"),
                quantize_lm_head=req.get("quantize_lm_head", False),
                lora_dtype=req.get("lora_dtype", "auto"),
                num_scheduler_steps=req.get("num_scheduler_steps", 1),
            )
            return {}
        if req["op"] == "run":
            rows = [(list(ids), adapter) for ids, adapter in req["rows"]]
            cpu = time.process_time()
            rate, tokens = lorapage_generate(engines[req["name"]], rows, req["new"])
            cpu_seconds = time.process_time() - cpu
            return {"seconds": len(rows) * req["new"] / rate, "cpu_seconds": cpu_seconds, "tokens": tokens}
        raise ValueError(f"unknown op {req['op']!r}")

    try:
        serve(handle)
    finally:
        for engine in engines.values():
            close(engine)


if __name__ == "__main__":
    main()
