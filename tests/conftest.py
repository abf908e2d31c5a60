import sys
from pathlib import Path
import pytest

# tests.support is importable as `support` from every test directory.
sys.path.insert(0, str(Path(__file__).resolve().parent))


# Browsers resolve every *.localhost name to loopback (RFC 6761); glibc does not. The demo
# gives each user's server its own origin on <user>.localhost, so the test process resolves
# those names the way a browser would.
import socket as _socket

_real_getaddrinfo = _socket.getaddrinfo


def _getaddrinfo(host, *args, **kwargs):
    if isinstance(host, str) and host.endswith(".localhost"):
        host = "127.0.0.1"
    return _real_getaddrinfo(host, *args, **kwargs)


_socket.getaddrinfo = _getaddrinfo


# Python's cookie jar treats a dotless host ("localhost") as "localhost.local" (RFC 2965) and
# then neither matches nor returns the hub's session cookie for Domain=localhost, which all
# <user>.localhost origins share. Browsers follow RFC 6265 here; so do the tests.
import http.cookiejar as _cookiejar  # noqa: E402 (after the comment that says why)


def _is_localhost(name: str) -> bool:
    name = name.lstrip(".").split(":")[0]
    return name == "localhost" or name.endswith(".localhost")


def _domain_match_6265(cookie_domain: str, host: str) -> bool:
    d = cookie_domain.lstrip(".")
    return host == d or host.endswith("." + d)


_policy = _cookiejar.DefaultCookiePolicy
_orig = {n: getattr(_policy, n) for n in ("set_ok_domain", "return_ok_domain", "domain_return_ok")}


def _set_ok_domain(self, cookie, request):
    host = _cookiejar.request_host(request)
    if _is_localhost(host) and cookie.domain_specified:
        return _domain_match_6265(cookie.domain, host)
    return _orig["set_ok_domain"](self, cookie, request)


def _return_ok_domain(self, cookie, request):
    host = _cookiejar.request_host(request)
    if _is_localhost(host):
        if cookie.domain_specified:
            return _domain_match_6265(cookie.domain, host)
        return cookie.domain in (host, host + ".local")  # host-only: stored under the RFC 2965 name
    return _orig["return_ok_domain"](self, cookie, request)


def _domain_return_ok(self, domain, request):
    host = _cookiejar.request_host(request)
    if _is_localhost(host):
        return _domain_match_6265(domain, host) or domain == host + ".local"
    return _orig["domain_return_ok"](self, domain, request)


_policy.set_ok_domain = _set_ok_domain
_policy.return_ok_domain = _return_ok_domain
_policy.domain_return_ok = _domain_return_ok


# Parallel runs (./run-tests.sh: pytest-xdist, whole files per worker) finish when the last
# file does, so the longest files are handed out first. Wall seconds per file of a whole run on
# a fresh clone (run 33 of 2026-12-05, 4 workers on 2 cores, `GPUHUB_TEST_TIMES`); files under
# 20 s follow in their usual order. A file missing here runs late: two that were (110 s and
# 90 s) left one core idle for the run's last two minutes. Refresh from a whole run's
# GPUHUB_TEST_TIMES file when a file's time changes much.
SLOW_FIRST = {
    "integration/test_culling.py": 253,
    "integration/test_researcher_walk.py": 240,
    "integration/test_loadtest.py": 217,
    "integration/test_ray_cluster.py": 178,
    "integration/test_crowd.py": 156,
    "integration/test_mig_hub.py": 137,
    "integration/test_browser_lab_stops.py": 127,
    "integration/test_browser_walk.py": 124,
    "integration/test_mig_gpm_culling.py": 119,
    "notebook_side/test_notebook_cull_browser.py": 110,
    "integration/test_reclaim.py": 105,
    "integration/test_usage.py": 93,
    "integration/test_ray_jobs.py": 92,
    "mlflow/test_existing_mlflow.py": 90,
    "integration/test_browser_queue.py": 83,
    "integration/test_attack_network.py": 80,
    "integration/test_attack_secrets.py": 75,
    "integration/test_jobs.py": 73,
    "kube/test_reclaim_hub_e2e.py": 71,
    "integration/test_isolation.py": 66,
    "integration/test_hub_restart_keeps_proxy.py": 65,
    "integration/test_restart_and_timeout.py": 63,
    "images/test_image_env.py": 59,
    "kube/test_gpu_health_kube_e2e.py": 58,
    "integration/test_runbooks.py": 56,
    "mlflow/test_mlflow_proxy_attacks.py": 54,
    "integration/test_browser_run_as_job.py": 51,
    "kube/test_hub_e2e.py": 49,
    "integration/test_researcher_server.py": 49,
    "integration/test_team_environment.py": 47,
    "integration/test_runbooks_mlflow.py": 45,
    "integration/test_offboarding.py": 43,
    "integration/test_gpu_health_ui.py": 43,
    "kube/test_fair_share_kueue.py": 41,
    "mlflow/test_central_mlflow.py": 41,
    "integration/test_local_hub.py": 39,
    "integration/test_gpu_health_hub.py": 39,
    "kube/test_stop_race.py": 39,
    "mlflow/test_mlflow_viewer.py": 35,
    "mlflow/test_mlflow_ui_browser.py": 34,
    "kube/test_job_hub_e2e.py": 34,
    "mlflow/test_mlflow_browser.py": 32,
    "integration/test_runbooks_gpu.py": 31,
    "integration/test_trust_boundaries.py": 30,
    "integration/test_roles_reload.py": 29,
    "integration/test_attack_limits.py": 29,
    "kube/test_user_queues_hub_e2e.py": 29,
    "integration/test_notebook_jobs.py": 29,
    "kube/test_lifecycle.py": 27,
    "integration/test_attack_hosts.py": 24,
    "kube/test_kueue_real_vs_double.py": 23,
    "integration/test_runbooks_restore.py": 23,
    "mlflow/test_mlflow_offboarding.py": 21,
    "integration/test_attack_input.py": 21,
    "integration/test_policy_changes.py": 20,
}


# The order check every run performs (tests/support/order.py): within each file of these folders
# the tests run in an order shuffled by a seed (the git tree of tests/ unless GPUHUB_TEST_ORDER
# says a seed, `file` or `reversed`), so a test that needs an earlier test's state fails in the
# ordinary run. The header and the end of the run say the seed and how to repeat it.
SHUFFLED_FOLDERS = ("integration", "unit", "kube", "mlflow", "images", "notebook_side")
# Files left in their written order, each with why (printed with the seed). Only for a known
# failure of the product that an order shows, until its fix lands: then the file goes.
KEEP_FILE_ORDER = {}


@pytest.fixture(scope="module")
def browser():
    """One Chromium for a module's browser tests (tests/support/browser.py); skipped without it."""
    from support.browser import chromium

    with chromium() as b:
        yield b


def pytest_configure(config):
    from support.order import OrderCheck

    plugin = OrderCheck(Path(__file__).resolve().parent, SHUFFLED_FOLDERS, keep=KEEP_FILE_ORDER)
    config.pluginmanager.register(plugin, "gpuhub-test-order")


def pytest_addoption(parser):
    from support.layers import LAYER_TESTS

    parser.addoption(
        "--layer", choices=sorted(LAYER_TESTS), help="run one layer's tests only (tests/support/layers.py; each under a minute)"
    )


def pytest_ignore_collect(collection_path, config):
    layer = config.getoption("--layer", None)
    if not layer or collection_path.is_dir() or collection_path.suffix != ".py":
        return None
    from support.layers import LAYER_TESTS

    try:
        rel = collection_path.resolve().relative_to(Path(__file__).resolve().parent).as_posix()
    except ValueError:
        return None
    return True if rel not in LAYER_TESTS[layer] else None


def pytest_collection_modifyitems(session, config, items):
    tests = Path(__file__).resolve().parent

    def weight(item) -> int:
        try:
            rel = Path(str(item.fspath)).resolve().relative_to(tests).as_posix()
        except ValueError:
            return 0
        return SLOW_FIRST.get(rel, 0)

    items.sort(key=lambda item: -weight(item))  # stable: the order within a file is kept


# What each file cost, printed after every run (and written as JSON to $GPUHUB_TEST_TIMES):
# the figures SLOW_FIRST above should follow, and where the suite's time goes. Under xdist
# the workers' reports reach the controller, which sums them; setup and teardown count,
# since a module's hub start is most of many files' time.
_file_seconds: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a real hub gets the hub's last log lines in its report: CI
    prints only the test's output, and a server that died or a spawn that failed says why
    there and nowhere else."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and hasattr(item, "_gpuhub_cpu_start"):
        # Each test's CPU seconds (its module fixtures' counted where they end), handed to
        # the controller in the teardown report: on 2 cores the suite is bound by CPU, not by
        # waiting, so CPU says which file to make lighter (issue 45).
        report.user_properties.append(("gpuhub_cpu", _cpu_seconds() - item._gpuhub_cpu_start))
    if not report.failed:
        return
    from support.hub import Hub

    seen = set()
    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, Hub) and id(value) not in seen:
            seen.add(id(value))
            report.sections.append((f"hub log of fixture {name!r}, last 80 lines ({value.log})", value.tail(80)))


_file_cpu: dict[str, float] = {}


def _cpu_seconds() -> float:
    """CPU time of this process and of every descendant it (or a descendant) has reaped: a
    hub, its proxy, the servers and Ray clusters the hub reaped, Chromium after its close."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Where each test's CPU count starts (see the report hook below)."""
    item._gpuhub_cpu_start = _cpu_seconds()


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    cpu = dict(report.user_properties).get("gpuhub_cpu")
    if cpu is not None:
        _file_cpu[path] = _file_cpu.get(path, 0.0) + cpu


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or not _file_seconds:
        return
    import json
    import os

    ranked = sorted(_file_seconds.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("-", f"slowest test files of {len(ranked)} (seconds, setup + tests + teardown)")
    for path, seconds in ranked[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_file_seconds.values()):8.1f}  all files together (workers' time)")
    costly = sorted(_file_cpu.items(), key=lambda kv: -kv[1])
    if costly:
        terminalreporter.write_sep(
            "-", "costliest test files (CPU seconds of the test process and what it reaped: hubs, servers, browsers)"
        )
        for path, cpu in costly[:20]:
            terminalreporter.write_line(f"{cpu:8.1f}  {path}")
        terminalreporter.write_line(f"{sum(_file_cpu.values()):8.1f}  all files together")
    if os.environ.get("GPUHUB_TEST_TIMES"):
        times = {path: {"seconds": seconds, "cpu": _file_cpu.get(path)} for path, seconds in ranked}
        Path(os.environ["GPUHUB_TEST_TIMES"]).write_text(json.dumps(times, indent=1) + "\n")
