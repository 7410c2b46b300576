"""``tinytrain doctor``: what this machine and its MPI offer, for when something is off.

Prints, from rank 0 of however many ranks it runs on (``mpirun -n 4 tinytrain doctor``)::

    versions      Python, tinytrain, NumPy, CuPy (and its CUDA runtime), mpi4py
    device        cpu / gpu / strict, and why (TINYTRAIN_DEVICE, or what auto found)
    MPI           library and version, the MPI standard, thread level, CUDA-aware or not and how we know
    ranks         every rank: host, node-local rank, its GPU (and name), pid
    settings      the TINYTRAIN_* variables in effect (defaults said as such), CUDA_VISIBLE_DEVICES,
                  the MPI variables the user set (MPIR_CVAR_*, OMPI_*, I_MPI_*, UCX_*, ...; not what
                  the launcher set for its ranks: tinytrain.launcher), ours included

Every rank gathers its own line to rank 0 (MPI's own gather of small Python objects: a doctor must
work even when our collectives do not).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

# TINYTRAIN_* settings: name -> what happens when unset
SETTINGS = {
    "TINYTRAIN_DEVICE": "auto: CuPy if a GPU works, else NumPy",
    "TINYTRAIN_GPU": "local rank r uses GPU r mod the GPU count",
    "TINYTRAIN_CUDA_AWARE_MPI": "asked of MPI, see CUDA-aware above",
    "TINYTRAIN_TIMEOUT": "20 s per wait (TINYTRAIN_BUSY_TIMEOUT: 600 s while the awaited rank computes)",
    "TINYTRAIN_DEBUG": "collective signatures not cross-checked",
    "TINYTRAIN_TRACE": "no spans recorded",
    "TINYTRAIN_SPIN": "0 polls when ranks outnumber cores, else 2000, before yielding the core",
    "TINYTRAIN_YIELD_FOR": "2 ms of polls with the core yielded between them, then sleeps",
    "TINYTRAIN_KEEP_FREED_MEMORY": "1: glibc keeps freed host memory for the next arrays (no mmap per array)",
    "TINYTRAIN_MPI_THROTTLE": "MPI as it comes; 1 adds MPICH's progress throttle (see MPIR_CVAR_* below)",
    "TINYTRAIN_STRICT_GPUS": "4 fake GPUs under TINYTRAIN_DEVICE=strict",
    "TINYTRAIN_TOPOLOGY": "no emulated nodes: every pair of ranks talks as it does (NxR: N nodes of R ranks)",
    "TINYTRAIN_INTER_GBPS": "1 GB/s per rank's inter-node port under TINYTRAIN_TOPOLOGY",
    "TINYTRAIN_INTER_LATENCY_US": "100 us inter-node latency under TINYTRAIN_TOPOLOGY",
    "TINYTRAIN_PLACEMENT": "block: consecutive ranks share an emulated node (cyclic: round-robin)",
}
OTHER_SETTINGS = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
MPI_PREFIXES = ("MPIR_CVAR_", "MPICH_", "OMPI_", "PRTE_MCA_", "PMIX_MCA_", "I_MPI_", "UCX_", "FI_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="also write everything as JSON to this file")


def run(args) -> int:
    from tinytrain import distributed as dist

    comm = dist.init().comm
    mine = _this_rank(comm)
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        report = _report(everyone)
        print("\n".join(_lines(report)), flush=True)
        if getattr(args, "json", None):
            import json

            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


# --- what one rank sees ------------------------------------------------------------------------------


def _this_rank(comm) -> dict:
    from tinytrain import backend
    from tinytrain.distributed import group

    gpu = backend.current_gpu()
    return {
        "rank": comm.Get_rank(),
        "host": platform.node(),
        "local_rank": group.local_rank(comm),
        "gpu": gpu,
        "gpu_name": _gpu_name(gpu),
        "gpus_visible": backend.gpu_count(),
        "pid": os.getpid(),
    }


def _gpu_name(index) -> str | None:
    from tinytrain import backend

    if index is None:
        return None
    try:  # cupy.cuda.runtime.getDeviceProperties(i)["name"] is bytes
        name = backend.xp.cuda.runtime.getDeviceProperties(index)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # a doctor reports, never fails
        return f"(name unknown: {exc})"


# --- the report ------------------------------------------------------------------------------------


def _report(ranks: list[dict]) -> dict:
    import mpi4py
    import numpy

    import tinytrain
    from tinytrain import backend, launcher
    from tinytrain.distributed import p2p
    from tinytrain.distributed._mpi import MPI

    aware, how = p2p.cuda_aware_reason()
    if getattr(MPI, "why", None) is not None:  # the one-process stand-in (_nompi): no MPI library
        aware, how = False, "no MPI library"
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized"}
    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "tinytrain": f"{tinytrain.__version__} ({os.path.dirname(tinytrain.__file__)})",
        "numpy": numpy.__version__,
        "cupy": _cupy_version(),
        "device": backend.device,
        "device_reason": backend.device_reason,
        "mpi4py": mpi4py.__version__,
        "mpi_library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        + (
            f" ({MPI.why}): serial commands work; for more ranks, {launcher.INSTALL_MPI}" if hasattr(MPI, "why") else ""
        ),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "thread_level": levels.get(MPI.Query_thread(), "multiple"),
        "cuda_aware": aware,
        "cuda_aware_reason": how,
        "ranks": ranks,
        "settings": _settings(),
    }


def _cupy_version() -> str:
    """CuPy's version and CUDA runtime, without importing it when the backend did not (import is slow)."""
    from tinytrain import backend

    if not backend.on_gpu:
        import importlib.util

        found = importlib.util.find_spec("cupy") is not None
        return "installed, not in use" if found else 'not installed (pip install -e ".[gpu]")'
    cupy = backend.xp
    runtime = cupy.cuda.runtime.runtimeGetVersion()  # e.g. 12040 for CUDA 12.4
    return f"{cupy.__version__} (CUDA runtime {runtime // 1000}.{runtime % 1000 // 10})"


def _settings() -> dict[str, str]:
    shown = {}
    for name, default in SETTINGS.items():
        shown[name] = f"={os.environ[name]}" if name in os.environ else f"  (unset: {default})"
    for name in OTHER_SETTINGS:
        if name in os.environ:
            shown[name] = f"={os.environ[name]}"
    from tinytrain import launcher

    for name in sorted(os.environ):  # the user's MPI settings, not what the launcher set for its ranks
        if name.startswith(MPI_PREFIXES) and not launcher.is_wiring(name):
            shown[name] = f"={os.environ[name]}"
    return shown


def _lines(r: dict) -> list[str]:
    hosts = sorted({x["host"] for x in r["ranks"]})
    out = [
        "tinytrain doctor",
        f"  python        {r['python']}",
        f"  tinytrain     {r['tinytrain']}",
        f"  numpy         {r['numpy']}",
        f"  cupy          {r['cupy']}",
        f"  device        {r['device']}: {r['device_reason']}",
        f"  mpi4py        {r['mpi4py']}",
        f"  MPI library   {r['mpi_library']}",
        f"  MPI standard  {r['mpi_standard']}, thread level {r['thread_level']}",
        f"  CUDA-aware    {'yes' if r['cuda_aware'] else 'no'}: {r['cuda_aware_reason']}",
        f"  ranks         {len(r['ranks'])} on {len(hosts)} node(s)",
    ]
    for x in r["ranks"]:
        gpu = "no GPU" if x["gpu"] is None else f"GPU {x['gpu']} of {x['gpus_visible']} ({x['gpu_name']})"
        out.append(f"    rank {x['rank']:<4} host {x['host']}  local rank {x['local_rank']}  {gpu}  pid {x['pid']}")
    out.append("  settings")
    out += [f"    {name}{value}" for name, value in r["settings"].items()]
    return out
