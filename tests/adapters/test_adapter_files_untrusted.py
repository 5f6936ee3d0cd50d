"""Adapter files are untrusted (issue 26, case 3): a FIFO under an adapter root is refused at once
and holds no I/O thread; a sparse file is refused by its size before it is read, at registration
and at load; and every load re-checks the directory against the roots its tenant may read from,
not against ``/``. Over a real server, real files, a real FIFO and a real sparse file."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from server_harness import Server, assert_openai_error, make_engine, make_roots, running_server

from lorapage.tiny import DEMO_MARKERS, demo_adapter_dirs

COMP = "/v1/completions"
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
SPARSE_BYTES = 512 << 20  # costs no disk and no time to make; reading it whole costs all of it


def _copy(name: str, dest: Path) -> Path:
    shutil.copytree(demo_adapter_dirs()[name], dest)
    return dest


def _bytes_read() -> int:
    """Bytes this process has read by read(2) and friends (``rchar``), whatever the thread."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@contextmanager
def _fifos(*paths: Path) -> Iterator[None]:
    """FIFOs at ``paths``; on the way out a reader still blocked on one (a server that opened it
    waiting) is released by a writer that opens and closes it, so no test hangs at exit."""
    for path in paths:
        path.unlink(missing_ok=True)
        os.mkfifo(path)
    try:
        yield
    finally:
        for path in paths:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                assert exc.errno == errno.ENXIO  # no reader: nothing was left blocked on it


async def _register(srv: Server, adapter_id: str, path: Path, tenant: str = "alpha"):
    body = {"id": adapter_id, "source": str(path), "tenant": tenant}
    return await srv.post("/v1/adapters", body, tenant=None, headers=srv.admin())


def _complete(model: str) -> dict:
    return {"model": model, "prompt": "Hi", "max_tokens": 40, "temperature": 0}


async def test_a_fifo_in_an_adapter_directory_is_refused_at_once_and_holds_no_thread(tmp_path):
    """With one I/O thread, a FIFO that blocked it would stop every later registration and load:
    both FIFOs (config and weights) are refused as what they are, and the thread stays free."""
    root = tmp_path / "root"
    fifo_weights = _copy("acme", root / "fifo-weights")
    fifo_config = _copy("acme", root / "fifo-config")
    _copy("globex", root / "good")
    engine = make_engine(make_roots(root), io_threads=1)
    try:
        with _fifos(fifo_weights / WEIGHTS, fifo_config / CONFIG):
            async with running_server(engine) as srv:
                for adapter_id, path, name in (("fw", fifo_weights, WEIGHTS), ("fc", fifo_config, CONFIG)):
                    status, body, _ = await _register(srv, adapter_id, path)
                    assert status == 400, body
                    assert_openai_error(body, 400, "source")
                    assert body["error"]["code"] == "invalid_adapter"
                    assert f"{name} is a FIFO, not a regular file" in body["error"]["message"], body
                status, body, _ = await _register(srv, "good", root / "good")
                assert status == 201, body
                status, out, _ = await srv.post(COMP, _complete("good"))
                assert status == 200 and out["choices"][0]["text"] == DEMO_MARKERS["globex"], out
    finally:
        await engine.close()


async def test_a_sparse_weights_file_is_refused_by_its_size_before_it_is_read(tmp_path):
    """Registration reads the header alone: a file extended past its tensors is refused before
    its data is read. A registered file later swapped for a larger one is refused at load by the
    size registration found, before it is read: neither read costs the file's size."""
    root = tmp_path / "root"
    sparse = _copy("acme", root / "sparse")
    with (sparse / WEIGHTS).open("r+b") as f:
        f.truncate(SPARSE_BYTES)
    swapped = _copy("globex", root / "swapped")
    engine = make_engine(make_roots(root))
    try:
        async with running_server(engine) as srv:
            before = _bytes_read()
            status, body, _ = await _register(srv, "sparse", sparse)
            assert status == 400 and body["error"]["code"] == "invalid_adapter", body
            assert "bytes after the last tensor" in body["error"]["message"], body
            assert _bytes_read() - before < SPARSE_BYTES // 8, "the sparse file was read at registration"

            status, body, _ = await _register(srv, "swapped", swapped)
            assert status == 201, body
            with (swapped / WEIGHTS).open("r+b") as f:  # same header and tensors, then half a gigabyte
                f.truncate(SPARSE_BYTES)
            before = _bytes_read()
            status, body, _ = await srv.post(COMP, _complete("swapped"))
            assert status == 400 and body["error"]["code"] == "invalid_adapter", body
            assert _bytes_read() - before < SPARSE_BYTES // 8, "the swapped file was read at load"
            status, out, _ = await srv.post(COMP, _complete("acme"))  # the others keep serving
            assert status == 200 and out["choices"][0]["text"] == DEMO_MARKERS["acme"], out
    finally:
        await engine.close()


async def test_every_load_rechecks_the_directory_against_the_real_roots(tmp_path, caplog):
    """A registered directory whose weights later become a link out of the root (to the very
    same bytes, so the digest holds) is refused at the next load, as registration would refuse
    it; the tenant's error names no path, the operator's log says why."""
    root = tmp_path / "root"
    adapter = _copy("acme", root / "a")
    outside = _copy("acme", tmp_path / "outside")
    engine = make_engine(make_roots(root))
    try:
        async with running_server(engine) as srv:
            status, body, _ = await _register(srv, "linked", adapter)
            assert status == 201, body
            (adapter / WEIGHTS).unlink()
            (adapter / WEIGHTS).symlink_to(outside / WEIGHTS)
            status, body, _ = await srv.post(COMP, _complete("linked"))
            assert status == 502, body
            assert_openai_error(body, 502, "model")
            assert body["error"]["code"] == "adapter_source_failed"
            assert str(tmp_path) not in body["error"]["message"], body
            assert any("links outside the adapter root" in r.getMessage() for r in caplog.records)
            (adapter / WEIGHTS).unlink()
            shutil.copy(outside / WEIGHTS, adapter / WEIGHTS)  # back in the root: served again
            status, out, _ = await srv.post(COMP, _complete("linked"))
            assert status == 200 and out["choices"][0]["text"] == DEMO_MARKERS["acme"], out
    finally:
        await engine.close()
