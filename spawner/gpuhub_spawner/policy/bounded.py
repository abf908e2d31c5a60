"""Reading what users send the hub, with bounded work: YAML and JSON, spawn options, env names.

Everything a user can make the hub parse runs on its event loop, so every reader here is
bounded *before or while* it parses, never after:

- size in bytes first (``max_bytes``: one comparison, nothing read yet);
- YAML: libyaml's event stream (C) is scanned before anything is composed, counting
  nodes and depth and refusing anchors, aliases, non-core tags and over-long numbers at
  the first offending event, with its line:column. Aliases are refused outright: a
  424-byte file of nested aliases is 10^7 nodes to any walk that follows them.
- JSON: lists and objects are counted in the raw bytes before decoding (``[`` and ``{``,
  in C; an upper bound, as brackets inside strings count too). Containers are what costs:
  each is a garbage-collected allocation, and 85,000 empty lists (250 KB) set off full
  collections of the hub's heap, 0.5-1 s on the event loop, where strings and numbers of
  the same size decode in ~5 ms. The decode is then C and linear in the bytes, its
  recursion guard stops deep nesting, and depth and value count are checked right
  after, in a walk that stops at the limit.

Refusals are ``InputRefused`` (a ``ValueError``) carrying the HTTP status (413 for size,
400 otherwise) and a message meant for the user. The policy core layer: imports nothing
of gpuhub.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Collection, Mapping

import yaml

# Job files are a few hundred bytes (a few dozen values). Scanning a full 64 KiB file
# takes ~1-2 ms; the node cap keeps compose + validation in the same range.
MAX_JOB_FILE_BYTES = 64 * 1024
MAX_JOB_FILE_NODES = 1000  # ~10 ms to compose, build and validate on a loaded 2-core machine
MAX_JOB_FILE_DEPTH = 16
MAX_NUMBER_CHARS = 100  # YAML 1.1 base-60 ints ("1:0:0:...") cost quadratic time to build
# The JSON bodies of gpuhub's own API handlers (a job submission wraps a job file).
MAX_JOB_BODY_BYTES = 3 * MAX_JOB_FILE_BYTES
MAX_SMALL_BODY_BYTES = 16 * 1024  # {"server": name} and the like
MAX_JSON_DEPTH = 16
MAX_JSON_NODES = 10_000
# Every request body the hub's HTTP server passes on (JupyterHub's own handlers included:
# spawn requests with user_options, tokens, admin calls), with ``limit_request_bodies()``;
# larger ones get a 413 before any handler runs. JSON of this size decodes in ~5-40 ms on
# a loaded 2-core machine once the hub's start-up heap is frozen (``freeze_heap()``).
MAX_REQUEST_BODY_BYTES = 256 * 1024
# Spawn options (form posts, REST user_options): gpuhub reads 'profile' and 'team'.
MAX_OPTIONS = 16
MAX_OPTION_KEY_CHARS = 64
MAX_OPTION_CHARS = 200


class InputRefused(ValueError):
    """Input refused before (or while) it was parsed; ``status`` is 413 (size) or 400."""

    def __init__(self, status: int, message: str, line: int | None = None, column: int | None = None, path: str = ""):
        self.status, self.message, self.line, self.column, self.path = status, message, line, column, path
        where = f"line {line}, column {column}: " if line else ""
        super().__init__(where + message)


# -- YAML -------------------------------------------------------------------------------------
_CLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_CORE = "tag:yaml.org,2002:"
ALLOWED_TAGS = frozenset({"!", *(_CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map"))})
_NUMBER_TAGS = frozenset({_CORE + "int", _CORE + "float"})
_RESOLVER = yaml.resolver.Resolver()


def _size(text: str | bytes) -> int:
    return len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))


def scan_yaml(
    text: str | bytes,
    *,
    what: str = "job files",
    max_bytes: int = MAX_JOB_FILE_BYTES,
    max_nodes: int = MAX_JOB_FILE_NODES,
    max_depth: int = MAX_JOB_FILE_DEPTH,
) -> int:
    """Refuse a YAML document before it is composed; return its node count.

    Stops at the first event over a limit, so the work is at most ``max_nodes`` events
    of a document of at most ``max_bytes``. Syntax errors are raised as ``yaml.YAMLError``.
    """
    if len(text) > max_bytes or _size(text) > max_bytes:  # characters <= bytes: the first test is free
        raise InputRefused(413, f"{what} may have at most {max_bytes} bytes (this one has {_size(text)})")
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, e.g. from JSON's "\ud800"
            raise InputRefused(400, f"{what} must be UTF-8 text (character {e.start + 1} is not)") from None
    path: list[list] = []  # one [kind, children seen, last key] per open collection
    nodes = 0

    def refuse(event, message: str):
        mark = event.start_mark
        raise InputRefused(400, message, mark.line + 1, mark.column + 1, _path(path))

    for event in yaml.parse(text, Loader=_CLoader):
        if isinstance(event, yaml.CollectionEndEvent):
            path.pop()
            continue
        if not isinstance(event, yaml.NodeEvent):  # stream and document boundaries
            continue
        if path:  # where this node sits, for the message
            parent = path[-1]
            if parent[0] == "map" and parent[1] % 2 == 0:
                parent[2] = event.value if isinstance(event, yaml.ScalarEvent) else "?"
            parent[1] += 1
        if isinstance(event, yaml.AliasEvent) or event.anchor is not None:
            refuse(event, f"YAML anchors and aliases are not accepted in {what}")
        if event.tag is not None and event.tag not in ALLOWED_TAGS:
            tag = "!!" + event.tag[len(_CORE) :] if event.tag.startswith(_CORE) else event.tag
            refuse(event, f"the YAML tag {tag!r} is not accepted in {what} (plain values, lists and mappings only)")
        nodes += 1
        if nodes > max_nodes:
            refuse(event, f"{what} may hold at most {max_nodes} values (keys, list items and values)")
        if isinstance(event, yaml.ScalarEvent):
            if (
                not event.style
                and event.implicit[0]
                and len(event.value) > MAX_NUMBER_CHARS  # plain (C: '', Python: None)
                and _RESOLVER.resolve(yaml.ScalarNode, event.value, (True, False)) in _NUMBER_TAGS
            ):
                refuse(event, f"a number may have at most {MAX_NUMBER_CHARS} characters (quote it to make it text)")
        else:
            if len(path) >= max_depth:
                refuse(event, f"{what} may nest lists and mappings at most {max_depth} levels deep")
            path.append(["map" if isinstance(event, yaml.MappingStartEvent) else "seq", 0, None])
    return nodes


def _path(stack: list[list]) -> str:
    out = ""
    for kind, seen, key in stack:
        if kind == "seq":
            out += f"[{max(seen - 1, 0)}]"
        elif key is not None:
            out += ("." if out else "") + str(key)[:100]
    return out


def load_yaml(
    text: str | bytes,
    *,
    what: str = "job files",
    max_bytes: int = MAX_JOB_FILE_BYTES,
    max_nodes: int = MAX_JOB_FILE_NODES,
    max_depth: int = MAX_JOB_FILE_DEPTH,
) -> tuple[yaml.Node | None, Any]:
    """``scan_yaml``, then compose and construct once (C): the node tree (line:column) and the data.

    With aliases refused every node is composed, walked and constructed once.
    """
    scan_yaml(text, what=what, max_bytes=max_bytes, max_nodes=max_nodes, max_depth=max_depth)
    loader = _CLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except (ValueError, OverflowError, TypeError) as e:  # a value PyYAML cannot build (scan catches the known ones)
        raise InputRefused(400, f"a value cannot be read: {str(e)[:200]}") from None
    finally:
        loader.dispose()
    return root, data


# -- JSON -------------------------------------------------------------------------------------
def loads_json(
    body: bytes | str | None,
    *,
    what: str = "the request body",
    max_bytes: int = MAX_SMALL_BODY_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    max_nodes: int = MAX_JSON_NODES,
    max_containers: int | None = None,
    empty: Any = None,
) -> Any:
    """Decode a JSON body no larger than ``max_bytes``, with at most ``max_containers`` lists
    and objects (default ``max_nodes``), no deeper than ``max_depth``, with at most
    ``max_nodes`` values; ``empty`` for an empty body."""
    if body is None or len(body) == 0:
        return empty
    if len(body) > max_bytes:
        raise InputRefused(413, f"{what} may have at most {max_bytes} bytes (this one has {len(body)})")
    if not body.strip():
        return empty
    limit = max_nodes if max_containers is None else max_containers
    containers = body.count(b"[") + body.count(b"{") if isinstance(body, bytes) else body.count("[") + body.count("{")
    if containers > limit:  # before a single one is allocated
        raise InputRefused(400, f"{what} holds too many lists and objects (at most {limit})")
    try:
        data = json.loads(body)
    except RecursionError:
        raise InputRefused(400, f"{what} nests lists and objects too deeply (at most {max_depth} levels)") from None
    except ValueError as e:
        raise InputRefused(400, f"{what} is not valid JSON ({str(e)[:200]})") from None
    check_shape(data, what=what, max_depth=max_depth, max_nodes=max_nodes)
    return data


def check_shape(
    data: Any, *, what: str = "the request body", max_depth: int = MAX_JSON_DEPTH, max_nodes: int = MAX_JSON_NODES
) -> None:
    """Refuse decoded data deeper than ``max_depth`` or with more than ``max_nodes`` values.

    Iterative, and stops at the limit: at most ``max_nodes`` steps.
    """
    stack = [(data, 1)]
    nodes = 1
    while stack:
        value, depth = stack.pop()
        children: Collection[Any]
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth >= max_depth and children:
            raise InputRefused(400, f"{what} nests lists and objects too deeply (at most {max_depth} levels)")
        nodes += len(children)
        if nodes > max_nodes:
            raise InputRefused(400, f"{what} holds too many values (at most {max_nodes})")
        stack.extend((c, depth + 1) for c in children)


# -- spawn options ------------------------------------------------------------------------------
def check_options(options: Any, *, what: str = "Server option") -> None:
    """Bound spawn options (a form post or REST ``user_options``) before anything reads them.

    Which keys are allowed and what they mean is ``policy.access``'s business; this only
    keeps what can reach messages, logs and the audit trail small.
    """
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise InputRefused(400, "Server options must be an object of 'profile' (and 'team').")
    if len(options) > MAX_OPTIONS:
        raise InputRefused(400, f"Too many server options ({len(options)}); servers are chosen by 'profile' (and 'team').")
    for key, value in options.items():
        if not isinstance(key, str) or len(key) > MAX_OPTION_KEY_CHARS:
            raise InputRefused(400, f"{what} names may have at most {MAX_OPTION_KEY_CHARS} characters.")
        if isinstance(value, str):
            if len(value) > MAX_OPTION_CHARS:
                raise InputRefused(400, f"{what} {key!r} may have at most {MAX_OPTION_CHARS} characters (got {len(value)}).")
        elif value is not None and not isinstance(value, (bool, int, float)):
            raise InputRefused(400, f"{what} {key!r} must be a string.")


def preview(options: Any, limit: int = 8) -> Any:
    """A small copy of (possibly refused) options for logs and the audit trail."""
    if not isinstance(options, Mapping):
        return str(type(options).__name__)
    out = {}
    for i, (key, value) in enumerate(options.items()):
        if i >= limit:
            out["…"] = f"{len(options) - limit} more"
            break
        if isinstance(value, str):
            value = value[:MAX_OPTION_CHARS]
        elif not (value is None or isinstance(value, (bool, int, float))):
            value = f"({type(value).__name__})"
        out[str(key)[:MAX_OPTION_KEY_CHARS]] = value
    return out


# -- environment names ----------------------------------------------------------------------------
# glibc's sysdeps/generic/unsecvars.h (UNSECURE_ENVVARS: what ld.so removes for setuid
# programs because libc or the loader acts on it), less TMPDIR (below); and every LD_*
# (the loader reads LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT, LD_BIND_NOW, ... in every
# process, root included), and MALLOC_* (aliases of glibc tunables, parsed by the loader
# like GLIBC_TUNABLES).
#
# TMPDIR is allowed: it only names where a program that asks for a temporary file puts
# it, a job needs to point it at scratch space, and a job's env reaches only the job's own
# process (applied at its final execve, after the switch to the user).
UNSECURE_ENVVARS = frozenset(
    {
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_TRACE",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TZDIR",
    }
)
_LOADER_PREFIXES = re.compile(r"^(LD_|MALLOC_)")


JOB_ENV_INSTEAD = "set it in the command itself (e.g. env NAME=value python train.py)"
PROFILE_ENV_INSTEAD = "set it in the image (Kubernetes) or the hub machine's environment"


def unsafe_env_reason(name: str, instead: str = JOB_ENV_INSTEAD) -> str | None:
    """Why ``name`` may not be set from a job file or a profile, or None if it may."""
    if _LOADER_PREFIXES.match(name):
        return f"{name!r} is read by the dynamic loader or libc before a program starts and cannot be set here; {instead}"
    if name in UNSECURE_ENVVARS:
        return (
            f"{name!r} makes libc read files from where it points (glibc ignores it in privileged programs "
            f"for that reason) and cannot be set here; {instead}"
        )
    return None


# -- the hub's HTTP server ----------------------------------------------------------------------
# Bodies up to this size are read and thrown away before the 413 is sent: answered before
# its body is read, a request's connection is closed on unread bytes, which the kernel
# turns into a reset and the proxy into a 503. Larger ones are cut by tornado (a bare 400).
DRAIN_CEILING_BYTES = 64 * 2**20


@functools.cache
def _server_classes() -> tuple[type, type]:
    """``(_BodyLimit, LimitedHTTPServer)``, defined on first use: tornado takes ~0.2 s to
    import, which what only reads a policy (`gpuhub validate`, the profile env check) skips."""
    from tornado import httputil
    from tornado.httpserver import HTTPServer

    class _BodyLimit(httputil.HTTPMessageDelegate):
        """Passes a request on unless its body is over the limit; then drains the body and says 413."""

        def __init__(self, inner: httputil.HTTPMessageDelegate, connection: httputil.HTTPConnection, limit: int):
            self.inner, self.connection, self.limit = inner, connection, limit
            self.received = 0
            self.refused = False
            self.started = False

        def headers_received(self, start_line, headers):
            length = headers.get("Content-Length", "")
            if length.strip().isdigit() and int(length) > self.limit:
                self.refused = True  # the application never sees this request
                return None
            self.started = True
            return self.inner.headers_received(start_line, headers)

        def data_received(self, chunk):
            if self.refused:
                return None
            self.received += len(chunk)
            if self.received > self.limit:  # a chunked body: stop passing it on
                self.refused = True
                self.inner.on_connection_close()  # the application never gets the rest, nor finish()
                return None
            return self.inner.data_received(chunk)

        def finish(self):
            if not self.refused:
                return self.inner.finish()
            body = json.dumps({"status": 413, "message": f"Request body too large: this hub accepts at most {self.limit} bytes."})
            self.connection.write_headers(
                httputil.ResponseStartLine("HTTP/1.1", 413, "Payload Too Large"),
                httputil.HTTPHeaders({"Content-Type": "application/json", "Content-Length": str(len(body))}),
                body.encode(),
            )
            self.connection.finish()
            return None

        def on_connection_close(self):
            if self.started and not self.refused:
                self.inner.on_connection_close()

    class LimitedHTTPServer(HTTPServer):
        """tornado's server, with every request's body bounded by ``body_limit`` (413 over it)."""

        def initialize(self, *args, body_limit: int = MAX_REQUEST_BODY_BYTES, **kwargs):
            self.body_limit = body_limit
            super().initialize(*args, **kwargs)

        def start_request(self, server_conn, request_conn):
            return _BodyLimit(super().start_request(server_conn, request_conn), request_conn, self.body_limit)

    return (_BodyLimit, LimitedHTTPServer)


def __getattr__(name: str):
    if name in ("_BodyLimit", "LimitedHTTPServer"):
        return dict(zip(("_BodyLimit", "LimitedHTTPServer"), _server_classes()))[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def freeze_heap() -> None:
    """Leave the objects the hub started with out of every later garbage collection.

    A request body's lists and objects are garbage-collected allocations; enough of them
    (85,000 empty lists fit in 250 KB) set off a full collection, which walks the whole
    heap of a started hub (~335,000 objects): 0.8-1.1 s on the event loop here, against
    ~0.1 s once that heap is frozen. Call once, after the hub has started
    (``wiring.startup.when_started``). The cost: cyclic garbage among those first objects
    is never collected (they live as long as the hub anyway).
    """
    import gc

    gc.collect()
    gc.freeze()


def limit_request_bodies(max_bytes: int = MAX_REQUEST_BODY_BYTES, drain: int = DRAIN_CEILING_BYTES) -> None:
    """Make every tornado ``HTTPServer`` created afterwards in this process answer a request
    whose body is over ``max_bytes`` with a 413 and a JSON message, without passing the
    request (or any of its body) to the application; bodies over ``drain`` are cut.

    Call it from the hub's configuration: JupyterHub creates its server at start with no
    body limit (tornado's default is 100 MB), and its handlers decode JSON bodies on the
    event loop with no bound of their own.
    """
    from tornado.httpserver import HTTPServer

    HTTPServer.configure(_server_classes()[1], max_body_size=max(drain, max_bytes), body_limit=max_bytes)
