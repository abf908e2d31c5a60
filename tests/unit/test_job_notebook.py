"""A notebook as a job: the job file's notebook form, the CLI's shorthand, and what the hub
reads back from an executed notebook (the failed cell, the page's cells) — bounded, text only."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from gpuhub_spawner.jobs.cli import notebook_job, parameter_value
from gpuhub_spawner.jobs.client import HubError
from gpuhub_spawner.jobs.notebook import MAX_NOTEBOOK_BYTES, defaults_for, failed_cell, load_bounded, render_cells
from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.policy import PolicyError


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        parse_job(text, "job.yaml")
    return [i.format("job.yaml") for i in e.value.issues]


def test_a_notebook_job_file_runs_the_notebook_runner_with_its_parameters():
    spec = parse_job("profile: gpu-1\nnotebook: proj/train.ipynb\nparameters: {lr: 0.1, epochs: 3, tag: a b, fast: true}\n")
    assert spec.kind == "notebook"
    assert spec.parameters == {"lr": 0.1, "epochs": 3, "tag": "a b", "fast": True}
    assert spec.notebook_argv("/venv/bin/python") == [
        "/venv/bin/python",
        "-m",
        "gpuhub_spawner.jobs.notebook",
        "--",
        "proj/train.ipynb",
    ]
    assert parse_job("profile: cpu\ncommand: [true]\n").kind == "command"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("profile: cpu\n", "command: is required (or 'notebook': a notebook to execute)"),
        ("profile: cpu\ncommand: [x]\nnotebook: a.ipynb\n", "give either 'command' or 'notebook', not both"),
        ("profile: cpu\nnotebook: ../bob/a.ipynb\n", "notebook: must stay inside your home directory"),
        ("profile: cpu\nnotebook: /etc/a.ipynb\n", "notebook: must be a path relative to your home"),
        ("profile: cpu\nnotebook: train.py\n", "notebook: must be a notebook file (ending in .ipynb)"),
        ("profile: cpu\nnotebook: a.ipynb\nparameters: {1x: 2}\n", "'1x' is not a Python identifier"),
        ("profile: cpu\nnotebook: a.ipynb\nparameters: {x: [1, 2]}\n", "parameters"),
        ("profile: cpu\ncommand: [x]\nparameters: {x: 1}\n", "'parameters' are for a notebook job"),
    ],
)
def test_notebook_job_mistakes_are_explained(text, expected):
    assert any(expected in e for e in errors(text)), errors(text)


def _args(file, **kw):
    base = dict(
        file=file,
        profile="gpu-1",
        parameter=None,
        team=None,
        name=None,
        time_limit=None,
        experiment=None,
        retries=None,
        retry_on=None,
        home_path=False,
    )
    return argparse.Namespace(**(base | kw))


def test_the_cli_turns_a_notebook_and_its_flags_into_a_job_file(tmp_path):
    home = tmp_path / "home"
    (home / "proj").mkdir(parents=True)
    nb = home / "proj" / "train.ipynb"
    nb.write_text("{}")
    text, filename = notebook_job(
        _args(str(nb), parameter=["lr=0.01", "epochs=3", "name=run a", "fast=True"], retries=2, retry_on="preempted,75"),
        home=str(home),
    )
    spec = parse_job(text, filename)
    assert filename == "train.ipynb" and spec.notebook == "proj/train.ipynb" and spec.profile == "gpu-1"
    assert spec.parameters == {"lr": 0.01, "epochs": 3, "name": "run a", "fast": True}
    assert spec.retries.limit == 2 and spec.retries.reasons == ["preempted", 75]
    # From a laptop: the path is one in the home on the hub.
    text, _ = notebook_job(_args("~/proj/train.ipynb", home_path=True), home=str(home))
    assert parse_job(text).notebook == "proj/train.ipynb"


def test_the_cli_refuses_a_notebook_outside_the_home_and_a_missing_profile(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    outside = tmp_path / "x.ipynb"
    outside.write_text("{}")
    with pytest.raises(HubError, match="is not in your home directory"):
        notebook_job(_args(str(outside)), home=str(home))
    with pytest.raises(HubError, match="needs --profile"):
        notebook_job(_args(str(outside), profile=None), home=str(home))
    with pytest.raises(HubError, match="name=value"):
        notebook_job(_args(str(home / ".." / "x.ipynb"), parameter=["novalue"], home_path=True), home=str(home))


def test_parameter_values_are_read_like_papermills_cli():
    assert [parameter_value(v) for v in ("3", "0.5", "True", "false", "None", "abc", "1e-3")] == [
        3,
        0.5,
        True,
        False,
        None,
        "abc",
        0.001,
    ]


def _executed(cells):
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


BANNER = {"cell_type": "markdown", "metadata": {"tags": ["papermill-error-cell-tag"]}, "source": "An Exception was encountered"}


def test_the_failed_cell_is_named_with_its_source_and_traceback_without_terminal_colours():
    nb = _executed(
        [
            BANNER,
            {"cell_type": "markdown", "metadata": {}, "source": "# Train"},
            {"cell_type": "code", "metadata": {}, "execution_count": 1, "source": "x = 1", "outputs": []},
            {
                "cell_type": "code",
                "metadata": {},
                "execution_count": 2,
                "source": ["y = 1 / 0\n", "print(y)"],
                "outputs": [
                    {
                        "output_type": "error",
                        "ename": "ZeroDivisionError",
                        "evalue": "division by zero",
                        "traceback": ["\x1b[0;31m---------\x1b[0m", "\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"],
                    }
                ],
            },
        ]
    )
    fc = failed_cell(nb)
    assert fc == {
        "cell": 3,
        "execution_count": 2,
        "source": "y = 1 / 0\nprint(y)",
        "ename": "ZeroDivisionError",
        "evalue": "division by zero",
        "traceback": "---------\nZeroDivisionError: division by zero",
    }
    assert failed_cell(_executed([nb["cells"][2]])) is None and failed_cell(None) is None


def test_the_page_gets_text_and_checked_images_never_the_notebooks_html_or_script():
    png = "iVBORw0KGgo="
    nb = _executed(
        [
            {
                "cell_type": "code",
                "metadata": {"tags": ["parameters"]},
                "execution_count": 1,
                "source": "lr = 0.1",
                "outputs": [
                    {"output_type": "stream", "name": "stdout", "text": ["loss 0.5\n"]},
                    {"output_type": "display_data", "data": {"text/html": "<script>steal()</script>"}},
                    {"output_type": "display_data", "data": {"image/png": png, "text/plain": "<Figure>"}},
                    {"output_type": "display_data", "data": {"image/png": '"><script>x()</script>', "text/plain": "fig"}},
                    {"output_type": "execute_result", "data": {"text/html": "<b>x</b>", "text/plain": "'<b>x</b>'"}},
                ],
            }
        ]
    )
    (cell,) = render_cells(nb)
    assert cell["tags"] == ["parameters"] and cell["source"] == "lr = 0.1"
    assert cell["outputs"] == [
        {"text": "loss 0.5\n"},
        {"text": "[text/html output not shown here]"},
        {"image": "image/png", "base64": png},
        {"text": "fig"},  # not base64: never put into the page as an image
        {"text": "'<b>x</b>'"},  # as text, which the template escapes
    ]


def test_reading_an_executed_notebook_back_is_bounded_and_follows_no_link(tmp_path):
    good = tmp_path / "a.ipynb"
    good.write_text(json.dumps(_executed([])))
    assert load_bounded(str(good)) == _executed([])
    big = tmp_path / "big.ipynb"
    with open(big, "wb") as f:
        f.truncate(MAX_NOTEBOOK_BYTES + 10)
    assert load_bounded(str(big)) is None
    link = tmp_path / "link.ipynb"
    os.symlink(good, link)
    assert load_bounded(str(link)) is None
    (tmp_path / "bad.ipynb").write_text("[1, 2]")
    assert load_bounded(str(tmp_path / "bad.ipynb")) is None


def test_a_notebook_that_names_no_kernel_or_language_runs_on_the_machines_python():
    assert defaults_for({"kernelspec": {"name": "python3", "language": "python"}}) == {}
    assert defaults_for({"kernelspec": {"name": "ir"}, "language_info": {"name": "R"}}) == {}
    assert defaults_for({"kernelspec": {"name": "python3"}}) == {"language": "python"}
    assert defaults_for({}) == defaults_for(None) == defaults_for([]) == {"kernel_name": "python3", "language": "python"}


def test_a_cells_output_reaches_the_job_log_as_printed(tmp_path):
    """A real kernel flushes its output every 0.2 s: a line printed in two parts with a pause
    between arrives as two chunks. The job's log has the line whole, and no blank line after
    each print (papermill's log_output gave "step" and " 2" on lines of their own)."""
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "metadata": {},
                "execution_count": None,
                "outputs": [],
                "source": "import sys, time\nprint('step 1')\nsys.stdout.write('step'); time.sleep(0.5); print(' 2')\nprint('done')",
            }
        ],
        "metadata": {"kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (home / "train.ipynb").write_text(json.dumps(nb))
    env = dict(os.environ, HOME=str(home), GPUHUB_JOB_ID="job-test", GPUHUB_ATTEMPT="1")
    r = subprocess.run(
        [sys.executable, "-m", "gpuhub_spawner.jobs.notebook", "--", "train.ipynb"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 1\nstep 2\ndone\n" in r.stdout, r.stdout
