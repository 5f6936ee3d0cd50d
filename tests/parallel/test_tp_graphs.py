"""Decode graphs under tensor parallelism, checked on this CPU: every rank captures the same sizes
in the same order (rank 0 sends them, the workers answer), and every replay's size is rank 0's
choice carried in the step's inputs. Here the capture is the eager stand-in
(``cuda_graphs.rerun_capture``: a capture runs the step once, a replay reruns it), which runs the
same collectives a CUDA graph's capture and replay would, so a rank replaying another size than
rank 0's would meet mismatched collectives (gloo fails the step) and a wrong padding or bucket
would change the tokens. The CUDA graphs themselves, with NCCL inside, are bench/gpu_check.sh's.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch
from hf_reference import make_peft_adapter, make_random_llama

from lorapage import Engine, EngineConfig, SamplingParams
from lorapage.engine import build
from lorapage.kernels.triton_import import triton_available
from lorapage.model.cuda_graphs import rerun_capture
from lorapage.model.runner import StepInputs
from lorapage.parallel.wire import CaptureMessage, StepMessage

ROWS = [([5, 6, 7, 8], "a1"), ([9, 10, 11], "a2"), ([12, 13], None)]  # three rows: the bucket of four
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpg")
    base = make_random_llama(root / "base", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96)
    make_peft_adapter(base, root / "a1", r=8, targets=["q_proj", "v_proj", "o_proj", "down_proj"], seed=1)
    make_peft_adapter(base, root / "a2", r=4, targets=["k_proj", "gate_proj", "up_proj"], seed=2)
    return root


def test_capture_and_step_messages_round_trip():
    """What crosses the pipes: the sizes to capture, and a step's inputs with its graph's size."""
    inputs = StepInputs([3, 4], [5, 2], [21, 9], [1, 0], ((0, 1, 1),), 2, [[5, 2], [2]], [6, 3], [0], (0, 1), 4)
    for msg in (CaptureMessage((4, 2, 1)), StepMessage(inputs)):
        assert pickle.loads(pickle.dumps(msg)) == msg
    assert pickle.loads(pickle.dumps(StepMessage(inputs))).inputs.graph_size == 4


def test_tp_on_cuda_needs_no_enforce_eager(checkpoint, monkeypatch):
    """The engine's sizing no longer refuses TP on CUDA with graphs on (no GPU: the device is faked)."""
    monkeypatch.setattr(build, "resolve_device", lambda name: torch.device("cuda", 0))
    config = EngineConfig(model=str(checkpoint / "base"), device="cuda", tensor_parallel_size=2)
    assert not config.enforce_eager
    sizing = build.build_sizing(config, build.build_base(config))
    assert sizing.device.type == "cuda" and sizing.tensor_parallel_size == 2


@pytest.mark.skipif(not triton_available(), reason="the replayed step's BGMV kernels are Triton's")
def test_tp2_replays_give_eager_tokens_and_tp1s(checkpoint):
    """TP=2 on the Triton kernels (interpreted; a graph's BGMV reads each row's slot on the device):
    the same engine's tokens eager, then with every rank's graphs captured (sizes 4, 2, 1) and the
    decode steps replayed padded to rank 0's bucket, equal each other and TP=1's (eager, its default
    kernels: greedy tokens, as tests/parallel/test_tp.py compares them)."""
    config = dict(model=str(checkpoint / "base"), max_lora_rank=8, max_num_seqs=4)
    engines = [
        Engine(EngineConfig(**config)),
        Engine(EngineConfig(**config, tensor_parallel_size=2, kernel_backend="triton")),
    ]
    for engine in engines:
        for name in ("a1", "a2"):
            engine.add_adapter(name, str(checkpoint / name))
    one, two = engines
    try:
        want = [o.token_ids for o in one.generate_batch(ROWS, GREEDY)]
        eager = [o.token_ids for o in two.generate_batch(ROWS, GREEDY)]
        runner = two.debug.runner
        runner.capture_decode_graphs(4, capture=rerun_capture)  # the workers answer once captured
        assert sorted(runner.graphs.graphs) == [1, 2, 4]
        sent: list[int] = []
        send_step = runner.send_step

        def record(inputs: StepInputs) -> None:
            sent.append(inputs.graph_size)
            send_step(inputs)

        runner.send_step = record
        replayed = [o.token_ids for o in two.generate_batch(ROWS, GREEDY)]
    finally:
        for engine in engines:
            asyncio.run(engine.close())
    assert replayed == eager == want
    # The prefill step ran eagerly; every decode step of three rows replayed the graph of four.
    assert sent[0] == 0 and sent[1:] and set(sent[1:]) == {4}
