"""Checkpoints that do not depend on the layout that wrote them.

A checkpoint is a folder::

    ckpt/
      manifest.json            written last, atomically: the checkpoint exists once this names it
      step-000200/
        rank-00000.npz         the pieces rank 0 wrote, one flat array per dtype (.json: where each sits)
        rank-00001.npz         ...

Every *logical tensor* is named as in the serial model: parameter ``blocks.0.attn.q.weight``, and
its optimizer state ``blocks.0.attn.q.weight`` field ``exp_avg``. A rank writes only the pieces it
holds (and only one rank writes a piece that several hold); a ``Piece`` says where its array sits
in the logical tensor: the slice ``[start, stop)`` along ``axis`` (tensor parallel), then, of that
slice flattened, elements ``[flat_start, flat_stop)`` (ZeRO). Nothing about ranks or meshes is
needed to read it back: ``Reader.read(name, field)`` assembles the whole logical tensor from
whichever pieces cover it, and the new layout cuts out what each of its ranks holds.

Saving: every rank writes its files into a fresh ``step-N/`` folder (temporary name, flush,
fsync, rename); after a barrier, rank 0 checks that every rank's index is there and replaces
``manifest.json`` atomically. A crash at any moment before that leaves the previous manifest, which
still names the previous complete folder. Then older folders are removed, and so are temporary
files that killed runs left behind. No pickle: arrays and JSON.

Asynchronous (``--ckpt-async``): at the step's end each rank copies its pieces to host memory (the
snapshot, the only part training waits for) and a :class:`BackgroundWrite` thread writes them while
the next steps run. The manifest is replaced only once every rank's write has finished, as the
ranks agree at a later step's end; a rank killed during the background write leaves the manifest
naming the previous checkpoint, whole. One write at a time: the next save waits for the last.

Every file tinytrain writes (checkpoint pieces, ``metrics.json``, figures) goes through
:func:`atomic_write`: a reader sees the old file or the new one, never half of one, and every file
gets the same permissions (``0666`` minus the umask, as ``open()`` would give). A save that fails
(disk full, read-only folder) raises :class:`CheckpointError` naming the step and the reason; the
previous checkpoint stays the one the manifest names. A damaged or truncated checkpoint is a
:class:`CheckpointError` too, never a zip or JSON traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy

from tinytrain.backend import is_low_precision, to_host, xp

MANIFEST = "manifest.json"
FORMAT = "tinytrain-checkpoint-1"


@dataclass(frozen=True)
class Placement:
    """Where a rank's parameter comes from: the serial ``name``, and (tensor parallel) the slice
    ``[start, stop)`` along ``axis`` that this rank holds (``axis`` None: the whole tensor)."""

    name: str
    axis: int | None = None
    start: int | None = None
    stop: int | None = None

    def cut(self, full):
        """This rank's part of the serial tensor ``full``."""
        if self.axis is None:
            return full
        index = [slice(None)] * full.ndim
        index[self.axis] = slice(self.start, self.stop)
        return full[tuple(index)]


@dataclass(frozen=True)
class Piece:
    """Part of logical tensor ``name`` (field ``param`` or an optimizer state field)."""

    name: str
    field: str
    axis: int | None = None
    start: int | None = None
    stop: int | None = None
    flat_start: int | None = None
    flat_stop: int | None = None


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read, in one sentence that says what to do."""


def _file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_MODE = _file_mode()
TEMP_SUFFIX = ".tmp"


LOCK_NAME = ".lock"


@contextmanager
def folder_lock(folder, flag: str, hold: bool = True):
    """Hold ``folder`` for this run: a second run into it meanwhile is refused in a sentence.

    An advisory lock (``flock``) on a file in the folder, which the kernel drops when the process
    ends however it ends: a killed run never leaves the folder locked. The file names the holder,
    for the message. ``hold=False`` (ranks other than the one that writes) does nothing."""
    if not hold:
        yield
        return
    import fcntl
    import socket
    import time

    fd = os.open(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 300).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ValueError(
            f"{flag} {folder} is in use by a run that is still going ({holder}); wait for it to end, "
            f"or choose another {flag}"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}".encode())
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a new holder)


def atomic_write(path, write) -> None:
    """``write(f)`` into a temporary file next to ``path`` (binary), flush, fsync, rename over
    ``path``. The temporary is named ``<name>.<random>.tmp``: :func:`remove_temporaries` finds the
    ones a killed process left."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, _MODE)  # mkstemp makes 0600; every output gets the same mode as open() gives
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def remove_temporaries(folder) -> None:
    """Delete what :func:`atomic_write` calls left in ``folder`` when their process was killed."""
    for stale in Path(folder).glob("*" + TEMP_SUFFIX):
        stale.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_folder(step: int) -> str:
    return f"step-{step:09d}"


def write_pieces(folder, step: int, rank: int, pieces: list[tuple[Piece, object]], scalars: dict) -> None:
    """One rank's part of a save: its ``(Piece, host array)`` pairs into ``folder/step-N/``, and
    ``scalars`` (name -> {field: number}: AdamW's step count) into its index."""
    target = Path(folder) / step_folder(step)
    # One flat array per dtype, each piece at an offset: a zip member costs ~0.2 ms of Python (a
    # header, a CRC), and a model has a hundred pieces or more; one member each made the default
    # model's save 5x slower, and a background write holds the GIL that long.
    packed: dict[str, list] = {}
    entries = []
    for piece, array in pieces:
        array = numpy.asarray(array)
        parts = packed.setdefault(array.dtype.name, [])
        offset = sum(part.size for part in parts)
        parts.append(array.reshape(-1))
        entries.append(dict(asdict(piece), array=array.dtype.name, offset=offset, shape=list(array.shape)))
    arrays = {name: numpy.concatenate(parts) for name, parts in packed.items()}
    index = {"pieces": entries, "scalars": scalars}
    with _saving(folder, step):
        target.mkdir(parents=True, exist_ok=True)
        atomic_write(target / f"rank-{rank:05d}.npz", lambda f: numpy.savez(f, **arrays))
        atomic_write(target / f"rank-{rank:05d}.json", lambda f: f.write(json.dumps(index).encode()))


class BackgroundWrite:
    """``write_pieces`` on a thread: the arrays are this rank's own host copies, which training no
    longer touches. ``finished`` once the files are on disk (or failed: ``error``)."""

    def __init__(self, folder, step: int, rank: int, pieces: list[tuple[Piece, object]], scalars: dict):
        self.step, self.error = step, None
        self.thread = threading.Thread(
            target=self._write, args=(folder, step, rank, pieces, scalars), name=f"checkpoint {step}", daemon=True
        )  # daemon: a run that fails meanwhile exits without it, and the manifest keeps the previous checkpoint
        self.thread.start()

    def _write(self, folder, step, rank, pieces, scalars) -> None:
        try:
            write_pieces(folder, step, rank, pieces, scalars)
        except BaseException as error:  # raised in the training thread, where the ranks agree on the save
            self.error = error

    @property
    def finished(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> None:
        self.thread.join()


class _saving:
    """Turn an OSError of a save (disk full, read-only folder) into a sentence about the checkpoint."""

    def __init__(self, folder, step: int):
        self.folder, self.step = folder, step

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, OSError):
            raise CheckpointError(
                f"could not save the checkpoint of step {self.step} in {self.folder} "
                f"({exc.strerror or exc}); the previous checkpoint there is kept. Free space or "
                "choose a writable --out"
            ) from exc
        return False


def commit(folder, step: int, world_size: int, tensors: dict, meta: dict) -> None:
    """Rank 0, after every rank's ``write_pieces``: name the new folder in the manifest.

    ``tensors``: logical name -> shape; ``meta``: step, seed, optimizer scalars, metrics..."""
    folder = Path(folder)
    name = step_folder(step)
    missing = [r for r in range(world_size) if not (folder / name / f"rank-{r:05d}.json").is_file()]
    if missing:
        raise RuntimeError(f"checkpoint step {step}: ranks {missing} wrote no pieces; the previous checkpoint stays")
    manifest = {
        "format": FORMAT,
        "folder": name,
        "world_size": world_size,
        "tensors": {k: list(v) for k, v in tensors.items()},
        **meta,
    }
    with _saving(folder, step):
        _fsync_dir(folder / name)
        atomic_write(folder / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(folder)
    for old in folder.glob("step-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    remove_temporaries(folder)


class Reader:
    """Reads logical tensors back from a checkpoint folder, whatever layout wrote it."""

    def __init__(self, folder):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint at {self.folder} (no {MANIFEST}): train with --out to create one")
        with self._damaged(MANIFEST):
            self.manifest = json.loads(path.read_text())
            if self.manifest.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not a {FORMAT} manifest")
            world_size, tensors = self.manifest["world_size"], self.manifest["tensors"]
            data = self.folder / self.manifest["folder"]
        self.meta = self.manifest
        self.pieces: dict[tuple[str, str], list] = {}
        self.scalars: dict[str, dict] = {}
        for r in range(world_size):
            with self._damaged(f"{data.name}/rank-{r:05d}"):
                arrays = numpy.load(data / f"rank-{r:05d}.npz")
                index = json.loads((data / f"rank-{r:05d}.json").read_text())
                for name, fields in index["scalars"].items():
                    self.scalars.setdefault(name, {}).update(fields)
                members = _Members(arrays)
                for entry in index["pieces"]:
                    where = entry.pop("array"), entry.pop("offset", None), entry.pop("shape", None)
                    piece = Piece(**entry)
                    if piece.name not in tensors:
                        raise CheckpointError(f"piece of {piece.name!r}, a tensor the manifest does not list")
                    self.pieces.setdefault((piece.name, piece.field), []).append((piece, members, where))

    def _damaged(self, what: str):
        return _Damaged(self.folder, what)

    def names(self) -> list[str]:
        return list(self.manifest["tensors"])

    def fields(self, name: str) -> list[str]:
        return sorted({f for n, f in self.pieces if n == name})

    def read(self, name: str, field: str = "param") -> numpy.ndarray:
        """The whole logical tensor, assembled from its pieces; an error names what is missing."""
        if name not in self.manifest["tensors"]:
            raise KeyError(f"checkpoint {self.folder} has no tensor {name!r} (it has {len(self.names())})")
        shape = tuple(self.manifest["tensors"][name])
        full, covered = None, numpy.zeros(shape, dtype=bool)
        flats: dict = {}  # (axis, start, stop) -> (values, filled) of that slice, flattened
        for piece, members, where in self.pieces.get((name, field), []):
            with self._damaged(f"{name} ({field})"):
                array = members.piece(*where)
            if full is None:
                full = numpy.zeros(shape, dtype=array.dtype)
            where = Placement(name, piece.axis, piece.start, piece.stop)
            if piece.flat_start is None:
                where.cut(full)[...] = array.reshape(where.cut(full).shape)
                where.cut(covered)[...] = True
            else:
                size = where.cut(full).size
                values, filled = flats.setdefault(
                    (where.axis, where.start, where.stop), (numpy.zeros(size, array.dtype), numpy.zeros(size, bool))
                )
                values[piece.flat_start : piece.flat_stop] = array.reshape(-1)
                filled[piece.flat_start : piece.flat_stop] = True
        for (axis, start, stop), (values, filled) in flats.items():
            where = Placement(name, axis, start, stop)
            where.cut(full)[...] = values.reshape(where.cut(full).shape)
            where.cut(covered)[...] = filled.reshape(where.cut(covered).shape)
        if full is None or not covered.all():
            raise ValueError(
                f"checkpoint {self.folder}: the pieces of {name!r} ({field}) do not cover it; "
                "a rank's file is missing or damaged"
            )
        return full


class _Members:
    """A rank's ``.npz``, each member read once: a piece is a slice of its dtype's flat array (or,
    written before the arrays were packed, a member of its own)."""

    def __init__(self, npz):
        self.npz, self.loaded = npz, {}

    def piece(self, key: str, offset: int | None, shape: list | None) -> numpy.ndarray:
        if key not in self.loaded:
            self.loaded[key] = self.npz[key]
        array = self.loaded[key]
        if offset is None:
            return array
        size = int(numpy.prod(shape, dtype=numpy.int64))
        if offset + size > array.size:
            raise CheckpointError(f"a piece runs past the end of {key} ({offset} + {size} > {array.size})")
        return array[offset : offset + size].reshape(shape)


class _Damaged:
    """Turn whatever a damaged file raises while being read into one :class:`CheckpointError`."""

    def __init__(self, folder, what: str):
        self.folder, self.what = folder, what

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, CheckpointError):
            raise CheckpointError(f"checkpoint {self.folder} is damaged: {exc}") from exc
        if isinstance(exc, (OSError, EOFError, KeyError, TypeError, ValueError, zipfile.BadZipFile, zlib.error)):
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise CheckpointError(
                f"checkpoint {self.folder} is damaged or truncated ({self.what}: {reason}); train again, "
                "or restore the folder from a copy"
            ) from exc
        return False


# --- from a rank's parameters and optimizer state to pieces, and back --------------------------------


def collect(named, optimizer, zero_shards=None, writes=None):
    """``(pieces, scalars)`` of this rank: ``named`` lists ``(Placement, Parameter)``; with ZeRO,
    ``zero_shards`` (``Zero.shards``) hold the pieces and optimizer state this rank owns; ``writes``
    (placement, parameter) -> bool picks the one rank that writes a piece held by several."""
    shard_of = {id(s.p): s for s in zero_shards or []}
    pieces, scalars = [], {}
    for placement, p in named:
        if writes is not None and not writes(placement, p):
            continue
        where = dict(name=placement.name, axis=placement.axis, start=placement.start, stop=placement.stop)
        s = shard_of.get(id(p))
        if s is not None:
            where.update(flat_start=s.start, flat_stop=s.stop)
            value = s.data if s.data is not None else s.my_piece(p.data)
            state = s.state or {}
        else:
            value, state = p.data, optimizer.state.get(p, {})
        # Mixed precision: the float32 master weights are the parameter, saved as float32 (so a run of
        # any --precision resumes from the same numbers); a 16-bit parameter without one is widened.
        value = state.get("master", value)
        value = value.astype(xp.float32) if is_low_precision(value.dtype) else value
        pieces.append((Piece(field="param", **where), to_host(value).copy()))
        for field, v in state.items():
            if field == "master":
                continue
            if hasattr(v, "shape"):
                pieces.append((Piece(field=field, **where), to_host(v).copy()))
            else:
                scalars.setdefault(placement.name, {})[field] = v
    return pieces, scalars


def restore(reader: Reader, named, optimizer, zero_shards=None) -> None:
    """Load every local parameter (and its optimizer state) from ``reader``, cut for this layout."""
    shard_of = {id(s.p): s for s in zero_shards or []}
    scalars = reader.scalars
    for placement, p in named:
        s = shard_of.get(id(p))

        def mine(field, placement=placement, s=s):
            local = placement.cut(reader.read(placement.name, field))
            return xp.asarray(local.reshape(-1)[s.start : s.stop].copy() if s is not None else local)

        if s is not None and s.data is not None:  # ZeRO-3: the parameter lives as my piece
            dtype = s.data.dtype
            s.data = mine("param").astype(dtype)
        else:  # ZeRO-1/2 too: every rank holds the whole (TP-local) parameter
            dtype = p.data.dtype
            p.data[...] = xp.asarray(placement.cut(reader.read(placement.name, "param"))).reshape(p.shape)
        state = {f: mine(f) for f in reader.fields(placement.name) if f != "param"}
        state.update(scalars.get(placement.name, {}))
        if state and is_low_precision(dtype):  # mixed precision: the saved float32 values are the master
            state["master"] = mine("param").astype(xp.float32)
        if s is not None:
            s.state = state or None
        elif state:
            optimizer.state[p] = state
