"""The package as pyproject.toml lays it out, made of symbolic links (nothing installed, nothing
written in the tree).

The top-level folders are installed as subpackages (``[tool.setuptools.package-dir]``: source
``./kernels`` is ``mcompile.kernels``), so plain ``PYTHONPATH=.`` cannot import ``mcompile.kernels``.
The view is a folder ``<dest>/mcompile`` holding links to the files of ``mcompile/`` and one link per
subpackage (``<dest>/mcompile/kernels -> <root>/kernels``); put ``<dest>`` first on ``PYTHONPATH``
and run Python with ``-P`` (or ``PYTHONSAFEPATH=1``) from the root, so that ``./mcompile`` does not
shadow it. Used by bench/gpu_run.sh (a tree without an install) and bench/mutants.py (a copy of the
tree whose mutated files must be the ones imported, not the editable install's).

    python bench/pkg_view.py DEST [ROOT]      # ROOT: the current folder by default
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

__all__ = ["build_view"]


def build_view(root: str | Path, dest: str | Path) -> dict[str, str]:
    """Lay out the package view of the tree at ``root`` in the folder ``dest`` (created; it must not
    hold the package already). Returns pyproject's package-dir mapping (package -> folder)."""
    root, dest = Path(root).resolve(), Path(dest)
    with open(root / "pyproject.toml", "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    top = next(p for p in dirs if "." not in p)
    os.makedirs(dest / top)
    for name in os.listdir(root / dirs[top]):  # the top package: a real folder of links to its files
        os.symlink(root / dirs[top] / name, dest / top / name)
    for pkg, d in dirs.items():  # each subpackage: a link to its folder
        if pkg != top:
            os.symlink(root / d, dest.joinpath(*pkg.split(".")))
    return dict(dirs)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.strip().splitlines()[-1].strip())
    view = sys.argv[1]
    dirs = build_view(sys.argv[2] if len(sys.argv) == 3 else os.getcwd(), view)
    print("package view:", view, dirs)
