"""The policy's text as the audit trail shows it: environment values masked, and the diff of two
versions (``policy_versions``). Only PyYAML and difflib, so that a child process can import it
cheaply: for a large policy the diff is made there (``diff_beside``), because libyaml parses and
dumps a whole document in one call that holds the interpreter lock (0.2-0.5 s each for the
500-team policy): in a thread of the hub that is as long a stall of its event loop."""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys

import yaml

MASK = "***"  # a masked environment value; sent back, it means "keep the value in force"
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _mask(node, under_env: bool = False):
    if isinstance(node, dict):
        return {k: (MASK if under_env else _mask(v, k == "env" and isinstance(v, dict))) for k, v in node.items()}
    if isinstance(node, list):
        return [_mask(v) for v in node]
    return node


def masked_text(text: str) -> str | None:
    """The policy as YAML with every environment value masked (an ``env`` mapping anywhere: they
    may hold secrets), or None when the text does not parse -- never the text itself, which a
    team lead must not read. Written out again from the data (libyaml where available), so the
    audit trail's diffs show what changed in the policy, not in its comments."""
    try:
        data = yaml.load(text, Loader=_Loader)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    return yaml.dump(_mask(data), Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def masked_text_as_written(text: str) -> str | None:
    """``masked_text``, but as the admin wrote it: comments, blank lines, quoting, flow style and
    order kept, every environment value masked in place (``_masked_as_written``), so the policy
    page's text box shows a team lead the admin's file. Where that cannot be done exactly (the
    result must read as the masked data), ``masked_text``."""
    try:
        data = yaml.load(text, Loader=_Loader)
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    want = _mask(data)
    kept = _masked_as_written(text)
    if kept is not None:
        try:
            if yaml.load(kept, Loader=_Loader) == want:  # the same document, masked: nothing else moved
                return kept
        except (yaml.YAMLError, ValueError, RecursionError):
            pass
    return yaml.dump(want, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TRAILING_COMMENT = re.compile(r"[ \t]+#[^\n]*")


def _masked_as_written(text: str) -> str | None:
    """``text`` with each ``env`` mapping rewritten in place as ``NAME: '***'`` entries, every other
    character (comments, blank lines, quoting, order) as the admin wrote it. Comments inside an
    ``env`` mapping go with it (they may hold an old value). None where the text has something
    this cannot rewrite exactly (a key that is not a plain scalar); the caller also checks that
    the result reads as the masked data (an anchor on an ``env`` mapping does not)."""
    if "env" not in text:
        return text  # nothing to mask (the caller's check still applies)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # marks in characters
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    spans: dict[int, tuple[int, int, str]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == "env" and isinstance(v, yaml.MappingNode):
                    if id(v) in spans:
                        continue
                    names = []
                    for ek, _ev in v.value:
                        if not isinstance(ek, yaml.ScalarNode):
                            return None
                        names.append(ek.value if _PLAIN_KEY.fullmatch(ek.value) else json.dumps(ek.value))
                    entries = [f"{name}: '{MASK}'" for name in names]
                    if v.flow_style or not entries:
                        spans[id(v)] = (v.start_mark.index, v.end_mark.index, "{" + ", ".join(entries) + "}")
                    else:
                        start, end = v.start_mark.index, v.value[-1][1].end_mark.index
                        while end > start and text[end - 1] == "\n":
                            end -= 1  # a block scalar's newlines: the line breaks stay
                        trailing = _TRAILING_COMMENT.match(text, end)
                        if trailing:
                            end = trailing.end()
                        spans[id(v)] = (start, end, ("\n" + " " * v.start_mark.column).join(entries))
                else:
                    stack.extend((k, v))
    for start, end, value in sorted(spans.values(), reverse=True):
        text = text[:start] + value + text[end:]
    return text


_NOT_SHOWN = "# (this text does not parse as YAML: not shown, it may hold secrets)\n"


def policy_diff(before: str, after: str) -> str:
    a = (masked_text(before) or _NOT_SHOWN).splitlines(True)
    b = (masked_text(after) or _NOT_SHOWN).splitlines(True)
    return "".join(difflib.unified_diff(a, b, "before", "after", n=1))


# Texts this long (together) are diffed in a child process; shorter ones here (a process start,
# ~0.1 s, is more than the example policy's whole diff).
BESIDE_FROM = 100_000

# Children run niced: the audit can wait, the hub's requests should not (2 cores).
_CHILD = (
    "import json, os, sys; os.nice(10); from gpuhub_spawner.usage.policy_text import policy_diff; "
    "before, after = json.load(sys.stdin); sys.stdout.write(json.dumps(policy_diff(before, after)))"
)


def diff_beside(before: str, after: str) -> str:
    """``policy_diff(before, after)``, the same text, made in a child process when the texts are
    large (call it from a thread: it waits for the child). Made here when the child cannot run."""
    if len(before) + len(after) < BESIDE_FROM:
        return policy_diff(before, after)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD], input=json.dumps([before, after]).encode(), capture_output=True, timeout=300
        )
        if done.returncode == 0:
            return json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return policy_diff(before, after)


# -- the usage recorder's policy_reloaded diff: of the plain data the store read -----------------
def data_text(source) -> str:
    """The policy as YAML with profile environment values masked (they may hold secrets).

    ``source``: the plain data the policy was read from (``PolicyStore.data``: the file's
    own words, e.g. ``16Gi``), or a ``Policy`` where no data is kept. Costs ~1 s of CPU for
    a 500-team policy: never on the hub's loop (``text_and_diff_beside``).
    """
    data = source.model_dump(by_alias=True, exclude_defaults=True) if hasattr(source, "model_dump") else source
    if isinstance(data, dict) and isinstance(data.get("profiles"), list):
        data = dict(
            data,
            profiles=[
                dict(prof, env={k: MASK for k in prof["env"]})
                if isinstance(prof, dict) and isinstance(prof.get("env"), dict) and prof["env"]
                else prof
                for prof in data["profiles"]
            ],
        )  # copies: the store's data is shared
    if not isinstance(data, dict):
        return yaml.dump(data, Dumper=_Dumper, sort_keys=False)
    # One short libyaml call per team, profile, ... rather than one for the document: libyaml's
    # emitter holds the GIL for as long as a call runs (0.4 s for 500 teams). The text is the same.
    parts = []
    for key, value in data.items():
        if isinstance(value, list) and value:
            parts.append(yaml.dump({key: None}, Dumper=_Dumper).replace(" null\n", "\n"))
            parts.extend(yaml.dump([item], Dumper=_Dumper, sort_keys=False) for item in value)
        else:
            parts.append(yaml.dump({key: value}, Dumper=_Dumper, sort_keys=False))
    return "".join(parts)


def text_diff(old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), "before", "after", n=1))


def _lines(data: dict) -> list[bytes]:
    """``data`` as JSON lines: one for all but its lists, then one per item of them; each
    ``json.dumps`` short, the lock offered between them (called in a thread of the hub)."""
    import time

    out = [
        json.dumps(
            {
                "layout": [[k, len(v) if isinstance(v, list) else None] for k, v in data.items()],
                "rest": {k: v for k, v in data.items() if not isinstance(v, list)},
            }
        ).encode()
    ]
    for value in data.values():
        if isinstance(value, list):
            for item in value:
                out.append(json.dumps(item).encode())
                time.sleep(0)
    return out


def _unlines(lines: list[bytes]) -> dict:
    head, i, data = json.loads(lines[0]), 1, {}
    for key, n in head["layout"]:
        if n is None:
            data[key] = head["rest"][key]
        else:
            data[key] = [json.loads(line) for line in lines[i : i + n]]
            i += n
    return data


def _text_and_diff_child() -> None:
    """In the child: stdin is a JSON line {"old": text or null, "before": n}, the before data's
    n lines (when no text), then the after data's lines; stdout: {"text": ..., "diff": ...}."""
    lines = sys.stdin.buffer.read().split(b"\n")
    head = json.loads(lines[0])
    n = head["before"]
    old = head["old"] if head["old"] is not None else (data_text(_unlines(lines[1 : 1 + n])) if n else "")
    new = data_text(_unlines(lines[1 + n :]))
    sys.stdout.write(json.dumps({"text": new, "diff": text_diff(old, new) if new != old else None}))


_TEXT_CHILD = "import os; os.nice(10); from gpuhub_spawner.usage.policy_text import _text_and_diff_child; _text_and_diff_child()"


def text_and_diff_beside(old: str | None, before, after: dict) -> tuple[str, str | None]:
    """The masked text of ``after`` (plain data) and its diff from ``old`` (the text of ``before``
    if known, else made from ``before``, plain data or None: empty), None when the texts are the
    same -- made in a child process (1-2 s of CPU for a large policy: in a thread of the hub it
    would keep the loop waiting for the lock); here when no child can run. Call from a thread."""
    try:
        if old is None and before is not None:
            before_lines = _lines(before)
        else:
            before_lines = []
        head = json.dumps({"old": old if old is not None or before is not None else "", "before": len(before_lines)})
        stdin = b"\n".join([head.encode(), *before_lines, *_lines(after)])
        done = subprocess.run([sys.executable, "-c", _TEXT_CHILD], input=stdin, capture_output=True, timeout=600)
        if done.returncode == 0:
            answer = json.loads(done.stdout)
            return answer["text"], answer["diff"]
    except (OSError, subprocess.SubprocessError, ValueError, TypeError):
        pass
    if old is None:
        old = data_text(before) if before is not None else ""
    new = data_text(after)
    return new, (text_diff(old, new) if new != old else None)
