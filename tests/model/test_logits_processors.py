"""vLLM's sampling extras, per row: each does what transformers' logits processors do (the
reference where one exists), only to the rows that ask, and never writes the model's logits."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lorapage.errors import InvalidRequestError
from lorapage.model import sampler
from lorapage.model.logits_processors import SampleRow, process
from lorapage.model.sampler import filtered_probs, sample
from lorapage.sampling_params import SamplingParams

VOCAB = 300


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def row(params: SamplingParams, output_ids=(), prompt_ids=(), **kw) -> SampleRow:
    return SampleRow(params, None, list(output_ids), list(prompt_ids), **kw)


def test_rows_that_ask_for_nothing_cost_nothing():
    logits = logits_for(3)
    plain = [row(SamplingParams(temperature=0)) for _ in range(3)]
    assert process(logits, plain) is logits  # no copy at all


def test_repetition_penalty_matches_transformers_and_touches_only_its_row():
    logits = logits_for(2)
    prompt, output = [5, 6, 7, 7], [8, 5, 200]
    rows = [row(SamplingParams(repetition_penalty=1.3), output, prompt), row(SamplingParams())]
    got = process(logits, rows)
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[:1].clone())
    torch.testing.assert_close(got[:1], want, rtol=0, atol=0)
    assert torch.equal(got[1], logits[1])


def test_presence_frequency_bias_and_allowed_tokens():
    logits = logits_for(3)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={4: 10.0, 9: -100.0})
    rows = [
        row(params, [3, 3, 4]),
        row(SamplingParams(allowed_token_ids=[11, 12, 250], temperature=0)),
        row(SamplingParams()),
    ]
    got = process(logits, rows)
    want = logits[0].clone()
    want[3] -= 0.5 + 2 * 0.25
    want[4] -= 0.5 + 0.25
    want[4] += 10.0
    want[9] -= 100.0
    torch.testing.assert_close(got[0], want)
    assert torch.isinf(got[1]).sum() == VOCAB - 3 and set(torch.isfinite(got[1]).nonzero()[:, 0].tolist()) == {
        11,
        12,
        250,
    }
    assert sample(logits, rows).tokens[1] == max((11, 12, 250), key=lambda t: float(logits[1, t]))
    assert torch.equal(got[2], logits[2])


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached():
    logits = logits_for(1)
    logits[0, 299] = 50.0  # EOS is by far the likeliest
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[17])
    early = sample(logits, [row(params, [1, 2], stop_ids=(299, 17))])
    assert early.tokens[0] not in (299, 17)
    done = sample(logits, [row(params, [1, 2, 3], stop_ids=(299, 17))])
    assert done.tokens == [299]


def test_bad_words_are_never_completed():
    logits = logits_for(1)
    logits[0, 42] = 50.0
    logits[0, 43] = 40.0
    words = ((42,), (7, 43))
    assert sample(logits, [row(SamplingParams(temperature=0), [1], bad_words=words)]).tokens[0] not in (42,)
    after_seven = sample(logits, [row(SamplingParams(temperature=0), [7], bad_words=words)]).tokens[0]
    assert after_seven not in (42, 43)
    elsewhere = sample(logits, [row(SamplingParams(temperature=0), [8], bad_words=((7, 43),))]).tokens[0]
    assert elsewhere == 42


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9),
    ],
    ids=["top_k", "top_p", "min_p", "top_k+top_p"],
)
def test_filters_keep_the_tokens_transformers_keeps(params):
    logits = logits_for(4, seed=3)
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    want = logits.clone()
    for w in warpers:
        want = w(None, want)
    kept = filtered_probs(logits, [params] * 4) > 0
    assert torch.equal(kept, torch.isfinite(want))


def test_top_p_on_a_flat_distribution_sorts_the_whole_vocabulary(monkeypatch):
    """The partial sort looks at TOP_P_CANDIDATES tokens; a nucleus wider than that is found whole."""
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", 16)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)) * 0.01  # nearly flat
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.5, temperature=0.05)]
    want = TopPLogitsWarper(0.5)(None, logits.clone())
    kept = filtered_probs(logits, params) > 0
    assert kept[0].sum() > 16 and torch.equal(kept[0], torch.isfinite(want[0]))


def test_extras_are_bounded():
    for bad, param in [
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={1: 500.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(**bad)
        assert err.value.param == param
