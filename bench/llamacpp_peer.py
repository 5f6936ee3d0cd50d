"""llama.cpp as a peer: the base and adapters converted by llama.cpp's own converters, greedy batches
run through llama-cpp-python's C API on token ids.

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

import numpy as np

CONVERTERS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lorapage" / "peers"
# What the converters need from the llama.cpp tree: the scripts, the model classes, the GGUF writer.
_SOURCE_PARTS = (*CONVERTERS, "conversion/", "gguf-py/")
KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids (GGML_TYPE_F32, GGML_TYPE_F16)


def converter_dir(source: Path | None) -> Path:
    """The llama.cpp source holding the converters: ``source`` itself (a llama.cpp tree, or an unpacked
    llama-cpp-python sdist), the tree inside ``source`` when it is the sdist (``.tar.gz``, unpacked once
    into the cache), or, with no ``source``, the sdist of the installed llama-cpp-python, fetched once
    into the cache."""
    if source is None:
        return _unpack(_download_sdist())
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


def _download_sdist() -> Path:
    import llama_cpp

    version = llama_cpp.__version__
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


def convert(tree: Path, model: Path, adapters: dict[str, Path], out: Path) -> tuple[Path, dict[str, Path]]:
    """``model`` and ``adapters`` as float32 GGUF files under ``out``, written by llama.cpp's converters
    (run as scripts with this Python, two at a time)."""
    out.mkdir(parents=True, exist_ok=True)
    base = out / "base.gguf"
    jobs = [[str(tree / CONVERTERS[0]), str(model), "--outtype", "f32", "--outfile", str(base)]]
    files = {name: out / f"{name}.gguf" for name in adapters}
    for name, path in adapters.items():
        args = [str(path), "--base", str(model), "--outtype", "f32", "--outfile", str(files[name])]
        jobs.append([str(tree / CONVERTERS[1]), *args])

    def run(args: list[str]) -> None:
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{Path(args[0]).name} failed on {args[1]}:\n{done.stderr[-3000:]}")

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, jobs))
    return base, files


class LlamaCppPeer:
    """One llama.cpp context over the base GGUF with every adapter GGUF loaded, running greedy decoding
    of whole batches on token ids (no tokenizer, no sampler: the argmax of each row's logits).

    One KV stream per sequence; the KV cache in ``kv_type`` (llama.cpp's default, float16, runs its
    attention about twice as fast here as float32).
    """

    def __init__(
        self,
        model: Path,
        adapters: dict[str, Path],
        *,
        threads: int,
        max_seqs: int,
        max_len: int,
        kv_type: str = "f16",
    ):
        import llama_cpp as lc

        self._lc = lc
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its load chatter on stderr
        lc.llama_backend_init()
        self._model = lc.llama_model_load_from_file(str(model).encode(), lc.llama_model_default_params())
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        params = lc.llama_context_default_params()
        params.n_ctx = max_seqs * -(-max_len // 256) * 256  # llama.cpp rounds each sequence's share up to 256
        params.n_batch = params.n_ubatch = max_seqs * max_len  # any step's tokens in one decode call
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = KV_TYPES[kv_type]
        self._ctx = lc.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self._adapters = {
            name: lc.llama_adapter_lora_init(self._model, str(p).encode()) for name, p in adapters.items()
        }
        for name, handle in self._adapters.items():
            if not handle:
                raise RuntimeError(f"llama.cpp could not load the adapter {name} ({adapters[name]})")
        self._vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self._batch = lc.llama_batch_init(params.n_batch, 0, 1)
        self._current: str | None | bool = False  # the adapter set on the context (False: none set yet)

    def generate(
        self, prompts: Sequence[list[int]], adapters: Sequence[str | None], new_tokens: int, *, switch_per_step: bool
    ) -> list[list[int]]:
        """Greedy ``new_tokens`` for each prompt on its adapter (``None``: the base).

        Rows on one adapter form one batch. ``switch_per_step``: every batch is in flight at once and
        each step makes one decode call per batch, setting that batch's adapter before it. Otherwise
        the batches run one after another, each to its end on its adapter (one decode call a step).
        """
        groups: dict[str | None, list[int]] = {}
        for i, a in enumerate(adapters):
            groups.setdefault(a, []).append(i)
        tokens: list[list[int]] = [[] for _ in prompts]
        waves = [list(groups.items())] if switch_per_step else [[g] for g in groups.items()]
        for wave in waves:
            self._lc.llama_memory_clear(self._lc.llama_get_memory(self._ctx), True)
            # A batch's sequences get neighbouring ids: with a KV stream per sequence, llama.cpp's
            # attention spans the streams from a batch's lowest id to its highest.
            seq = {i: k for k, i in enumerate(i for _, rows in wave for i in rows)}
            for step in range(new_tokens):
                for adapter, rows in wave:
                    self._set_adapter(adapter)
                    if step == 0:
                        entries = [
                            (seq[i], pos, t, pos == len(prompts[i]) - 1)
                            for i in rows
                            for pos, t in enumerate(prompts[i])
                        ]
                    else:
                        entries = [(seq[i], len(prompts[i]) + step - 1, tokens[i][-1], True) for i in rows]
                    for i, t in zip(rows, self._decode(entries)):
                        tokens[i].append(t)
        return tokens

    def _set_adapter(self, name: str | None) -> None:
        if name == self._current:
            return
        lc = self._lc
        if name is None:
            lc.llama_set_adapters_lora(self._ctx, None, 0, None)
        else:
            handles = (lc.llama_adapter_lora_p_ctypes * 1)(self._adapters[name])
            lc.llama_set_adapters_lora(self._ctx, handles, 1, (ctypes.c_float * 1)(1.0))  # alpha / r from the GGUF
        self._current = name

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One ``llama_decode`` of ``(sequence, position, token, wants_logits)`` entries; the argmax
        token of each entry that wanted logits, in order."""
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
        """Free the batch, adapters, context and model."""
        lc = self._lc
        lc.llama_batch_free(self._batch)
        for handle in self._adapters.values():
            lc.llama_adapter_lora_free(handle)
        lc.llama_free(self._ctx)
        lc.llama_model_free(self._model)
