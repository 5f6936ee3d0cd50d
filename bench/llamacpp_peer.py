"""llama.cpp as a peer: the base and adapters converted by llama.cpp's own converters, greedy batches
run through llama-cpp-python's C API on token ids, in a process of its own.

Run as a script (``python bench/llamacpp_peer.py``, under an interpreter that has llama-cpp-python:
the bench's ``--llamacpp-python``) it is a worker of ``peer_proc``: ``load`` a base GGUF and its
adapters' GGUFs at a thread count, then ``run`` greedy batches at a :class:`Setting` (flash
attention, KV cache type, ``n_ubatch``). It imports neither lorapage nor torch, so llama.cpp's
OpenMP runtime is the only one in its process.

The converters (``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``, their ``conversion/`` package
and the ``gguf-py`` they import) ship in the llama.cpp source, which the llama-cpp-python sdist vendors.
:func:`converter_dir` takes that source as a directory or as the sdist, and otherwise fetches the sdist
of the installed llama-cpp-python once (``pip download --no-binary :all: --no-deps``) into a cache, so
the converters always match the library that loads their output.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

CONVERTERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lorapage" / "peers"
# What the converters need from the llama.cpp tree: the scripts, the model classes, the GGUF writer.
_SOURCE_PARTS = (*CONVERTERS, "conversion/", "gguf-py/")
KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids (GGML_TYPE_F32, GGML_TYPE_F16)
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
N_BATCH = 2048  # the most tokens one decode call takes (llama.cpp's default n_batch)


class Setting(NamedTuple):
    """A context's settings the bench sweeps: flash attention (``FLASH_ATTN``), the KV cache's type
    (``KV_TYPES``) and ``n_ubatch``, the most tokens one graph computes (a decode call's tokens
    beyond it run as several)."""

    flash_attn: str = "auto"
    kv_type: str = "f16"
    ubatch: int = 512

    def __str__(self) -> str:
        return f"fa={self.flash_attn},kv={self.kv_type},ub={self.ubatch}"

    @classmethod
    def parse(cls, text: str) -> Setting:
        """The setting :meth:`__str__` wrote."""
        parts = dict(kv.split("=", 1) for kv in text.split(","))
        return cls(parts["fa"], parts["kv"], int(parts["ub"]))


def converter_dir(source: Path | None, version: str) -> Path:
    """The llama.cpp source holding the converters: ``source`` itself (a llama.cpp tree, or an unpacked
    llama-cpp-python sdist), the tree inside ``source`` when it is the sdist (``.tar.gz``, unpacked once
    into the cache), or, with no ``source``, the sdist of llama-cpp-python ``version`` (the one the
    worker runs), fetched once into the cache."""
    if source is None:
        return _unpack(_download_sdist(version))
    if source.is_dir():
        tree = source / "vendor" / "llama.cpp" if (source / "vendor" / "llama.cpp").is_dir() else source
        if not _has_converters(tree):
            raise SystemExit(f"{source} holds no llama.cpp converters ({', '.join(CONVERTERS)})")
        return tree
    if not source.is_file():
        raise SystemExit(f"--llama-cpp {source}: no such directory or sdist")
    return _unpack(source)


def _has_converters(tree: Path) -> bool:
    return all((tree / c).is_file() for c in CONVERTERS)


def _download_sdist(version: str) -> Path:
    sdist = CACHE / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        print(f"fetching the llama-cpp-python {version} sdist for llama.cpp's converters into {CACHE}", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(CACHE)]
        done = subprocess.run([*cmd, f"llama-cpp-python=={version}"], capture_output=True, text=True)
        if done.returncode or not sdist.exists():
            raise SystemExit(
                f"pip could not fetch the llama-cpp-python {version} sdist ({done.stderr.strip()[-500:]}); fetch it "
                f"where pip can (pip download --no-binary :all: --no-deps llama-cpp-python=={version}) and pass "
                "it with --llama-cpp"
            )
    return sdist


def _unpack(sdist: Path) -> Path:
    """The converters' part of the llama.cpp tree inside ``sdist``, extracted once into the cache."""
    out = CACHE / sdist.name.removesuffix(".tar.gz")
    cached = out / out.name / "vendor" / "llama.cpp"  # an sdist's files sit under its own name
    if _has_converters(cached):
        return cached
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        prefix = f"{root}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.removeprefix(prefix).startswith(_SOURCE_PARTS)]
        if not members:
            raise SystemExit(f"{sdist} holds no vendor/llama.cpp converters: is it the llama-cpp-python sdist?")
        tar.extractall(out, members=members, filter="data")
    return out / root / "vendor" / "llama.cpp"


def convert(
    tree: Path, model: Path, adapters: dict[str, Path], out: Path, base_type: str = "f32", adapter_type: str = "f32"
) -> tuple[Path, dict[str, Path]]:
    """``model`` (as ``base_type``: f32, f16, q8_0) and ``adapters`` (as ``adapter_type``) as GGUF files
    under ``out``, written by llama.cpp's converters (run as scripts with this Python, two at a time)."""
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"base-{base_type}.gguf"
    jobs = [[str(tree / CONVERTERS[0]), str(model), "--outtype", base_type, "--outfile", str(base)]]
    files = {name: out / f"{name}-{adapter_type}.gguf" for name in adapters}
    for name, path in adapters.items():
        args = [str(path), "--base", str(model), "--outtype", adapter_type, "--outfile", str(files[name])]
        jobs.append([str(tree / CONVERTERS[1]), *args])

    def run(args: list[str]) -> None:
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{Path(args[0]).name} failed on {args[1]}:\n{done.stderr[-3000:]}")

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, jobs))
    return base, files


class LlamaCppPeer:
    """One llama.cpp model (the base GGUF, every adapter GGUF loaded against it) running greedy decoding
    of whole batches on token ids (no tokenizer, no sampler: the argmax of each row's logits), in a
    context per :class:`Setting` (the last few kept).

    One KV stream per sequence (``kv_unified`` off, llama.cpp's default), ``threads`` for decoding and
    for batches alike.
    """

    KEEP = 3  # contexts kept: one per mode when each mode's best setting differs

    def __init__(self, model: Path, adapters: dict[str, Path], *, threads: int, max_seqs: int, max_len: int):
        import llama_cpp as lc

        self._lc = lc
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load chatter on stderr
        lc.llama_backend_init()
        self._model = lc.llama_model_load_from_file(str(model).encode(), lc.llama_model_default_params())
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        self._adapters = {
            name: lc.llama_adapter_lora_init(self._model, str(p).encode()) for name, p in adapters.items()
        }
        for name, handle in self._adapters.items():
            if not handle:
                raise RuntimeError(f"llama.cpp could not load the adapter {name} ({adapters[name]})")
        self._vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self._threads, self._max_seqs, self._max_len = threads, max_seqs, max_len
        self._contexts: dict[Setting, _Context] = {}

    def context(self, setting: Setting) -> _Context:
        """The context of ``setting``, made on first use; the least recently used beyond :attr:`KEEP` freed."""
        if setting in self._contexts:
            self._contexts[setting] = self._contexts.pop(setting)  # most recently used last
            return self._contexts[setting]
        while len(self._contexts) >= self.KEEP:
            self._contexts.pop(next(iter(self._contexts))).close()
        lc = self._lc
        params = lc.llama_context_default_params()
        params.n_ctx = self._max_seqs * -(-self._max_len // 256) * 256  # each sequence's share rounds up to 256
        params.n_batch = N_BATCH
        params.n_ubatch = min(setting.ubatch, N_BATCH)
        params.n_seq_max = self._max_seqs
        params.n_threads = params.n_threads_batch = self._threads
        params.type_k = params.type_v = KV_TYPES[setting.kv_type]
        params.flash_attn_type = FLASH_ATTN[setting.flash_attn]
        ctx = lc.llama_init_from_model(self._model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context at {setting}")
        self._contexts[setting] = made = _Context(lc, ctx, self._adapters, self._vocab)
        return made

    def generate(
        self,
        setting: Setting,
        prompts: Sequence[list[int]],
        adapters: Sequence[str | None],
        new_tokens: int,
        *,
        switch_per_step: bool,
    ) -> list[list[int]]:
        """Greedy ``new_tokens`` for each prompt on its adapter (``None``: the base), at ``setting``.

        Rows on one adapter form one batch. ``switch_per_step``: every batch is in flight at once and
        each step makes one decode call per batch, setting that batch's adapter before it. Otherwise
        the batches run one after another, each to its end on its adapter (one decode call a step).
        """
        ctx = self.context(setting)
        groups: dict[str | None, list[int]] = {}
        for i, a in enumerate(adapters):
            groups.setdefault(a, []).append(i)
        tokens: list[list[int]] = [[] for _ in prompts]
        waves = [list(groups.items())] if switch_per_step else [[g] for g in groups.items()]
        for wave in waves:
            ctx.clear()
            # A batch's sequences get neighbouring ids: with a KV stream per sequence, llama.cpp's
            # attention spans the streams from a batch's lowest id to its highest.
            seq = {i: k for k, i in enumerate(i for _, rows in wave for i in rows)}
            for step in range(new_tokens):
                for adapter, rows in wave:
                    ctx.set_adapter(adapter)
                    if step == 0:
                        entries = [
                            (seq[i], pos, t, pos == len(prompts[i]) - 1)
                            for i in rows
                            for pos, t in enumerate(prompts[i])
                        ]
                    else:
                        entries = [(seq[i], len(prompts[i]) + step - 1, tokens[i][-1], True) for i in rows]
                    for i, t in zip(rows, ctx.decode(entries)):
                        tokens[i].append(t)
        return tokens

    def close(self) -> None:
        """Free the contexts, adapters and model."""
        lc = self._lc
        for ctx in self._contexts.values():
            ctx.close()
        for handle in self._adapters.values():
            lc.llama_adapter_lora_free(handle)
        lc.llama_model_free(self._model)


class _Context:
    """A llama.cpp context with its batch and the adapter set on it."""

    def __init__(self, lc: Any, ctx: Any, adapters: dict[str, Any], vocab: int):
        self._lc, self._ctx, self._adapters, self._vocab = lc, ctx, adapters, vocab
        self._batch = lc.llama_batch_init(N_BATCH, 0, 1)
        self._current: str | None | bool = False  # the adapter set (False: none set yet)

    def clear(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self._ctx), True)

    def set_adapter(self, name: str | None) -> None:
        if name == self._current:
            return
        lc = self._lc
        if name is None:
            lc.llama_set_adapters_lora(self._ctx, None, 0, None)
        else:
            handles = (lc.llama_adapter_lora_p_ctypes * 1)(self._adapters[name])
            lc.llama_set_adapters_lora(self._ctx, handles, 1, (ctypes.c_float * 1)(1.0))  # alpha / r from the GGUF
        self._current = name

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One ``llama_decode`` of ``(sequence, position, token, wants_logits)`` entries; the argmax
        token of each entry that wanted logits, in order."""
        import numpy as np

        b = self._batch
        for k, (seq, pos, token, wants) in enumerate(entries):
            b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = token, pos, 1, wants
            b.seq_id[k][0] = seq
        b.n_tokens = len(entries)
        if rc := self._lc.llama_decode(self._ctx, b):
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(e[3] for e in entries)
        rows = np.ctypeslib.as_array(self._lc.llama_get_logits(self._ctx), shape=(n_out, self._vocab))
        return rows.argmax(axis=1).tolist()

    def close(self) -> None:
        self._lc.llama_batch_free(self._batch)
        self._lc.llama_free(self._ctx)


def worker() -> None:
    """The worker loop (``peer_proc.serve``): ``version``; ``load`` (model, adapters, threads, max_seqs,
        max_len); ``run`` (setting, prompts, adapters, new, switch): the tokens and the seconds they took (wall clock,
    and this process's CPU time)."""
    import time

    from peer_proc import serve

    state: dict[str, LlamaCppPeer] = {}

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        if req["op"] == "version":
            import llama_cpp

            return {"version": llama_cpp.__version__, "system": llama_cpp.llama_print_system_info().decode()}
        if req["op"] == "load":
            if "peer" in state:
                state.pop("peer").close()
            adapters = {name: Path(p) for name, p in req["adapters"].items()}
            state["peer"] = LlamaCppPeer(
                Path(req["model"]), adapters, threads=req["threads"], max_seqs=req["max_seqs"], max_len=req["max_len"]
            )
            return {}
        if req["op"] == "run":
            setting = Setting.parse(req["setting"])
            state["peer"].context(setting)  # made before the clock starts
            start, cpu = time.perf_counter(), time.process_time()
            tokens = state["peer"].generate(
                setting, req["prompts"], req["adapters"], req["new"], switch_per_step=req["switch"]
            )
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
            return {"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": tokens}
        raise ValueError(f"unknown op {req['op']!r}")

    try:
        serve(handle)
    finally:
        if "peer" in state:
            state["peer"].close()


if __name__ == "__main__":
    worker()
