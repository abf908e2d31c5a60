"""What users send is read with bounded work: job files, spawn options, JSON bodies, env names.

The attack tests go through the product's entry points (``parse_job``, the spawner's
option parsing, ``parse_policy``); the last ones check ``policy.bounded`` itself. Timings
are printed, never asserted (the event-loop bound is asserted against a real hub in
tests/integration/test_attack_input.py).
"""

import json
import time
from types import SimpleNamespace

import pytest
from tornado import web

from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.policy import PolicyError, parse_policy
from gpuhub_spawner.policy_spawner import PolicySpawnerMixin


def alias_tree(levels: int = 7, width: int = 10) -> str:
    """The reported file: each level a list of ``width`` aliases of the previous anchor
    (width**levels nodes to any walk that follows aliases; 424 bytes at 7 x 10)."""
    lines = ["profile: cpu", "command: [python, train.py]", "x:", "  - &a0 [x]"]
    for i in range(1, levels + 1):
        lines.append(f"  - &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def issues(text: str) -> list[str]:
    t0 = time.perf_counter()
    with pytest.raises(PolicyError) as e:
        parse_job(text, "job.yaml")
    print(f"refused in {(time.perf_counter() - t0) * 1000:.1f} ms: {len(text)} bytes")
    return [i.format("job.yaml") for i in e.value.issues]


# -- job files ---------------------------------------------------------------------------------
def test_the_reported_alias_tree_is_refused_at_its_first_anchor_with_line_and_column():
    text = alias_tree()
    assert len(text) <= 424
    assert issues(text) == ["job.yaml:4:5: x[0]: YAML anchors and aliases are not accepted in job files"]


def test_an_alias_anywhere_is_refused_where_it_is():
    # An anchor in a key's value, an alias in a list, a merge key: all refused, located.
    assert issues("profile: cpu\ncommand: &c [x]\n") == [
        "job.yaml:2:10: command: YAML anchors and aliases are not accepted in job files"
    ]
    assert issues("profile: cpu\ncommand: [x]\nenv:\n  A: '1'\n  B: *nowhere\n")[0].startswith(
        "job.yaml:5:6: env.B: YAML anchors and aliases are not accepted"
    )


def test_size_values_and_depth_are_bounded_before_composing():
    big = "profile: cpu\ncommand: [x]\nname: '" + "n" * 70_000 + "'\n"
    assert issues(big) == [f"job.yaml: (top level): job files may have at most 65536 bytes (this one has {len(big)})"]
    many = "profile: cpu\ncommand: [" + "a," * 5000 + "]\n"  # a valid job file, were it not for its size
    assert issues(many) == ["job.yaml:2:2001: command[995]: job files may hold at most 1000 values (keys, list items and values)"]
    deep = "profile: cpu\ncommand: [x]\nretries: " + "[" * 40 + "]" * 40 + "\n"
    assert issues(deep) == [
        "job.yaml:3:25: retries[0][0][0][0][0][0][0][0][0][0][0][0][0][0][0]: "
        "job files may nest lists and mappings at most 16 levels deep"
    ]


def test_numbers_that_cost_more_than_they_say_are_refused():
    # A 5,000-digit integer raised a bare ValueError (an HTTP 500) and a base-60 integer
    # of 30,000 parts took ~0.2 s to build; both are refused at their position.
    assert issues("profile: cpu\ncommand: [x]\nretries: " + "1" * 5000 + "\n") == [
        "job.yaml:3:10: retries: a number may have at most 100 characters (quote it to make it text)"
    ]
    assert issues("profile: cpu\ncommand: [1" + ":0" * 30000 + "]\n") == [
        "job.yaml:2:11: command[0]: a number may have at most 100 characters (quote it to make it text)"
    ]


def test_text_that_is_not_utf8_is_refused():
    # JSON's "\ud800" decodes to a lone surrogate; libyaml's encoder raised (an HTTP 500).
    assert issues('profile: cpu\ncommand: ["\ud800"]\n') == [
        "job.yaml: (top level): job files must be UTF-8 text (character 25 is not)"
    ]


def test_a_long_duration_string_is_refused_before_it_is_matched():
    # parse_duration's regex backtracks quadratically on a run of digits: 4,000 took 0.9 s,
    # 64 KiB would take minutes. A duration is a few characters.
    out = issues("profile: cpu\ncommand: [x]\ntimeLimit: '" + "1" * 8_000 + "'\n")
    assert out == [
        "job.yaml:3:12: timeLimit: '11111111111111111111'... is not a duration "
        "(at most 32 characters; examples: 90s, 15m, 1h30m, 2d)"
    ]
    assert parse_job("profile: cpu\ncommand: [x]\ntimeLimit: 1h30m\n").time_limit == 5400


def test_only_core_yaml_tags():
    assert issues("profile: cpu\ncommand: [x]\nname: !!binary aGVsbG8=\n") == [
        "job.yaml:3:7: name: the YAML tag '!!binary' is not accepted in job files (plain values, lists and mappings only)"
    ]
    assert parse_job("profile: cpu\ncommand: [x, !!str 75]\n").argv == ["x", "75"]


def test_thousands_of_mistakes_are_reported_by_the_first_fifty():
    text = "profile: cpu\ncommand: [x]\n" + "".join(f"k{i}: v\n" for i in range(400))
    out = issues(text)
    assert len(out) == 50 and out[0] == "job.yaml:3:1: k0: unknown key 'k0'"


def test_the_worst_job_files_within_the_limits_cost_milliseconds():
    worst = {
        "495 env entries (990 values)": "profile: cpu\ncommand: [x]\nenv:\n" + "".join(f"  K{i}: v\n" for i in range(495)),
        "495 unknown keys (990 values)": "profile: cpu\ncommand: [x]\n" + "".join(f"k{i}: v\n" for i in range(495)),
        "990 empty mappings": "profile: cpu\ncommand: [x]\nretries: [" + "{}," * 990 + "]\n",
        "64 KiB scalar": "profile: cpu\ncommand: [x]\nname: '" + "n" * 65_000 + "'\n",
    }
    for what, text in worst.items():
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            try:
                parse_job(text)
            except PolicyError:
                pass
            best.append(time.perf_counter() - t0)
        print(f"{what}: {min(best) * 1000:.1f} ms (max of 3: {max(best) * 1000:.1f} ms)")


# -- env names the loader or libc honour -----------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "LD_BIND_NOW",
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "MALLOC_TRACE",
        "MALLOC_ARENA_MAX",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
        "TZDIR",
    ],
)
def test_loader_and_libc_names_are_refused_in_job_env_at_their_key(name):
    out = issues(f"profile: cpu\ncommand: [x]\nenv:\n  OK: '1'\n  {name}: /home/me/evil\n")
    assert len(out) == 1 and out[0].startswith(f"job.yaml:5:3: env.{name}: {name!r} ")
    assert "cannot be set here; set it in the command itself" in out[0]


def test_tmpdir_and_ordinary_names_stay_allowed():
    spec = parse_job("profile: cpu\ncommand: [x]\nenv: {TMPDIR: /scratch/me, WANDB_MODE: disabled, LANG: C.UTF-8}\n")
    assert spec.env == {"TMPDIR": "/scratch/me", "WANDB_MODE": "disabled", "LANG": "C.UTF-8"}


def test_a_profiles_env_refuses_the_same_names_located():
    policy = (
        "teams:\n  - {name: a, groups: [g]}\nprofiles:\n  - slug: cpu\n    displayName: C\n    teams: '*'\n"
        "    env:\n      OMP_NUM_THREADS: '4'\n      LD_PRELOAD: /opt/x.so\n"
    )
    with pytest.raises(PolicyError) as e:
        parse_policy(policy, "p.yaml")
    assert str(e.value).startswith("p.yaml:8:7: profiles[0].env: 'LD_PRELOAD' is read by the dynamic loader")
    assert "set it in the image" in str(e.value)


# -- spawn options ---------------------------------------------------------------------------------
POLICY = "teams:\n  - {name: red, groups: [red]}\nprofiles:\n  - {slug: small, displayName: Small, teams: '*'}\n"


class Spawner(PolicySpawnerMixin):
    def __init__(self, options):
        self.user = SimpleNamespace(name="mallory", groups=[SimpleNamespace(name="red")], spawners={})
        self.name = ""
        self.user_options = options
        self.log = SimpleNamespace(warning=lambda *a: None)
        self._policy = parse_policy(POLICY)

    @property
    def policy(self):
        return self._policy


@pytest.fixture
def audited(monkeypatch):
    from gpuhub_spawner.usage import recorder

    seen = []
    monkeypatch.setattr(recorder, "audit", lambda event, **fields: seen.append((event, fields)))
    return seen


def test_a_huge_rest_option_is_refused_short_and_audited_short(audited):
    with pytest.raises(web.HTTPError) as e:
        Spawner({"profile": "p" * 200_000}).resolve_request()
    assert e.value.status_code == 400 and len(e.value.log_message) < 200
    assert e.value.log_message == "Server option 'profile' may have at most 200 characters (got 200000)."
    requested = audited[-1][1]["requested"]
    assert len(repr(requested)) < 400, len(repr(requested))


def test_thousands_of_unknown_rest_options_are_refused_without_listing_them(audited):
    with pytest.raises(web.HTTPError) as e:
        Spawner({f"opt{i}": "1" for i in range(20_000)}).resolve_request()
    assert e.value.status_code == 400 and len(e.value.log_message) < 200
    assert e.value.log_message.startswith("Too many server options (20000)")
    assert len(repr(audited[-1][1]["requested"])) < 1000


def test_nested_option_values_are_refused():
    with pytest.raises(web.HTTPError) as e:
        Spawner({"profile": [[[["small"]]]]}).resolve_request()
    assert e.value.status_code == 400 and e.value.log_message == "Server option 'profile' must be a string."


def test_a_form_post_with_a_huge_value_is_refused():
    with pytest.raises(web.HTTPError) as e:
        Spawner(None).options_from_form({"profile": ["x" * 100_000]})
    assert e.value.status_code == 400 and "at most 200 characters" in e.value.log_message
    assert Spawner(None).options_from_form({"profile": ["small"], "junk": ["y" * 10]}) == {"profile": "small"}


def test_ordinary_options_still_resolve():
    assert Spawner({"profile": "small"}).resolve_request().profile.slug == "small"


# -- policy.bounded itself -------------------------------------------------------------------------
def test_json_size_then_containers_are_checked_before_decoding_then_depth_and_values():
    from gpuhub_spawner.policy.bounded import InputRefused, loads_json

    with pytest.raises(InputRefused) as e:
        loads_json(b"[" + b"[]," * 100_000 + b"[]]", max_bytes=64 * 1024)
    assert e.value.status == 413 and "at most 65536 bytes" in e.value.message
    # Lists and objects are counted in the raw bytes: none is allocated when there are too many.
    with pytest.raises(InputRefused) as e:
        loads_json(b"[" + b"[]," * 20_000 + b"[]]", max_bytes=1 << 20)
    assert e.value.status == 400 and e.value.message == "the request body holds too many lists and objects (at most 10000)"
    with pytest.raises(InputRefused) as e:
        loads_json(b"[" * 5_000, max_bytes=1 << 20, max_containers=10_000)  # the decoder's recursion guard
    assert e.value.status == 400 and "too deeply" in e.value.message
    with pytest.raises(InputRefused) as e:
        loads_json(b"[" * 20 + b"]" * 20, max_bytes=1 << 20, max_depth=16)
    assert e.value.status == 400 and "at most 16 levels" in e.value.message
    with pytest.raises(InputRefused) as e:
        loads_json(b"[" + b"0," * 20_000 + b"0]", max_bytes=1 << 20, max_nodes=10_000)
    assert e.value.status == 400 and "too many values" in e.value.message
    # Brackets inside strings count too (an upper bound): a job file's flow lists fit its limit.
    assert loads_json(b'{"spec": "command: [a, b]"}', max_bytes=100, max_containers=2) == {"spec": "command: [a, b]"}
    assert loads_json(b"", empty={}) == {} and loads_json(None) is None and loads_json(b" ", empty={}) == {}
    with pytest.raises(InputRefused):
        loads_json(b"{nope", max_bytes=100)


def test_the_hub_wide_body_limit_answers_413_and_the_application_never_sees_the_request():
    import asyncio

    from tornado import httpclient
    from tornado.httpserver import HTTPServer
    from tornado.testing import bind_unused_port

    from gpuhub_spawner.policy import bounded

    seen = []

    class Echo(web.RequestHandler):
        def post(self):
            seen.append(len(self.request.body))
            self.write("ok")

    async def main():
        bounded.limit_request_bodies(1024)
        try:
            server = HTTPServer(web.Application([("/", Echo)]))
            assert isinstance(server, bounded.LimitedHTTPServer) and server.body_limit == 1024
            assert server.conn_params.max_body_size == bounded.DRAIN_CEILING_BYTES
        finally:
            HTTPServer.configure(None)
        sock, port = bind_unused_port()
        server.add_sockets([sock])
        client = httpclient.AsyncHTTPClient(force_instance=True)
        url = f"http://127.0.0.1:{port}/"
        try:
            small = await client.fetch(url, method="POST", body=b"x" * 1000, raise_error=False)
            big = await client.fetch(url, method="POST", body=b"x" * 5000, raise_error=False)

            async def chunks(write):
                for _ in range(10):
                    await write(b"y" * 500)

            chunked = await client.fetch(url, method="POST", body_producer=chunks, raise_error=False)
            after = await client.fetch(url, method="POST", body=b"z", raise_error=False)
        finally:
            client.close()
            server.stop()
        return small, big, chunked, after

    small, big, chunked, after = asyncio.run(main())
    assert (small.code, small.body) == (200, b"ok")
    for r in (big, chunked):
        assert r.code == 413, (r.code, r.body)
        assert json.loads(r.body) == {"status": 413, "message": "Request body too large: this hub accepts at most 1024 bytes."}
    assert after.code == 200
    assert seen == [1000, 1]  # the refused ones never reached the application
    assert type(HTTPServer(lambda request: None)) is HTTPServer  # configure(None) undoes it
