"""Timeline tracing: spans of compute and communication per rank, exported as a Chrome trace.

Off by default. When off, :func:`span` and :func:`record` return at once (one module-level flag
check), so library code may call them everywhere. Turn it on with :func:`enable` or the environment
variable ``TINYTRAIN_TRACE=1``.

A span is a dict::

    {"name": "all_reduce", "cat": "comm", "rank": 0, "start": <us>, "end": <us>, "args": {...}}

``start``/``end`` are microseconds of wall-clock time (``time.time`` at import, advanced by the
monotonic ``perf_counter``), so spans from different processes on one machine line up.
Communication spans carry ``group``, ``peer`` and ``bytes`` in ``args``.

Typical use::

    trace.enable()
    with trace.span("forward", cat="compute", layer=3):
        ...
    spans = trace.merge()                 # every rank's spans, on rank 0 (None elsewhere)
    trace.write_chrome("trace.json", spans)   # open in https://ui.perfetto.dev
"""

from __future__ import annotations

import contextlib
import json
import time

from tinytrain import env

enabled: bool = env.switch("TINYTRAIN_TRACE", what="record spans")  # a bad value: one sentence
_spans: list[dict] = []
_rank: int | None = None  # set by tinytrain.distributed (see set_rank)
_merge = None  # set by tinytrain.distributed (see set_merge)

# Wall-clock anchor: perf_counter is precise but its zero differs per process; time.time is shared.
_WALL0_US = time.time() * 1e6
_PERF0 = time.perf_counter()


def now() -> float:
    """Microseconds on the shared timeline."""
    return _WALL0_US + (time.perf_counter() - _PERF0) * 1e6


def enable(on: bool = True) -> None:
    """Start (or with ``on=False`` stop) recording spans."""
    global enabled
    enabled = bool(on)


def clear() -> None:
    """Forget all spans recorded so far on this rank."""
    _spans.clear()


def spans() -> list[dict]:
    """This rank's spans (the live list)."""
    return _spans


def set_rank(rank: int | None) -> None:
    """The rank spans are recorded under (``tinytrain.distributed`` sets it when it starts; None: 0)."""
    global _rank
    _rank = rank


def _my_rank() -> int:
    return 0 if _rank is None else _rank


def record(name: str, cat: str, start: float, end: float, **args) -> None:
    """Record a finished span from ``start`` to ``end`` (values from :func:`now`)."""
    if not enabled:
        return
    _spans.append({"name": name, "cat": cat, "rank": _my_rank(), "start": start, "end": end, "args": args})


@contextlib.contextmanager
def span(name: str, cat: str = "compute", **args):
    """Record the ``with`` block as one span. Extra keyword arguments land in ``args``."""
    if not enabled:
        yield
        return
    start = now()
    try:
        yield
    finally:
        record(name, cat, start, now(), **args)


def merge(group=None) -> list[dict] | None:
    """Collect every rank's spans on rank 0 of ``group``; return them there, None elsewhere.

    The collecting is done by ``tinytrain.distributed`` with its own collectives (this module sits
    below it and imports nothing of it: importing ``tinytrain.distributed`` registers the merge
    with :func:`set_merge`). Tracing is paused while it runs, so the merge does not record itself.
    Without ``tinytrain.distributed`` there is one process, and its spans are all there is.
    """
    global enabled
    if _merge is None:
        return list(_spans)
    was, enabled = enabled, False
    try:
        return _merge(_spans, group)
    finally:
        enabled = was


def set_merge(fn) -> None:
    """Use ``fn(spans, group)`` for :func:`merge`: every rank's spans on rank 0 of ``group``, None elsewhere."""
    global _merge
    _merge = fn


def to_chrome(span_list: list[dict]) -> dict:
    """Chrome trace-event JSON: one process row per rank, one thread row per category."""
    events = []
    for s in span_list:
        events.append(
            {
                "name": s["name"],
                "cat": s["cat"],
                "ph": "X",
                "pid": s["rank"],
                "tid": s["cat"],
                "ts": s["start"],
                "dur": max(0.0, s["end"] - s["start"]),
                "args": s["args"],
            }
        )
    for rank in sorted({s["rank"] for s in span_list}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome(path: str, span_list: list[dict] | None = None) -> None:
    """Write ``span_list`` (default: this rank's spans) as Chrome trace JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(to_chrome(_spans if span_list is None else span_list), f)


def read_chrome(path: str) -> list[dict]:
    """The spans of a file written by :func:`write_chrome` (the inverse of :func:`to_chrome`)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [
        {
            "name": e["name"],
            "cat": e["cat"],
            "rank": e["pid"],
            "start": e["ts"],
            "end": e["ts"] + e["dur"],
            "args": e.get("args", {}),
        }
        for e in events
        if e.get("ph") == "X"
    ]
