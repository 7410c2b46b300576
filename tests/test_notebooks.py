"""Every notebook in notebooks/ runs top to bottom without an error (as an instructor would run it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from grader.run import mpi_environment

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    # Under `mpirun -n 4 pytest` this process carries the launcher's variables; a kernel that
    # inherited them would take itself for an MPI rank and die in MPI_Init. Start it clean.
    clean = mpi_environment()
    for name in set(os.environ) - set(clean):
        monkeypatch.delenv(name)
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    images = sum(
        1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    )
    assert images >= 3, f"{path.name} drew {images} figures"


def test_the_notebooks_extra_brings_jupyterlab_and_the_suite_needs_only_dev():
    """README: `pip install -e ".[notebooks]" && jupyter lab notebooks/`. The suite runs the notebooks
    with dev's nbclient and ipykernel, so CI (which installs dev) does not install JupyterLab."""
    from grader.config import is_release, tomllib

    root = Path(__file__).resolve().parent.parent
    with open(root / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]

    def brought(extra: str) -> set[str]:
        """The packages ``extra`` installs, through the extras of tinytrain it names ("tinytrain[mpich,test]")."""
        found = set()
        for req in extras[extra]:
            name = re.split(r"[;=<>~!\[ ]", req)[0]  # "ruff==0.17.6" -> ruff
            if name == "tinytrain":
                for inner in re.search(r"\[(.*)\]", req)[1].split(","):
                    found |= brought(inner.strip())
            else:
                found.add(name)
        return found

    assert "jupyterlab" in brought("notebooks") and "jupyterlab" not in brought("dev")
    assert {"nbformat", "nbclient", "ipykernel"} <= brought("dev")  # what test_notebook_runs imports
    assert {"nbformat", "nbclient", "ipykernel", "pytest"} <= brought("test")  # the suite under another MPI
    if not is_release():  # a student copy's README is the student's
        assert 'pip install -e ".[notebooks]" && jupyter lab notebooks/' in (root / "README.md").read_text()
