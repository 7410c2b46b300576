"""Checkpoints: one ``.npz`` file with the model, the optimizer state and a JSON header.

Written atomically: the data goes to a temporary file in the same folder, is flushed to disk, and
only then renamed over the old checkpoint (``os.replace`` is atomic on POSIX). A crash mid-write
leaves the previous checkpoint intact, never a half-written one. No pickle: arrays and JSON only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy


def save(path, model_state: dict, optim_state: dict, meta: dict) -> None:
    arrays = {f"model/{k}": v for k, v in model_state.items()}
    scalars = {}
    for i, s in optim_state["state"].items():
        for k, v in s.items():
            if hasattr(v, "shape"):
                arrays[f"optim/{i}/{k}"] = v
            else:
                scalars[f"{i}/{k}"] = v
    header = dict(meta, optim_lr=optim_state["lr"], optim_scalars=scalars)
    arrays["__meta__"] = numpy.frombuffer(json.dumps(header).encode(), dtype=numpy.uint8)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            numpy.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path):
    """Return ``(model_state, optim_state, meta)`` as saved by :func:`save`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (train with --out to create one)")
    with numpy.load(path) as f:
        meta = json.loads(bytes(f["__meta__"]).decode())
        model_state = {k[len("model/"):]: f[k] for k in f.files if k.startswith("model/")}
        state: dict = {}
        for k in f.files:
            if k.startswith("optim/"):
                _, i, name = k.split("/", 2)
                state.setdefault(int(i), {})[name] = f[k]
    for key, v in meta.pop("optim_scalars").items():
        i, name = key.split("/", 1)
        state.setdefault(int(i), {})[name] = v
    return model_state, {"lr": meta.pop("optim_lr"), "state": state}, meta
