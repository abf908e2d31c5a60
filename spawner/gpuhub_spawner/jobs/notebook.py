"""A notebook as a job: executed top to bottom with papermill, as the user (docs/jobs.md).

``python -m gpuhub_spawner.jobs.notebook -- train.ipynb`` is the command of a notebook job
(``notebook:`` in the job file, or ``gpuhub job submit train.ipynb``). It runs after
``jobs.entry``, already as the user inside the sandbox, in the job's working directory:

- the parameters (``GPUHUB_NOTEBOOK_PARAMETERS``, JSON) go into the cell tagged
  ``parameters`` the way papermill does it (an injected cell after it);
- the kernel runs in the notebook's directory, with the job's environment
  (``GPUHUB_CHECKPOINT_DIR``, ``GPUHUB_ATTEMPT``, ``MLFLOW_RUN_CONTEXT``: its MLflow runs carry
  the job's tags with no setup);
- cell outputs go to the job's log as they come (``gpuhub job logs -f``);
- the executed notebook is written to ``~/.gpuhub/jobs/<job>/<name>.attempt-<n>.ipynb`` (the
  user's, openable in JupyterLab), saved after every cell, and copied to the descriptor the
  hub opened for it (``GPUHUB_NOTEBOOK_FD``: a file beside the job's record that the user's
  account cannot open by any path) when the notebook ends, fails, or is stopped (SIGTERM:
  a preemption keeps the cells that finished, and a running cell's output up to its last
  autosave, every ``AUTOSAVE_SECONDS``).

A failed cell ends the process with exit code 1 after naming the cell on stderr; the hub reads
the failed cell and its traceback from the executed notebook (``failed_cell``) for the jobs page.
The module's helpers for the hub side (``failed_cell``, ``render_cells``) read a notebook the
user wrote: they bound what they read and return text only (escaped by the page's template).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import signal
import sys
from typing import Any

# A long cell's outputs so far are saved this often (papermill's own throttle); a finished
# cell is saved at once. What a stopped attempt's executed notebook keeps.
AUTOSAVE_SECONDS = 10
MAX_NOTEBOOK_BYTES = 32 * 2**20  # what the hub reads back of an executed notebook (page, failed cell)
MAX_SHOWN_CHARS = 20_000  # per cell source / output on the page
MAX_TRACEBACK_CHARS = 8_000
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def output_path(notebook: str, job_id: str, attempt: str) -> str:
    stem = os.path.basename(notebook)[: -len(".ipynb")] or "notebook"
    home = os.path.expanduser("~")
    return os.path.join(home, ".gpuhub", "jobs", job_id, f"{stem}.attempt-{attempt}.ipynb")


def _copy_to_fd(path: str, fd: int | None) -> None:
    """The executed notebook (as saved so far) to the hub's copy."""
    if fd is None:
        return
    try:
        with open(path, "rb") as f:
            data = f.read()
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as e:
        print(f"[gpuhub] could not hand the executed notebook to the hub: {e}", file=sys.stderr, flush=True)


def defaults_for(metadata: Any) -> dict:
    """papermill's overrides for a notebook that does not name its kernel or language (written
    by a tool other than JupyterLab): the machine's Python kernel."""
    meta = metadata if isinstance(metadata, dict) else {}
    ks_raw, info_raw = meta.get("kernelspec"), meta.get("language_info")
    ks: dict = ks_raw if isinstance(ks_raw, dict) else {}
    info: dict = info_raw if isinstance(info_raw, dict) else {}
    out = {}
    if not ks.get("name"):
        out["kernel_name"] = "python3"
    if not ks.get("language") and not info.get("name"):
        out["language"] = "python"
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--":
        print("usage: python -m gpuhub_spawner.jobs.notebook -- NOTEBOOK.ipynb", file=sys.stderr)
        return 2
    notebook = argv[1]
    fd_text = os.environ.pop("GPUHUB_NOTEBOOK_FD", "")
    fd = int(fd_text) if fd_text.isdigit() else None
    try:
        parameters = json.loads(os.environ.get("GPUHUB_NOTEBOOK_PARAMETERS") or "{}")
    except ValueError:
        parameters = {}
    job_id = os.environ.get("GPUHUB_JOB_ID", "job")
    attempt = os.environ.get("GPUHUB_ATTEMPT", "1")
    home = os.path.expanduser("~")
    source = notebook if os.path.isabs(notebook) else os.path.join(home, notebook)
    out = output_path(notebook, job_id, attempt)
    os.makedirs(os.path.dirname(out), mode=0o700, exist_ok=True)
    if not os.path.isfile(source):
        print(f"[gpuhub] no notebook at ~/{notebook}", file=sys.stderr, flush=True)
        return 2

    def stopped(signum, frame):  # preempted, cancelled, time limit: keep the cells that ran
        print(f"[gpuhub] stopped (signal {signum}); the executed notebook keeps the cells that ran", file=sys.stderr, flush=True)
        _copy_to_fd(out, fd)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    import papermill
    from papermill.exceptions import PapermillExecutionError

    print(f"[gpuhub] executing ~/{notebook} with parameters {json.dumps(parameters)}", flush=True)
    try:
        with open(source, "rb") as f:
            overrides = defaults_for(json.load(f).get("metadata"))
    except (OSError, ValueError, AttributeError):
        overrides = {}  # papermill says what is wrong with it
    try:
        papermill.execute_notebook(
            source,
            out,
            parameters=parameters,
            cwd=os.path.dirname(source),
            # The cells' output into the job's log as the user printed it. papermill's
            # log_output logs each chunk the kernel flushed as a line of its own: a blank line
            # after every print, and "step 2" as "step" and " 2" where the kernel flushed
            # between print's writes (it does, on a loaded machine).
            stdout_file=sys.stdout,
            stderr_file=sys.stderr,
            progress_bar=False,
            request_save_on_cell_execute=True,
            autosave_cell_every=AUTOSAVE_SECONDS,
            **overrides,
        )
    except PapermillExecutionError as e:
        print(
            f"[gpuhub] cell {e.cell_index + 1} (execution count {e.exec_count}) failed: {e.ename}: {e.evalue}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except Exception as e:  # noqa: BLE001 - a notebook that cannot be read, a kernel that cannot start
        print(f"[gpuhub] could not execute the notebook: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if os.path.exists(out):
            _copy_to_fd(out, fd)
    print(f"[gpuhub] executed notebook: {out.replace(home, '~', 1)}", flush=True)
    return 0


# -- the hub's side: read what the user's notebook became, bounded, as text ----------------------


def load_bounded(path: str) -> dict | None:
    """The executed notebook as JSON, or None when absent, too large or not a notebook."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_NOTEBOOK_BYTES + 1)
    if len(data) > MAX_NOTEBOOK_BYTES or not data:
        return None
    try:
        nb = json.loads(data)
    except ValueError:
        return None
    return nb if isinstance(nb, dict) and isinstance(nb.get("cells"), list) else None


def _text(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    if isinstance(value, list):
        value = "".join(v for v in value if isinstance(v, str))
    if not isinstance(value, str):
        return ""
    value = _ANSI.sub("", value)
    return value if len(value) <= limit else value[:limit] + "\n… (cut)"


def _is_injected(cell: dict) -> bool:
    tags = (cell.get("metadata") or {}).get("tags") or []
    return isinstance(tags, list) and ("papermill-error-cell-tag" in tags)


def failed_cell(nb: dict | None) -> dict | None:
    """The first code cell with an error output: its number (as in JupyterLab, from 1, the
    error banner papermill adds not counted), source, error name, value and traceback."""
    if not nb:
        return None
    number = 0
    for cell in nb["cells"]:
        if not isinstance(cell, dict) or _is_injected(cell):
            continue
        number += 1
        if cell.get("cell_type") != "code":
            continue
        for output in cell.get("outputs") or []:
            if isinstance(output, dict) and output.get("output_type") == "error":
                return {
                    "cell": number,
                    "execution_count": cell.get("execution_count") if isinstance(cell.get("execution_count"), int) else None,
                    "source": _text(cell.get("source"), 4000),
                    "ename": _text(output.get("ename"), 200),
                    "evalue": _text(output.get("evalue"), 1000),
                    "traceback": _text(
                        "\n".join(t for t in output.get("traceback") or [] if isinstance(t, str)), MAX_TRACEBACK_CHARS
                    ),
                }
    return None


_IMAGE_TYPES = ("image/png", "image/jpeg")
_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s]*$")


def render_cells(nb: dict) -> list[dict]:
    """Cells as plain data for the page's template: source and text outputs as text (escaped
    there), PNG/JPEG images as base64 checked to be base64, never HTML or JavaScript."""
    cells = []
    for cell in nb["cells"]:
        if not isinstance(cell, dict) or _is_injected(cell):
            continue
        kind = cell.get("cell_type") if cell.get("cell_type") in ("code", "markdown", "raw") else "raw"
        tags = (cell.get("metadata") or {}).get("tags") or []
        shown: dict[str, Any] = {
            "kind": kind,
            "source": _text(cell.get("source")),
            "execution_count": cell.get("execution_count") if isinstance(cell.get("execution_count"), int) else None,
            "tags": [t for t in tags if isinstance(t, str)][:10] if isinstance(tags, list) else [],
            "outputs": [],
        }
        for output in cell.get("outputs") or []:
            if not isinstance(output, dict):
                continue
            kind_out = output.get("output_type")
            if kind_out == "stream":
                shown["outputs"].append({"text": _text(output.get("text"))})
            elif kind_out == "error":
                tb = "\n".join(t for t in output.get("traceback") or [] if isinstance(t, str))
                shown["outputs"].append({"error": _text(tb) or f"{_text(output.get('ename'))}: {_text(output.get('evalue'))}"})
            elif kind_out in ("execute_result", "display_data"):
                raw = output.get("data")
                data: dict = raw if isinstance(raw, dict) else {}
                image = next((t for t in _IMAGE_TYPES if isinstance(data.get(t), (str, list))), None)
                if image:
                    b64 = _text(data[image], MAX_NOTEBOOK_BYTES)
                    if _BASE64.match(b64):
                        try:
                            base64.b64decode(b64, validate=False)
                            shown["outputs"].append({"image": image, "base64": re.sub(r"\s", "", b64)})
                            continue
                        except ValueError:
                            pass
                if "text/plain" in data:
                    shown["outputs"].append({"text": _text(data["text/plain"])})
                else:
                    shown["outputs"].append({"text": f"[{', '.join(sorted(map(str, data)))[:100]} output not shown here]"})
        cells.append(shown)
    return cells


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
