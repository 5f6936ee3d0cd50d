"""A trainer's loop against ``lorapage serve`` (docs/rl.md): push the policy's LoRA weights from
memory after each step, sample the next rollouts pinned to that version with their logprobs.

    python scripts/rl_client.py --url http://127.0.0.1:8000 --admin-key KEY --key KEY \\
        --adapter DIR --steps 5 [--tenant TENANT] [--max-staleness 2]

``--adapter`` is a PEFT directory whose weights stand for the policy's (each step moves them a
little, as an optimizer step would). Only the standard library, torch and safetensors: what
any trainer has.
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save


def push(url: str, admin_key: str, adapter_id: str, tensors: dict, config: dict, **query) -> dict:
    """``POST /v1/adapters/{id}/versions``: the tensors as safetensors bytes, the config in their
    metadata; the version as the server describes it (``version`` is what rollouts pin)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    body = save(cpu, metadata={"adapter_config": json.dumps(config)})
    params = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
    req = urllib.request.Request(
        f"{url}/v1/adapters/{adapter_id}/versions" + (f"?{params}" if params else ""),
        data=body,
        headers={"Authorization": f"Bearer {admin_key}", "Content-Type": "application/octet-stream"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def rollout(url: str, key: str, adapter_id: str, version: int, prompt: str, n: int, max_tokens: int) -> dict:
    """``n`` samples of ``prompt`` on ``adapter_id@version``, each token's logprob under the
    distribution it was drawn from (``processed_logprobs``)."""
    body = {
        "model": adapter_id,
        "adapter_version": version,
        "prompt": prompt,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 0.95,
        "logprobs": 0,
        "logprobs_mode": "processed_logprobs",
    }
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--admin-key", required=True)
    p.add_argument("--key", required=True, help="the key rollouts are sampled with")
    p.add_argument("--adapter", type=Path, required=True, help="a PEFT directory: the initial policy")
    p.add_argument("--id", default="policy")
    p.add_argument("--tenant", help="the tenant that owns the id (its key samples)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--prompts", nargs="+", default=["The capital of France is", "2 + 2 ="])
    args = p.parse_args()
    tensors = load_file(str(args.adapter / "adapter_model.safetensors"))
    config = json.loads((args.adapter / "adapter_config.json").read_text())
    with ThreadPoolExecutor(8) as pool:
        for step in range(args.steps):
            pushed = push(
                args.url, args.admin_key, args.id, tensors, config,
                max_staleness=args.max_staleness, tenant=args.tenant,
            )  # fmt: skip
            version = pushed["version"]
            calls = [pool.submit(rollout, args.url, args.key, args.id, version, q, 4, 16) for q in args.prompts]
            answers = [c.result() for c in calls]
            served = {a["usage"]["adapter_version"] for a in answers}
            mean = [sum(c["logprobs"]["token_logprobs"]) for a in answers for c in a["choices"]]
            print(f"step {step}: pushed {args.id}@{version}, served by {served}, sequence logprobs {mean}")
            tensors = {k: v + 1e-3 * torch.randn_like(v) for k, v in tensors.items()}  # the trainer's update


if __name__ == "__main__":
    main()
