"""Multi-step scheduling (``num_scheduler_steps``, vLLM's): a decode-only plan runs several steps
back to back on the forward thread, each feeding the tokens the last one sampled, and the planner
applies them in turn. What a client sees must not change: the same tokens, text, logprobs and
finish reasons as one step per plan, rows that stop early (EOS, a stop string, an abort) losing
their later tokens, rows whose sampling reads their own outputs forcing single steps, and every
page coming back."""

from __future__ import annotations

import asyncio

import pytest
from engine_util import collect, tiny_engine

from lorapage import EngineConfig, SamplingParams
from lorapage.tiny import TINY_BASE_DIR

STEPS = 6


def chat(engine, text="Hello there"):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def _counting_windows(engine) -> list[int]:
    """The step count of every window the engine's runner runs from now on (an instance wrapper)."""
    runner, seen = engine.debug.runner, []
    execute_window = runner.execute_window

    def counted(plan):
        seen.append(plan.steps)
        return execute_window(plan)

    runner.execute_window = counted
    return seen


def _rows(engine) -> list[tuple[list[int], str | None, SamplingParams]]:
    prompt = chat(engine)
    return [
        (prompt, "acme", SamplingParams(max_tokens=20, temperature=0.0)),  # stops at its EOS
        (prompt, "globex", SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, logprobs=2)),
        (prompt, None, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),
        (prompt, "initech", SamplingParams(max_tokens=17, temperature=0.8, seed=3, ignore_eos=True)),
        (prompt, "acme", SamplingParams(max_tokens=30, temperature=0.0, stop=["here"])),
        (prompt[:5], "globex", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
    ]


def _outputs(engine, rows):
    """Every row's (tokens, text, finish reason, logprob tokens), the rows in flight together."""

    async def run_all():
        return await asyncio.gather(*(engine.run_to_end(p, a, s) for p, a, s in rows))

    return [
        (o.token_ids, o.text, o.finish_reason, [lp.token_id for lp in o.logprobs or []]) for o in asyncio.run(run_all())
    ]


def test_windows_give_the_outputs_of_single_steps():
    """One batch of rows on three adapters and the base, greedy and seeded, stopping by EOS, a stop
    string and max_tokens at different steps: the same outputs with 6 steps a plan as with one,
    and windows of more than one step did run (all rows decoding, nothing waiting)."""
    one, many = tiny_engine(), tiny_engine(num_scheduler_steps=STEPS)
    windows = _counting_windows(many)
    want = _outputs(one, _rows(one))
    assert any(reason == "stop" for _, _, reason, _ in want)  # an early stop is in the batch
    assert _outputs(many, _rows(many)) == want
    assert windows and all(1 < s <= STEPS for s in windows)  # each as long as every row has tokens left
    free = many.debug.pool_free_pages()
    assert _outputs(many, _rows(many)) == want  # again, from pages the first batch gave back
    assert many.debug.pool_free_pages() == free
    for engine in (one, many):
        asyncio.run(engine.close())


def test_rows_whose_sampling_reads_their_outputs_take_single_steps():
    """A row with a repetition penalty (its next token depends on every token before it) keeps
    the batch at one step a plan while it runs; once it ends the others go on in windows, and the
    outputs are single steps' all the same."""
    one, many = tiny_engine(), tiny_engine(num_scheduler_steps=STEPS)
    windows = _counting_windows(many)
    prompt = chat(one)
    rows = [
        (prompt, "acme", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)),
        (prompt, "globex", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
    ]
    assert _outputs(many, rows) == _outputs(one, rows)
    assert windows  # after the penalised row's 4 tokens: 11 more in windows
    for engine in (one, many):
        asyncio.run(engine.close())


async def test_a_request_arriving_mid_window_is_served_and_an_abort_frees_its_pages():
    """A request submitted while another decodes in windows runs to its end (admitted at the plan
    after the window); a reader that stops reading mid-window aborts its request, whose later
    tokens are dropped, and every page comes back."""
    engine = tiny_engine(num_scheduler_steps=STEPS)
    prompt = chat(engine)
    for adapter in ("acme", "globex"):  # loaded (their pages held) before the count
        await collect(engine, prompt, adapter, SamplingParams(max_tokens=2))
    free = engine.debug.pool_free_pages()
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    stream = engine.generate(prompt, "acme", long)
    first = await anext(stream)
    assert first.token_ids
    late, _ = await asyncio.wait_for(collect(engine, prompt, "globex", SamplingParams(max_tokens=7)), 20)
    assert 0 < len(late.token_ids) <= 7
    await stream.aclose()  # abort mid-way
    for _ in range(100):
        if engine.debug.pool_free_pages() == free:
            break
        await asyncio.sleep(0.01)
    assert engine.debug.pool_free_pages() == free
    await engine.close()


def test_num_scheduler_steps_must_be_positive():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(model=str(TINY_BASE_DIR), num_scheduler_steps=0)
