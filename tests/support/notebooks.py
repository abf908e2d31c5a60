"""Notebooks in a test user's home, as if saved from JupyterLab (notebook jobs, "Run as job")."""

from __future__ import annotations

import json
import subprocess


def notebook(*cells: tuple[str, str] | str) -> str:
    """A notebook of code cells; ('parameters', src) is the cell tagged for papermill."""
    out = []
    for c in cells:
        tags, src = (["parameters"], c[1]) if isinstance(c, tuple) else ([], c)
        out.append({"cell_type": "code", "metadata": {"tags": tags}, "execution_count": None, "outputs": [], "source": src})
    return json.dumps(
        {
            "cells": out,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
            "nbformat": 4,
            "nbformat_minor": 5,
        }
    )


def put_notebook(hub, user: str, rel: str, text: str) -> str:
    """A notebook in the user's home, owned by their account (as if saved from JupyterLab)."""
    from gpuhub_spawner.local.unix_users import ensure_account, ensure_home

    account = ensure_account(user, hub.env["GPUHUB_ACCOUNT_PREFIX"])
    home = hub.data / "home" / user
    ensure_home(str(home), account)
    path = home / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    subprocess.run(["chown", "-R", f"{account.uid}:{account.gid}", str(home / rel.split("/")[0])], check=True)
    return rel
