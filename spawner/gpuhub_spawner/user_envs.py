"""``gpuhub env create NAME``: a researcher's own packages, kept in their home (docs/own-packages.md).

A server runs the Python environment it was started with (one machine: the hub's venv; on
Kubernetes: the image's), which users cannot write, and ``pip install --user`` is refused in a
venv (user site-packages are switched off there). So a user's own packages go into an
environment of their own in their home, which survives a server's restart and is seen by their
jobs (same account, same home):

- a venv at ``~/.venvs/NAME`` made from the server's interpreter, without pip of its own;
- a ``gpuhub-base.pth`` in it naming the server environment's site-packages, so everything the
  server has (Jupyter's kernel, pip, MLflow, gpuhub_notebook) is importable there, *after* the
  user's own packages: what the user installs wins, what they do not install comes from the
  server's environment;
- a Jupyter kernel "Python (NAME)" in ``~/.local/share/jupyter/kernels`` (the user's data dir,
  which every server of theirs reads), so ``%pip install`` in a notebook on that kernel installs
  into it.

Runs as the user, in their server or terminal; nothing of the hub's is written. After a hub
upgrade that moves the server's environment, ``gpuhub env create NAME --refresh`` rewrites the
``.pth`` and the kernel.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
BASE_PTH = "gpuhub-base.pth"


def envs_dir() -> Path:
    return Path(os.environ.get("GPUHUB_ENVS_DIR") or Path.home() / ".venvs")


def _purelib(python: Path) -> str:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def create(name: str, kernel: bool = True, refresh: bool = False) -> Path:
    """Make (or with ``refresh`` re-link) the environment ``name``; returns its directory."""
    if not _NAME.match(name):
        raise ValueError(f"{name!r}: use letters, digits, '_', '.' and '-' (at most 64), starting with a letter or digit")
    target = envs_dir() / name
    python = target / "bin" / "python"
    if target.exists() and not refresh:
        raise FileExistsError(f"{target} exists; install into it with {python} -m pip install ..., or use --refresh")
    if not python.exists():
        venv.EnvBuilder(with_pip=False, symlinks=True, clear=False).create(target)
    base = sysconfig.get_path("purelib")  # the server's environment: this interpreter's
    # addsitedir, not the bare path: the .pth files there (editable installs) count too
    Path(_purelib(python), BASE_PTH).write_text(f"import site; site.addsitedir({base!r})\n")
    if kernel:
        subprocess.run(
            [str(python), "-m", "ipykernel", "install", "--user", "--name", name, "--display-name", f"Python ({name})"],
            check=True,
            capture_output=True,
        )
    return target


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuhub env", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    c = sub.add_parser("create", help="an environment of your own in ~/.venvs/NAME, with a Jupyter kernel")
    c.add_argument("name")
    c.add_argument("--no-kernel", action="store_true", help="no Jupyter kernel (jobs only)")
    c.add_argument("--refresh", action="store_true", help="re-link an existing one to this server's environment")
    sub.add_parser("list", help="your environments")
    args = parser.parse_args(argv)
    if args.action == "list":
        for d in sorted(envs_dir().glob("*/bin/python")):
            print(d.parent.parent.name, d.parent.parent)
        return 0
    try:
        target = create(args.name, kernel=not args.no_kernel, refresh=args.refresh)
    except (ValueError, FileExistsError) as e:
        print(f"gpuhub env: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(f"gpuhub env: {' '.join(map(str, e.cmd[:4]))} failed: {(e.stderr or '').strip()[-500:]}", file=sys.stderr)
        return 1
    print(f"Created {target}.")
    print(f"  install:  {target}/bin/python -m pip install PACKAGE   (or %pip install in a notebook on its kernel)")
    if not args.no_kernel:
        print(f"  notebook: choose the kernel 'Python ({args.name})' (reload the launcher page)")
    print(f"  jobs:     command: [{target}/bin/python, train.py]")
    return 0
