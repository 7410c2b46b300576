"""The ``tinytrain`` command: ``train``, ``sample``, ``bench``, ``plan`` and ``doctor``.

Each subcommand lives in its own module and is imported only when used, so ``tinytrain --help``
stays fast and never initialises MPI.

Errors: a bad input (a flag, a file, a setting) is one sentence that says what to change, exit code
2, no traceback; any other error is one line with its type, exit code 1. ``--debug`` (anywhere on
the line) or ``TINYTRAIN_DEBUG=1`` shows the traceback too. Under ``mpirun`` an error on any rank
ends the whole job at once (``MPI_Abort``): the message is printed once, with the rank, and no rank
is left waiting for the one that failed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
import traceback

from tinytrain import env, launcher

# name -> module with ``add_arguments(parser)`` and ``run(args)``
_COMMANDS = {
    "train": ("tinytrain.trainer", "train a GPT (serial, or under mpirun with --dp/--tp/--pp)"),
    "launch": ("tinytrain.elastic", "train under mpirun, restarting on the ranks left when one is lost (elastic)"),
    "sample": ("tinytrain.sample", "print text generated from a checkpoint"),
    "bench": (
        "tinytrain.bench",
        "benchmarks: `tinytrain bench step`, `tinytrain bench collectives`, `tinytrain bench strategies`",
    ),
    "plan": ("tinytrain.planner", "which layouts fit a model on a cluster, and which is fastest"),
    "doctor": ("tinytrain.doctor", "what this machine and its MPI offer: versions, device, settings"),
}

EXIT_ERROR, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
_GRACE = 1.0  # seconds a failing rank other than 0 waits for rank 0 to report the same error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinytrain", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (anywhere on the line; or TINYTRAIN_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv=None) -> int:
    """Run one command.

    As the program (``argv`` None: the ``tinytrain`` script, ``python -m tinytrain.cli``) every
    error ends here: printed once, exit code 2 (bad input) or 1, and under mpirun the whole job is
    aborted. Called in-process with ``argv`` (tests, notebooks), a bad input prints its sentence and
    raises ``SystemExit(2)``; other exceptions propagate to the caller.
    """
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    command = next((a for a in argv if a in _COMMANDS), None)
    if as_program:
        launcher.ignore_peer_exit_notices()
    try:
        debug = env.switch("TINYTRAIN_DEBUG", what="show tracebacks") or debug
        parser = build_parser()
        args = parser.parse_args(argv)
        code = int(importlib.import_module(args._module).run(args) or 0)
        if as_program:
            sys.stdout.flush()  # a reader that went away (`| head -1`) is noticed here, not at exit
        return code
    except SystemExit:
        raise  # argparse's usage errors, and exits a command chose itself
    except BrokenPipeError:
        if not as_program:
            raise
        _reader_gone()
    except BaseException as exc:
        bad_input = is_bad_input(exc)
        if not as_program and not bad_input:
            raise
        if not as_program:
            if _world()[0] == 0:
                sys.stderr.write(f"{_name(command)}: error: {exc}\n")
            raise SystemExit(EXIT_BAD_INPUT) from exc
        fail(command, exc, debug)
    return EXIT_ERROR  # not reached: fail() does not return


def _reader_gone() -> None:
    """Whoever read our output stopped reading (``tinytrain plan --json | head -1``): end quietly,
    as a Unix tool killed by SIGPIPE would (the Python docs' recipe: point stdout at devnull, so
    that flushing it at exit cannot fail again). Under mpirun the other ranks end too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    if _world()[1] > 1:
        _abort(EXIT_ERROR)
    sys.exit(EXIT_ERROR)


def is_bad_input(exc: BaseException) -> bool:
    """A mistake in what the user gave (flags, files, environment), said in one sentence.

    ``ValueError`` (our checks, and ``CollectiveMismatch``), a missing file, a numeric blow-up
    (``FloatingPointError`` says to lower --lr), and ``tinytrain.backend.BackendError`` (matched by
    name: a bad ``TINYTRAIN_DEVICE`` fails while the backend module is being imported)."""
    if isinstance(exc, (ValueError, FileNotFoundError, FloatingPointError)):
        return True
    return type(exc).__name__ == "BackendError" and type(exc).__module__.startswith("tinytrain.backend")


def _world() -> tuple[int, int]:
    """(this rank, number of ranks) of the MPI job, from tinytrain.distributed once it started,
    else from the launcher's environment (without starting MPI)."""
    dist = sys.modules.get("tinytrain.distributed")
    if dist is not None and dist.is_initialized():
        from tinytrain.distributed._mpi import MPI  # the world group may be unusable after the error

        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    from tinytrain import launcher

    return launcher.rank_and_size()


def fail(command: str | None, exc: BaseException, debug: bool) -> None:
    """Print the error once and end the program; under mpirun, end the whole job (MPI_Abort).

    Who prints: nobody, if another rank reported its failure first (``PeerFailure`` and the notices
    on the side channel: that rank printed the cause). Otherwise rank 0 at once, and any other rank
    after giving rank 0 a moment to abort the job for the same reason (a bad flag fails every rank
    alike: one message, not N)."""
    bad_input, interrupted = is_bad_input(exc), isinstance(exc, KeyboardInterrupt)
    if interrupted:
        code = EXIT_INTERRUPTED
    else:
        code = EXIT_BAD_INPUT if bad_input else EXIT_ERROR
    rank, size = _world()
    line = f"{_name(command)}: {'' if size == 1 else f'rank {rank}: '}"
    if interrupted:
        line += f"interrupted{f': {exc}' if str(exc) else ''}"
    else:
        line += "error: " + (str(exc) if bad_input else f"{type(exc).__name__}: {exc}")
    if not bad_input and not interrupted and not debug:
        line += " (run with --debug or TINYTRAIN_DEBUG=1 for the traceback)"
    shown = exc if debug else None
    if size == 1:
        _print(line, shown)
        sys.exit(code)
    try:
        from tinytrain.distributed._mpi import MPI  # noqa: F401 - MPI_Init on every failing rank, so rank 0 can abort
    except RuntimeError:  # no MPI library (launcher.NO_MPI): the ranks cannot talk, each says it and ends
        _print(line, shown)
        sys.exit(code)
    if bad_input and not _another_rank_failed(exc, wait=0.0) and _every_rank_refused(wait=_GRACE):
        # A bad flag is bad on every rank: all agree, so the job ends as a program does, with exit 2
        # and no MPI_Abort (MPICH prints a crash's banner after one). Ending together matters: a rank
        # that exits without MPI_Finalize while another still runs is a crash to the launcher.
        if rank == 0:
            _print(line, shown)
        _end_together(code)
    if not _another_rank_failed(exc, wait=0.0 if rank == 0 else _GRACE):
        _print(line, shown)
        _report(line)
    else:
        # only an echo: the rank that failed first aborts the job with *its* exit code (2 for a bad
        # input); give it the time to, so that this rank's code 1 does not win the race
        time.sleep(2 * _GRACE)
    _abort(code)


def _every_rank_refused(wait: float) -> bool:
    """Has every rank of the job come to this point (a non-blocking barrier on the world, given
    ``wait`` seconds)? Only the ranks that fail call it, so a rank that is still training leaves it
    incomplete, and the job is aborted as before."""
    from tinytrain.distributed._mpi import MPI

    agreed = MPI.COMM_WORLD.Ibarrier()
    end = time.monotonic() + wait
    while not agreed.Test():
        if time.monotonic() >= end:
            return False  # the abort that follows ends the barrier too
        time.sleep(0.002)
    return True


def _end_together(code: int) -> None:
    """Exit ``code`` through MPI_Finalize, which every rank reaches (they agreed). Stop the heartbeat
    first (its thread must not call MPI meanwhile); and should Finalize wait on a message still in
    flight, SIGALRM ends the process in 5 s: never a hang."""
    dist = sys.modules.get("tinytrain.distributed")
    if dist is not None and dist.is_initialized():
        from tinytrain.distributed import watchdog

        watchdog.stop_heartbeat()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(5)
    sys.stdout.flush()
    sys.exit(code)


def _name(command: str | None) -> str:
    return f"tinytrain {command}" if command else "tinytrain"


def _print(line: str, exc: BaseException | None) -> None:
    if exc is not None:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _another_rank_failed(exc: BaseException, wait: float) -> bool:
    """Did another rank fail first (``exc`` only echoes it, or a notice arrives within ``wait`` s)?"""
    dist = sys.modules.get("tinytrain.distributed")
    if dist is not None and isinstance(exc, dist.PeerFailure) and exc.echoes_a_report:
        return True
    if dist is None or not dist.is_initialized():
        time.sleep(wait)  # no side channel yet: rank 0's abort, if it comes, ends us meanwhile
        return False
    from tinytrain.distributed import watchdog

    end = time.monotonic() + wait
    while True:
        if watchdog.poll_failures():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


def _report(line: str) -> None:
    dist = sys.modules.get("tinytrain.distributed")
    if dist is not None and dist.is_initialized():
        dist.report_failure(line)


def _abort(code: int) -> None:
    """End every rank of the job now (starting MPI first if this rank had not: a rank that exits
    without MPI would leave the others waiting for it forever)."""
    from tinytrain.distributed._mpi import MPI

    sys.stderr.flush()
    # mpirun forwards our output through a pipe; an abort at once can drop what is still in flight
    time.sleep(0.3)
    MPI.COMM_WORLD.Abort(code)


if __name__ == "__main__":
    sys.exit(main())
