"""Deploying the fleet's application with a deadline: running in time, or an error with Ray's reason.

``serve.run`` waits until every deployment is running, which is forever when Ray cannot place a
replica (too few CPUs, a GPU the cluster lacks): Ray only logs that the replica "has taken more
than 30s to be scheduled". Here the deployment runs on a thread while this one watches
``serve.status()``; past the deadline, or when a deployment fails, the caller gets
:class:`StartError` carrying what Ray says about each deployment that is not running.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from lorapage.fleet.config import APP_NAME

START_TIMEOUT_S = 120.0
_POLL_S = 0.5


class StartError(RuntimeError):
    """The application did not start: why, in Ray's words."""


def run_app(
    app: Any,
    needs: dict[str, dict[str, float]],
    timeout_s: float = START_TIMEOUT_S,
    *,
    name: str = APP_NAME,
    timeout_flag: str = "--start-timeout",
) -> Any:
    """``serve.run(app)`` under ``timeout_s``: the application's handle once every deployment runs;
    :class:`StartError` when one failed or the deadline passed (the caller then takes it down).
    ``needs``: what one replica of each deployment reserves (``{"CPU": 1.0}``), for the message.
    ``name``: the application's (a dedicated deployment has its own). No application has an HTTP
    route of Ray's: the fleet's ingress listens itself (:mod:`lorapage.fleet.ingress`)."""
    from ray import serve

    result: dict[str, Any] = {}

    def deploy() -> None:
        try:
            result["handle"] = serve.run(app, name=name, route_prefix=None)
        except Exception as exc:  # reported by the watching thread
            result["error"] = exc

    thread = threading.Thread(target=deploy, name="lorapage-fleet-deploy", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(_POLL_S)
        if failed := _problems(serve.status(), name, failed_only=True):
            raise StartError(f"a deployment failed: {failed}")
    if "error" in result:
        raise StartError(f"Ray Serve refused the application: {result['error']}")
    if "handle" not in result:
        raise StartError(
            f"not every deployment was running after {timeout_s:g}s ({timeout_flag}): "
            f"{_problems(serve.status(), name, failed_only=False, needs=needs) or 'Ray gave no reason'}"
        )
    return result["handle"]


def _problems(status: Any, name: str, *, failed_only: bool, needs: dict[str, dict[str, float]] | None = None) -> str:
    """What Ray says about each deployment of application ``name`` that is not healthy (only the
    failed ones with ``failed_only``), with what one of its replicas needs against what the
    cluster has (``needs``), as one line."""
    overview = status.applications.get(name)
    if overview is None:
        return ""
    parts = []
    for name, dep in overview.deployments.items():
        state = str(getattr(dep.status, "value", dep.status))
        if state == "HEALTHY" or (failed_only and "FAIL" not in state):
            continue
        said = dep.message.strip() or "no message yet"
        parts.append(f"{name} {state} (Ray: {said}){_against_cluster(needs.get(name)) if needs else ''}")
    if not parts and "FAIL" in str(overview.status):
        parts.append(overview.message.strip())
    return "; ".join(parts)


def _against_cluster(need: dict[str, float] | None) -> str:
    if not need:
        return ""
    import ray

    total = ray.cluster_resources()
    wants = ", ".join(f"{k} {v:g}" for k, v in need.items() if v)
    has = ", ".join(f"{k} {total.get(k, 0.0):g}" for k, v in need.items() if v)
    return f"; each replica needs {wants}, the whole cluster has {has}"
