"""Per-row sampling: a row that cannot be sampled fails alone, the others are untouched."""

from __future__ import annotations

import pytest
import torch

from lorapage.errors import InvalidRequestError
from lorapage.model.sampler import FAILED_TOKEN, SampleRow, sample
from lorapage.sampling_params import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, SamplingParams

VOCAB = 64


def _good_rows() -> list[SampleRow]:
    """Rows whose tokens are reproducible: greedy, seeded, seeded with filters and logprobs."""
    return [
        SampleRow(SamplingParams(temperature=0.0, logprobs=3), None, []),
        SampleRow(SamplingParams(temperature=1.0, seed=7), torch.Generator().manual_seed(7), []),
        SampleRow(
            SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=11, logprobs=2, presence_penalty=0.5),
            torch.Generator().manual_seed(11),
            [3, 3, 5],
        ),
    ]


def _bad_row(seed: int | None) -> SampleRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SampleRow(SamplingParams(temperature=1.0, seed=seed, logprobs=1), generator, [])


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_bad_rows_fail_alone_and_leave_the_others_unchanged(logits):
    clean = sample(logits, _good_rows())
    assert all(e is None for e in clean.errors)
    nan = torch.full((VOCAB,), float("nan"))
    inf = logits[0].clone()
    inf[5] = float("inf")
    huge = torch.full((VOCAB,), 3e38)
    huge[0] = -3e38  # finite logits whose scaled distribution is not (inf - inf)
    tiny = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    # Interleave, so a bad row sits before and after good ones (seeded and unseeded).
    mixed = torch.stack([nan, logits[0], tiny[0], inf, logits[1], huge, tiny[1], logits[2]])
    rows = _good_rows()
    mixed_rows = [
        _bad_row(3),
        rows[0],
        SampleRow(SamplingParams(temperature=1e-40, logprobs=0), None, []),
        _bad_row(None),
        rows[1],
        SampleRow(SamplingParams(temperature=1e-5, top_k=3), None, []),
        SampleRow(SamplingParams(temperature=5e-324), None, []),
        rows[2],
    ]
    out = sample(mixed, mixed_rows)

    for i in (0, 3, 5):
        assert out.tokens[i] == FAILED_TOKEN and out.logprobs[i] is None
    assert "NaN or Inf logits" in out.errors[0] and "NaN or Inf logits" in out.errors[3]
    assert "after temperature" in out.errors[5]
    # A temperature too small to divide by is greedy, with its logprob reported.
    assert out.errors[2] is None and out.errors[6] is None
    assert out.tokens[2] == int(tiny[0].argmax()) and out.tokens[6] == int(tiny[1].argmax())
    assert out.logprobs[2].token_id == out.tokens[2]
    assert out.logprobs[2].logprob == pytest.approx(float(torch.log_softmax(tiny[0], -1)[out.tokens[2]]))
    # Greedy and seeded rows get exactly the tokens and logprobs of the clean batch.
    assert [out.tokens[i] for i in (1, 4, 7)] == clean.tokens
    assert [out.logprobs[i] for i in (1, 4, 7)] == clean.logprobs
    assert [out.errors[i] for i in (1, 4, 7)] == [None, None, None]


def test_all_rows_bad_and_greedy_nan_never_raise():
    logits = torch.full((2, VOCAB), float("nan"))
    out = sample(logits, [SampleRow(SamplingParams(temperature=0.0), None, []), _bad_row(1)])
    assert out.tokens == [FAILED_TOKEN, FAILED_TOKEN]
    assert all(out.errors)


def test_a_batch_of_plain_greedy_rows_samples_as_the_general_path(logits):
    """All rows greedy without processors or logprobs take the short path (three reductions): the
    same tokens and errors as through the general one, ties going to the first largest logit."""
    tied = logits[1].clone()
    tied[[9, 4]] = tied.max() + 1.0  # two largest, equal: token 4 (the first) either way
    minus_inf = logits[2].clone()
    minus_inf[0] = float("-inf")
    batch = torch.stack([logits[0], torch.full((VOCAB,), float("nan")), tied, minus_inf, logits[2]])
    plain = [SampleRow(SamplingParams(temperature=0.0), None, [1, 2]) for _ in range(len(batch))]
    short = sample(batch, plain)
    general = sample(batch, [*plain[:-1], SampleRow(SamplingParams(temperature=0.0, logprobs=0), None, [1, 2])])
    assert short.tokens == general.tokens and short.errors == general.errors
    assert short.tokens[2] == 4 and short.tokens[0] == int(logits[0].argmax())
    assert short.tokens[1] == short.tokens[3] == FAILED_TOKEN and "NaN or Inf logits" in short.errors[3]
    assert short.logprobs == [None] * len(batch)


def test_seeded_draw_is_independent_of_the_batch(logits):
    def seeded() -> SampleRow:
        return SampleRow(SamplingParams(seed=42, top_p=0.95), torch.Generator().manual_seed(42), [])

    alone = sample(logits[:1], [seeded()]).tokens[0]
    batched = sample(logits[[1, 0, 2]], [_good_rows()[1], seeded(), _good_rows()[0]]).tokens[1]
    assert alone == batched


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 5e-324, 9.9e-6])
def test_tiny_temperatures_are_greedy(temperature):
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_stop_strings_are_bounded():
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES)
    with pytest.raises(InvalidRequestError, match="at most 256 characters") as e:
        SamplingParams(stop=["ok", "x" * 3_000_000])
    assert e.value.param == "stop" and len(e.value.message) < 400  # the huge value is not echoed back
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_SEQUENCES} sequences"):
        SamplingParams(stop=[str(i) for i in range(MAX_STOP_SEQUENCES + 1)])
    with pytest.raises(InvalidRequestError, match="non-empty strings"):
        SamplingParams(stop=["a", 3])


@pytest.mark.gpu
def test_bad_rows_on_cuda_do_not_trip_a_device_assert(logits):
    """CUDA's multinomial asserts on the device for a bad distribution; the sampler never feeds it one."""
    cuda = logits.cuda()
    clean = sample(cuda, _good_rows())
    bad = torch.stack([torch.full((VOCAB,), float("nan")).cuda(), *cuda])
    out = sample(bad, [_bad_row(None), *_good_rows()])
    assert out.tokens[0] == FAILED_TOKEN and out.tokens[1:] == clean.tokens
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_logits():
    """The request's seeded generator is a CPU generator; sampling CUDA logits with it must work."""
    logits = torch.randn(2, 50, device="cuda")
    rows = [
        SampleRow(SamplingParams(seed=7), torch.Generator().manual_seed(7), []),
        SampleRow(SamplingParams(top_p=0.9, top_k=5), None, []),
    ]
    tokens = sample(logits, rows).tokens
    again = sample(logits, [SampleRow(SamplingParams(seed=7), torch.Generator().manual_seed(7), []), rows[1]]).tokens
    assert tokens[0] == again[0]


def test_stop_token_ids_are_bounded():
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=tuple(range(65)))
    assert len(SamplingParams(stop_token_ids=tuple(range(64))).stop_token_ids) == 64
