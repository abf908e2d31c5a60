"""Read a policy file and explain every mistake with its YAML path and line:column.

PyYAML's composed node tree gives positions; pydantic gives structural errors; the
cross-reference checks (dangling names, duplicates, unusable profiles, caps above quota)
live here because they need the whole file.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import yaml
from pydantic import BaseModel, ValidationError

from .mig import mig_checks
from .model import Policy, SecretGrant, TeamData

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class PolicyIssue:
    path: str  # e.g. profiles[2].gpu.count
    line: int | None
    column: int | None
    message: str

    def format(self, filename: str) -> str:
        where = f"{filename}:{self.line}:{self.column}" if self.line else filename
        return f"{where}: {self.path or '(top level)'}: {self.message}"


class PolicyError(Exception):
    """A policy that cannot be used; ``issues`` lists every located problem."""

    def __init__(self, filename: str, issues: list[PolicyIssue]):
        self.filename = filename
        self.issues = issues
        super().__init__("\n".join(i.format(filename) for i in issues))


def format_loc(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


class _Positions:
    """Maps a data path to the YAML node (key or value) it came from."""

    def __init__(self, root: yaml.Node | None):
        self.root = root

    def mark(self, loc: Loc, key: bool = False) -> tuple[int, int] | None:
        node = self.root
        best = node
        for i, part in enumerate(loc):
            if isinstance(node, yaml.MappingNode):
                found = None
                for k, v in node.value:
                    if isinstance(k, yaml.ScalarNode) and k.value == str(part):
                        found = (k, v)
                        break
                if found is None:
                    break
                last = i == len(loc) - 1
                node = found[0] if (key and last) else found[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
                if part >= len(node.value):
                    break
                node = node.value[part]
            else:
                break
            best = node
        if best is None:
            return None
        return best.start_mark.line + 1, best.start_mark.column + 1

    def duplicate_key_issues(self, found: Iterable[tuple[Loc, yaml.Node]] | None = None) -> list["PolicyIssue"]:
        """A located issue for every key that appears twice in one mapping (``found``: those
        already found while the data was built)."""
        return [
            PolicyIssue(
                format_loc(loc),
                node.start_mark.line + 1,
                node.start_mark.column + 1,
                f"key {loc[-1]!r} appears twice; the second would silently win",
            )
            for loc, node in (self.duplicate_keys() if found is None else found)
        ]

    def duplicate_keys(self) -> Iterable[tuple[Loc, yaml.Node]]:
        def walk(node: yaml.Node, loc: Loc):
            if isinstance(node, yaml.MappingNode):
                seen: set[str] = set()
                for k, v in node.value:
                    name = k.value
                    if name in seen:
                        yield loc + (name,), k
                    seen.add(name)
                    yield from walk(v, loc + (name,))
            elif isinstance(node, yaml.SequenceNode):
                for i, item in enumerate(node.value):
                    yield from walk(item, loc + (i,))

        if self.root is not None:
            yield from walk(self.root, ())


def _field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The pydantic model whose fields are valid at ``loc`` (for did-you-mean)."""
    model: Any = Policy
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    import typing

    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        for inner in typing.get_args(arg):
            found = _unwrap(inner)
            if isinstance(found, type) and issubclass(found, BaseModel):
                return found
    return annotation


def suggest(word: str | int, choices: Iterable[str]) -> str:
    import difflib  # only for a mistake

    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _message(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    got = err.get("input")
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return f"must be a whole number (got {got!r})"
    if kind == "greater_than_equal":
        return f"must be at least {err['ctx']['ge']} (got {got!r})"
    if kind == "less_than_equal":
        return f"must be at most {err['ctx']['le']} (got {got!r})"
    if kind == "missing":
        return "is required"
    if kind == "too_short":
        return "must not be empty"
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind == "literal_error":
        return f"must be one of {err['ctx']['expected']} (got {got!r})"
    if kind in ("dict_type", "model_type"):
        return f"must be a mapping (got {type(got).__name__})"
    if kind == "list_type":
        return f"must be a list (got {type(got).__name__})"
    return f"{err['msg']} (got {got!r})"


def _clean_loc(loc: Loc) -> Loc:
    # pydantic inserts validator/union tags into locations; drop them.
    return tuple(p for p in loc if isinstance(p, int) or ("[" not in p and p not in ("int", "str")))


# libyaml (C) when PyYAML was built with it: ~20x faster than the pure-Python parser on
# a 500-team, 2,000-profile policy. Same safe tag set, same node marks (line:column).
if TYPE_CHECKING:
    from yaml import SafeLoader as _Loader  # the same interface as CSafeLoader
else:
    _Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SCALAR, _MAPPING, _SEQUENCE = yaml.ScalarNode, yaml.MappingNode, yaml.SequenceNode
_STR, _MAP, _SEQ = "tag:yaml.org,2002:str", "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"


class _PolicyLoader(_Loader):
    """The safe loader, resolving each distinct (value, implicit) scalar once: a policy repeats
    the same keys and values thousands of times, and the resolver's regular expressions are
    Python. The safe loader has no path resolvers, so a tag depends on nothing else: a
    mapping or sequence is always ``map``/``seq``, and the composer's descend/ascend hooks
    (called around every node, to follow path resolvers) have nothing to do. (Python calls on
    purpose: each lets another thread have the GIL, so a parse in a thread does not hold the
    hub's loop for the whole document, as a C-level cache would.)"""

    def __init__(self, stream):
        super().__init__(stream)
        self._tags: dict = {}  # implicit -> {value: tag}
        if not self.yaml_path_resolvers:
            # No-ops taking the composer's arguments, (parent, index) and (), without a Python frame.
            self.descend_resolver = slice
            self.ascend_resolver = tuple

    def resolve(self, kind, value, implicit):
        if kind is _SCALAR:
            tags = self._tags.get(implicit)
            if tags is None:
                tags = self._tags[implicit] = {}
            tag = tags.get(value)
            if tag is None:
                tag = tags[value] = super().resolve(kind, value, implicit)
            return tag
        if not self.yaml_path_resolvers:
            if kind is _MAPPING:
                return _MAP
            if kind is _SEQUENCE:
                return _SEQ
        return super().resolve(kind, value, implicit)


class _Unusual(Exception):
    """A node the direct build does not handle (merge keys, shared nodes, other tags)."""


def _build(loader, root: yaml.Node) -> tuple[Any, list[tuple[Loc, yaml.Node]]]:
    """The data of ``root`` as the safe constructor would build it, and every key that appears
    twice in one mapping, in one walk. Covers plain mappings with string keys, sequences,
    strings, ints, floats, booleans and nulls (a policy); anything else raises ``_Unusual``
    and the caller uses PyYAML's constructor. (The walk keeps no path: a key found twice,
    rare, is located afterwards by a second walk that does.)"""
    scalars = {
        "tag:yaml.org,2002:int": loader.construct_yaml_int,
        "tag:yaml.org,2002:float": loader.construct_yaml_float,
        "tag:yaml.org,2002:bool": loader.construct_yaml_bool,
        "tag:yaml.org,2002:null": loader.construct_yaml_null,
    }
    seen: set[int] = set()
    twice = []

    def build(node):
        kind = type(node)
        if kind is _SCALAR:
            tag = node.tag
            if tag == _STR:
                return node.value
            construct = scalars.get(tag)
            if construct is None:
                raise _Unusual(tag)
            return construct(node)
        if id(node) in seen:  # an alias: the constructor shares the object (and may recurse)
            raise _Unusual("alias")
        seen.add(id(node))
        tag = node.tag
        if kind is _MAPPING and tag == _MAP:
            out = {}
            for k, v in node.value:
                if type(k) is not _SCALAR or k.tag != _STR:  # merge keys, non-string keys
                    raise _Unusual(k.tag)
                name = k.value
                if name in out:
                    twice.append(k)
                out[name] = build(v)
            return out
        if kind is _SEQUENCE and tag == _SEQ:
            return [build(item) for item in node.value]
        raise _Unusual(tag)

    data = build(root)
    return data, (list(_Positions(root).duplicate_keys()) if twice else [])


_EVENTS = yaml.events
_SCALAR_EVENT = _EVENTS.ScalarEvent
_MAPPING_START, _MAPPING_END = _EVENTS.MappingStartEvent, _EVENTS.MappingEndEvent
_SEQUENCE_START, _SEQUENCE_END = _EVENTS.SequenceStartEvent, _EVENTS.SequenceEndEvent
_NEEDS_NODES = object()  # ``_read_plain``: this text takes the composer's way
_NO_KEY = object()  # a mapping waiting for its next key


def _read_plain(text: str) -> Any:
    """The data of a plain policy file straight from libyaml's event stream, as the safe loader
    would build it, without composing a node tree (each node a Python object with two marks,
    and a Python call to resolve its tag): about half the time of compose + ``_build`` on a
    500-team policy. Covers one document of mappings with string keys, sequences, strings,
    ints, floats, booleans and nulls, each key once. Anything else (a YAML error, a key written
    twice, anchors and aliases, merge keys, other tags, several documents) returns
    ``_NEEDS_NODES``: the caller then composes the node tree, which also locates every issue.
    """
    loader = _Loader(text)
    try:
        return _events_to_data(loader)
    except Exception:  # _Unusual, a YAML error, anything unforeseen: the composer's way decides
        return _NEEDS_NODES
    finally:
        loader.dispose()


def _events_to_data(loader) -> Any:
    get = loader.get_event
    if type(get()) is not _EVENTS.StreamStartEvent or type(get()) is not _EVENTS.DocumentStartEvent:
        raise _Unusual("not one document")
    constructors = {
        "tag:yaml.org,2002:int": loader.construct_yaml_int,
        "tag:yaml.org,2002:float": loader.construct_yaml_float,
        "tag:yaml.org,2002:bool": loader.construct_yaml_bool,
        "tag:yaml.org,2002:null": loader.construct_yaml_null,
    }
    resolve = loader.resolve
    scalars: dict = {}  # (text, implicit or tag) -> (value,): a policy repeats its keys and values
    stack: list = []  # the enclosing (container, pending key) of the one being built
    container: Any = None
    key: Any = _NO_KEY
    root: Any = None
    while True:
        event = get()
        kind = type(event)
        if kind is _SCALAR_EVENT:
            if event.anchor is not None:
                raise _Unusual("anchor")
            tag = event.tag
            cache_key = (event.value, event.implicit if tag is None or tag == "!" else tag)
            hit = scalars.get(cache_key)
            if hit is None:
                if tag is None or tag == "!":
                    tag = resolve(_SCALAR, event.value, event.implicit)
                if tag == _STR:
                    hit = (event.value,)
                elif tag in constructors:
                    hit = (constructors[tag](_SCALAR(tag, event.value)),)
                else:
                    raise _Unusual(tag)
                scalars[cache_key] = hit
            value = hit[0]
        elif kind is _MAPPING_START or kind is _SEQUENCE_START:
            if event.anchor is not None:
                raise _Unusual("anchor")
            mapping = kind is _MAPPING_START
            if event.tag not in (None, "!", _MAP if mapping else _SEQ):
                raise _Unusual(event.tag)
            stack.append((container, key))
            container, key = ({} if mapping else []), _NO_KEY
            continue
        elif kind is _MAPPING_END or kind is _SEQUENCE_END:
            value = container
            container, key = stack.pop()
        elif kind is _EVENTS.DocumentEndEvent:
            break
        else:  # an alias
            raise _Unusual(kind.__name__)
        if container is None:  # the document's root
            root = value
        elif type(container) is list:
            container.append(value)
        elif key is _NO_KEY:
            if type(value) is not str:  # a key that is not a string (a number, a mapping, a merge key)
                raise _Unusual("key")
            if value in container:  # located by the composer's way
                raise _Unusual("a key twice")
            key = value
        else:
            container[key] = value
            key = _NO_KEY
    if type(get()) is not _EVENTS.StreamEndEvent:
        raise _Unusual("more than one document")
    return root


def _compose_and_construct(text: str) -> tuple[yaml.Node | None, Any, list[tuple[Loc, yaml.Node]]]:
    """Parse once: the node tree (for line:column of every error), the data built from it,
    and the keys that appear twice in a mapping."""
    loader = _PolicyLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, None, []
        try:
            data, duplicates = _build(loader, root)
        except (_Unusual, RecursionError):
            data, duplicates = loader.construct_document(root), list(_Positions(root).duplicate_keys())
    finally:
        loader.dispose()
    return root, data, duplicates


@contextmanager
def no_cyclic_gc():
    """Building a large policy allocates ~100,000 objects and no cycles; Python's cyclic
    collector would scan the growing heap again and again meanwhile (about 60 % of the
    time of a 500-team policy). Paused for the parse, back on afterwards if it was on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def parse_policy(text: str, filename: str = "<policy>") -> Policy:
    """Parse and validate; raise ``PolicyError`` listing every problem found."""
    return _parse(text, filename)[0]


def _parse(text: str, filename: str) -> tuple[Policy, Any]:
    """``parse_policy``, also returning the plain data the policy was validated from."""
    with no_cyclic_gc():
        return _parse_now(text, filename)


def _parse_now(text: str, filename: str) -> tuple[Policy, Any]:
    # A valid file (the common case) is read from libyaml's events and validated; only a file
    # with a problem, or one the direct reading does not cover, gets the node tree that
    # locates each issue (the validation already done is not repeated: same data).
    data = _read_plain(text)
    checked: Policy | ValidationError | None = None
    if data is not _NEEDS_NODES and isinstance(data, dict):
        try:
            checked = Policy.model_validate(data)
        except ValidationError as e:
            checked = e
        else:
            problems = list(cross_check(checked))
            if not problems:
                return checked, data
    try:
        root, data, duplicates = _compose_and_construct(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        problem = getattr(e, "problem", None) or str(e)
        raise PolicyError(filename, [PolicyIssue("", line, col, f"YAML syntax error: {problem}")]) from None
    positions = _Positions(root)
    issues: list[PolicyIssue] = []

    def add(loc: Loc, message: str, key: bool = False) -> None:
        line, col = positions.mark(loc, key=key) or (None, None)
        issues.append(PolicyIssue(format_loc(loc), line, col, message))

    issues.extend(positions.duplicate_key_issues(duplicates))

    if not isinstance(data, dict):
        add((), "the policy must be a mapping with teams, profiles, flavors, ...")
        raise PolicyError(filename, issues)

    try:
        if isinstance(checked, ValidationError):
            raise checked
        policy = checked if checked is not None else Policy.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = _clean_loc(err["loc"])
            if err["type"] == "extra_forbidden":
                model = _model_at(loc[:-1])
                hint = suggest(loc[-1], _field_names(model)) if model else ""
                add(loc, f"unknown key {loc[-1]!r}{hint}", key=True)
            else:
                add(loc, _message(err))
        raise PolicyError(filename, sorted(issues, key=lambda i: (i.line or 0, i.column or 0))) from None

    for loc, message in problems if isinstance(checked, Policy) else cross_check(policy):
        add(loc, message)
    if issues:
        raise PolicyError(filename, sorted(issues, key=lambda i: (i.line or 0, i.column or 0)))
    return policy, data


def load_policy(path: str | Path) -> Policy:
    return load_policy_data(path)[0]


def load_policy_data(path: str | Path) -> tuple[Policy, Any]:
    """``load_policy``, also returning the plain data as read from the file (the ``PolicyStore``
    keeps it: the audit's diff of a reload is taken from it, without dumping the policy again)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PolicyError(str(path), [PolicyIssue("", None, None, f"cannot read file: {e.strerror}")]) from None
    return _parse(text, str(path))


def _duplicates(names: list[str], section: str, field: str) -> Iterable[tuple[Loc, str]]:
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            yield (section, i, field), f"{field} {name!r} is already used by {section}[{seen[name]}]"
        seen.setdefault(name, i)


def _grant_checks(policy: Policy, teams: list[str]) -> Iterable[tuple[Loc, str]]:
    """``secrets`` and ``data``: unique names, known teams and profiles, one secret per
    environment variable for any server (docs/secrets-and-data.md)."""
    slugs = [p.slug for p in policy.profiles]
    team_set, slug_set = set(teams), set(slugs)
    yield from _duplicates([s.name for s in policy.secrets], "secrets", "name")
    yield from _duplicates([d.name for d in policy.data], "data", "name")
    entries_of: list[tuple[str, Sequence[SecretGrant | TeamData]]] = [("secrets", policy.secrets), ("data", policy.data)]
    for section, entries in entries_of:
        for i, entry in enumerate(entries):
            for j, t in enumerate(entry.teams):
                if t != "*" and t not in team_set:
                    yield (section, i, "teams", j), f"unknown team {t!r}" + suggest(t, teams)
            for j, p in enumerate(entry.profiles):
                if p != "*" and p not in slug_set:
                    yield (section, i, "profiles", j), f"unknown profile {p!r}" + suggest(p, slugs)

    def overlap(a: list[str], b: list[str]) -> bool:
        return not a or not b or "*" in a or "*" in b or bool(set(a) & set(b))

    for i, s in enumerate(policy.secrets):
        if s.env is None:
            continue
        for k, other in enumerate(policy.secrets[:i]):
            if other.env == s.env and overlap(s.teams, other.teams) and overlap(s.profiles, other.profiles):
                yield (
                    ("secrets", i, "env"),
                    f"secrets[{k}] ({other.name!r}) also sets {s.env} for some of the same servers; one would silently win",
                )
                break


def max_reachable_gpus(policy: Policy, team_name: str, flavor: str, lendable: dict | None = None) -> int:
    """The most GPUs of ``flavor`` a team could ever hold: nominal plus what it may borrow.
    ``lendable``: ``lendable_gpus(policy)``, for many questions about one policy."""
    team = policy.team(team_name)
    if team.quota.gpu_memory is not None and flavor in team.quota.gpu_memory.flavors:
        return _reachable_slices_by_memory(policy, team, flavor)
    own = team.quota.gpus.get(flavor)
    nominal = own.nominal if own else 0
    if not team.cohort:
        return nominal
    if lendable is None:
        lendable = lendable_gpus(policy, team)
    # What the cohort's other teams lend (teams of the same name count as this one).
    borrow = lendable.get((team.cohort, flavor), 0) - lendable.get((team.cohort, flavor, team.name), 0)
    if own and own.borrowing_limit is not None:
        borrow = min(borrow, own.borrowing_limit)
    return nominal + borrow


def lendable_gpus(policy: Policy, team=None) -> dict:
    """GPUs each cohort's teams may lend, per flavor: ``(cohort, flavor)`` -> the sum of its
    teams' lending limits (nominal quota where none is set), and ``(cohort, flavor, team)`` ->
    the part of that sum from teams of that name. Only ``team``'s cohort when given."""
    out: dict = {}
    for other in policy.teams if team is None else policy.cohort_members(team):
        if not other.cohort:
            continue
        for name, q in other.quota.gpus.items():
            amount = q.lending_limit if q.lending_limit is not None else q.nominal
            out[other.cohort, name] = out.get((other.cohort, name), 0) + amount
            out[other.cohort, name, other.name] = out.get((other.cohort, name, other.name), 0) + amount
    return out


def _reachable_slices_by_memory(policy: Policy, team, flavor: str) -> int:
    """A team counting ``flavor``'s MIG slices in GPU memory (``quota.gpuMemory``): how many
    slices its memory quota, plus what it may borrow of the cohort's, could ever hold."""
    try:
        mig = next(f.mig for f in policy.flavors if f.name == flavor)
    except StopIteration:
        return 0
    if mig is None:
        return 0
    own = team.quota.gpu_memory
    reach = own.nominal
    if team.cohort:
        lendable = sum(
            (q.lending_limit if q.lending_limit is not None else q.nominal)
            for o in policy.cohort_members(team)
            if o.name != team.name and (q := o.quota.gpu_memory)
        )
        reach += min(lendable, own.borrowing_limit) if own.borrowing_limit is not None else lendable
    return reach // mig.memory


def _fair_share_checks(policy: Policy, flavors: list[str]) -> Iterable[tuple[Loc, str]]:
    """``fairShare`` and team weights (docs/fair-share.md)."""
    from .quantities import format_duration as fmt

    fs = policy.fair_share
    if fs is None:
        for ti, team in enumerate(policy.teams):
            if "weight" in team.model_fields_set:
                yield (
                    ("teams", ti, "weight"),
                    "a weight only counts with fair share on: add a fairShare section (fairShare: {} for the defaults)",
                )
                break  # one is enough to say it
        return
    for name in fs.flavor_weights:
        if name not in flavors:
            yield ("fairShare", "flavorWeights", name), f"unknown flavor {name!r}" + suggest(name, flavors)
    notice = max((policy.reclaim_rules(t).notice or 0.0 for t in policy.teams), default=0.0)
    if fs.min_runtime and fs.min_runtime + notice >= policy.defaults.queue_timeout:
        yield (
            ("fairShare", "minRuntime"),
            f"minRuntime ({fmt(fs.min_runtime)}) plus the reclaim notice ({fmt(notice)}) must be shorter than "
            f"defaults.queueTimeout ({fmt(policy.defaults.queue_timeout)}): a lending team would give up waiting "
            "before a borrower could be asked to give its GPUs back",
        )


def cross_check(policy: Policy) -> Iterable[tuple[Loc, str]]:
    flavors = [f.name for f in policy.flavors]
    priorities = [p.name for p in policy.priority_classes]
    teams = [t.name for t in policy.teams]
    yield from _duplicates(flavors, "flavors", "name")
    yield from _duplicates(priorities, "priorityClasses", "name")
    yield from _duplicates(teams, "teams", "name")
    yield from _duplicates([t.local_queue for t in policy.teams], "teams", "queue")
    yield from _duplicates([p.slug for p in policy.profiles], "profiles", "slug")

    flavor_set = set(flavors)
    # Per team and flavor once, not per profile: a large policy has 2,000 profiles.
    lendable = lendable_gpus(policy)
    reach: dict[tuple[str, str], int] = {}

    def can_hold(team: str, flavor: str) -> int:
        if (team, flavor) not in reach:
            reach[team, flavor] = max_reachable_gpus(policy, team, flavor, lendable)
        return reach[team, flavor]

    if policy.defaults.priority and policy.defaults.priority not in priorities:
        yield (
            ("defaults", "priority"),
            f"unknown priority class {policy.defaults.priority!r}" + suggest(policy.defaults.priority, priorities),
        )

    yield from _fair_share_checks(policy, flavors)

    for ti, team in enumerate(policy.teams):
        if team.default_priority and team.default_priority not in priorities:
            yield (
                ("teams", ti, "defaultPriority"),
                f"unknown priority class {team.default_priority!r}" + suggest(team.default_priority, priorities),
            )
        for fname, q in team.quota.gpus.items():
            loc = ("teams", ti, "quota", "gpus", fname)
            if fname not in flavor_set:
                yield loc, f"unknown flavor {fname!r}" + suggest(fname, flavors)
            if q.lending_limit is not None and q.lending_limit > q.nominal:
                yield loc + ("lendingLimit",), f"lendingLimit {q.lending_limit} is above the nominal quota {q.nominal}"
            if q.borrowing_limit is not None and not team.cohort:
                yield loc + ("borrowingLimit",), "borrowingLimit needs the team to be in a cohort"
        for res in ("cpu", "memory"):
            q = getattr(team.quota, res)
            if q and q.lending_limit is not None and q.lending_limit > q.nominal:
                yield ("teams", ti, "quota", res, "lendingLimit"), "lendingLimit is above the nominal quota"
            if q and q.borrowing_limit is not None and not team.cohort:
                yield ("teams", ti, "quota", res, "borrowingLimit"), "borrowingLimit needs the team to be in a cohort"
        cap = team.per_user.max_gpus
        if cap is not None:
            reachable = sum(can_hold(team.name, f) for f in team.quota.gpus if f in flavor_set)
            if cap > reachable:
                yield (
                    ("teams", ti, "perUser", "maxGPUs"),
                    (f"per-user cap of {cap} GPUs is above what team {team.name!r} can ever hold ({reachable})"),
                )

    yield from _grant_checks(policy, teams)

    # Roles: a group cannot be both all-seeing admin and read-only viewer.
    admins = set(policy.roles.admins)
    for i, group in enumerate(policy.roles.viewers):
        if group in admins:
            yield ("roles", "viewers", i), f"group {group!r} is also in roles.admins: a group is either admin or viewer"

    team_index = {name: i for i, name in reversed(list(enumerate(teams)))}
    for pi, prof in enumerate(policy.profiles):
        if prof.priority and prof.priority not in priorities:
            yield ("profiles", pi, "priority"), f"unknown priority class {prof.priority!r}" + suggest(prof.priority, priorities)
        for ti, tname in enumerate(prof.teams):
            if tname != "*" and tname not in team_index:
                yield ("profiles", pi, "teams", ti), f"unknown team {tname!r}" + suggest(tname, teams)
        if "*" in prof.teams:
            allowed = teams
        else:
            allowed = sorted({t for t in prof.teams if t in team_index}, key=team_index.__getitem__)
        if not prof.teams:
            yield ("profiles", pi, "teams"), f"profile {prof.slug!r} lists no team, so nobody can use it"
            continue
        if prof.gpu and prof.gpu.count > 0:
            if prof.gpu.flavor not in flavor_set:
                yield ("profiles", pi, "gpu", "flavor"), f"unknown flavor {prof.gpu.flavor!r}" + suggest(prof.gpu.flavor, flavors)
                continue
            # Is there a team that can hold it (fits), and one of those whose per-user cap allows it?
            # Stops at the first such team: a profile for "*" would otherwise ask all 500.
            fits = capped = False
            for t in allowed:
                if can_hold(t, prof.gpu.flavor) >= prof.gpu.count:
                    fits = True
                    cap = policy.team(t).per_user.max_gpus
                    if cap is None or cap >= prof.gpu.count:
                        capped = True
                        break
            if allowed and not fits:
                yield (
                    ("profiles", pi, "gpu", "count"),
                    (
                        f"no team may use profile {prof.slug!r}: it asks for {prof.gpu.count} "
                        f"{prof.gpu.flavor} GPU(s) but none of {', '.join(allowed)} can ever hold that many"
                    ),
                )
            if fits and not capped:
                yield (
                    ("profiles", pi, "gpu", "count"),
                    (
                        f"no team may use profile {prof.slug!r}: its {prof.gpu.count} GPU(s) exceed every allowed team's per-user cap"
                    ),
                )

    yield from mig_checks(policy)  # MIG flavors, one slice per server (docs/mig.md)


def read_in_child(path: str) -> str:
    """The hub's reload of a large policy runs this in a child process (``PolicyStore``).

    libyaml holds the GIL for the whole document, so in a thread of the hub it would stall
    the event loop; here it runs beside it. Answers one JSON line: the validated plain
    data (the hub validates it again to build its objects, a few ms that let go of the
    GIL), or the located issues.
    """
    import json

    try:
        text = Path(path).read_text()
        _, data = _parse(text, path)
    except OSError as e:
        return json.dumps(
            {
                "ok": False,
                "filename": path,
                "issues": [{"path": "", "line": None, "column": None, "message": f"cannot read file: {e.strerror}"}],
            }
        )
    except PolicyError as e:
        return json.dumps({"ok": False, "filename": e.filename, "issues": [i.__dict__ for i in e.issues]})
    return json.dumps({"ok": True, "data": data}, default=str)
