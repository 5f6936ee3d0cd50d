"""Mixtures of experts under tensor parallelism (tensor-parallel experts, vLLM's default): the router
whole on every rank, each expert's gate / up split by output rows and its down by input columns,
the experts' LoRA fully sharded as the dense MLP's. TP=2 over gloo against TP=1 on Mixtral (LoRA
per expert on w1 / w3 / w2, transformers 4's form, and on q / v) and Qwen3-MoE (per-head q / k
norms; PEFT's fused ``target_parameters`` experts and attention), the base, that adapter (of a rank
that does not divide by 2) and an attention-only one in one mixed batch of 6-token steps (prompts
prefill in chunks).

The logprob bound is tests/parallel/test_tp.py's argument for the longest float32 sum here (o's
64 inputs, the LoRA's rank, the top-k experts' weighted sum); the routing of every token on the
way has a margin (transformers' router, as tests/model/test_families_moe.py checks) far above the
summation-order difference, so both runs pick the same experts.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from hf_reference import make_peft_adapter
from numeric_bounds import U32, gamma

from lorapage import Engine, EngineConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from test_families_moe import ATTENTION, _mixtral, _qwen3_moe, per_expert_adapter, routing_margin  # noqa: E402

LAYERS, LONGEST_SUM, MAX_RANK = 2, 64 + 8 + 2, 8
GAIN, MAX_LOGIT = 4.0, 4.0
BOUND = 2 * 2 * gamma(LONGEST_SUM, U32) * (1 + GAIN) ** (2 * LAYERS) * MAX_LOGIT
ROUTING_MARGIN = 1e-4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
# an attention-only adapter's rows too: they reach the experts with a slot that has no expert LoRA
ROWS = [([5, 9, 17, 33, 60, 2, 8], None), ([100, 3, 41], "moe"), ([7, 7, 19, 200], "moe"), ([11, 4], "attn")]


def _adapter(name: str, base: Path, root: Path) -> Path:
    if name == "mixtral":  # rank 3: each expert's stacked gate / up A (6 rows) and q / v's split 2 ways
        return per_expert_adapter(base, root / "moe", ("w1", "w3", "w2"), "block_sparse_moe", r=3, seed=5)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # rank 5: a zero row pads A's share
    return make_peft_adapter(base, root / "moe", r=5, targets=ATTENTION, seed=2, target_parameters=experts)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = (_mixtral if request.param == "mixtral" else _qwen3_moe)(root / "base")
    adapters = {"moe": _adapter(request.param, base, root)}
    adapters["attn"] = make_peft_adapter(base, root / "attn", r=3, targets=ATTENTION, seed=1)
    engines = {}
    for tp in (1, 2):
        config = EngineConfig(
            model=str(base), tensor_parallel_size=tp, max_lora_rank=MAX_RANK, max_num_seqs=4,
            max_num_batched_tokens=6, enable_chunked_prefill=True,
        )  # fmt: skip
        engines[tp] = Engine(config)
        for name, path in adapters.items():
            engines[tp].add_adapter(name, str(path))
    yield engines, base, adapters
    for engine in engines.values():
        asyncio.run(engine.close())


def test_tp2_matches_tp1(family):
    engines, base, adapters = family
    want, got = (engines[tp].generate_batch(ROWS, GREEDY) for tp in (1, 2))
    assert BOUND < 0.1
    for (prompt, name), w, g in zip(ROWS, want, got, strict=True):
        margin = routing_margin(base, adapters.get(name), prompt + w.token_ids[:-1])
        assert margin > ROUTING_MARGIN, f"a near-tie in routing ({name}): the test would not be meaningful"
        assert g.token_ids == w.token_ids
        assert [x.logprob for x in g.logprobs] == pytest.approx([x.logprob for x in w.logprobs], abs=BOUND)
    # the adapter (attention and experts) moves the output by far more than the bound
    base_row = engines[2].generate_batch([(ROWS[1][0], None)], GREEDY)[0]
    moved = abs(base_row.logprobs[0].logprob - got[1].logprobs[0].logprob)
    assert base_row.token_ids != got[1].token_ids or moved > BOUND


def test_each_rank_holds_half_of_the_expert_lora(family):
    """Fully sharded experts too: a rank's pages (half as wide) hold half of every expert matrix,
    so the adapter takes as many pages per rank as on one device (up to one page of rounding);
    replicated expert LoRA would take about twice as many."""
    engines = family[0]
    one, two = engines[1], engines[2]
    assert two._sizing.page_size * 2 == one._sizing.page_size
    whole, per_rank = one.admin.info("moe").num_pages, two.admin.info("moe").num_pages
    assert whole <= per_rank <= whole + 1
