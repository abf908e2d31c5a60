"""The order check of tests/support/order.py, run by a real pytest on a small generated test tree:
a seed shuffles the tests within each file, keeps each class's tests together and every file
whole, gives the same order every time and under xdist, and ``file`` / ``reversed`` do what they say.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(TESTS)!r})
from support.order import OrderCheck

def pytest_configure(config):
    import os
    keep = {{"integration/test_b.py": "a reason"}} if os.environ.get("KEEP_B") else {{}}
    config.pluginmanager.register(OrderCheck(Path(__file__).resolve().parent, ("integration",), keep=keep), "order")
"""


# Every test, class fixture and module fixture notes itself in $ORDER_LOG as it runs.
def noting_module(name: str) -> str:
    """A generated test file's head: ``note()`` writes to $ORDER_LOG, and its module fixture notes its setup."""
    return f"""
import os
import pytest

def note(what):
    with open(os.environ["ORDER_LOG"], "a") as f:
        f.write(what + "\\n")

@pytest.fixture(scope="module", autouse=True)
def shared():
    note("module-setup {name}")
"""


FILE_A = (
    noting_module("a")
    + """

def test_f1(): note("a::test_f1")
def test_f2(): note("a::test_f2")
def test_f3(): note("a::test_f3")

class TestK:
    @pytest.fixture(scope="class", autouse=True)
    def k(self):
        note("class-setup K")

    def test_k1(self): note("a::TestK::test_k1")
    def test_k2(self): note("a::TestK::test_k2")
    def test_k3(self): note("a::TestK::test_k3")

    class TestInner:
        @pytest.fixture(scope="class", autouse=True)
        def inner(self):
            note("class-setup Inner")

        def test_i1(self): note("a::TestK::TestInner::test_i1")
        def test_i2(self): note("a::TestK::TestInner::test_i2")

def test_f4(): note("a::test_f4")

@pytest.mark.parametrize("n", [1, 2, 3])
def test_p(n): note(f"a::test_p[{n}]")

class TestL:
    @pytest.fixture(scope="class", autouse=True)
    def l(self):
        note("class-setup L")

    def test_l1(self): note("a::TestL::test_l1")
    def test_l2(self): note("a::TestL::test_l2")
"""
)

FILE_B = noting_module("b") + "\n" + "".join(f"def test_b{i}(): note('b::test_b{i}')\n" for i in range(1, 7))

FILE_OTHER = "".join(f"def test_o{i}(): pass\n" for i in range(1, 6))

FILE_ORDER_A = [
    "test_f1",
    "test_f2",
    "test_f3",
    "TestK::test_k1",
    "TestK::test_k2",
    "TestK::test_k3",
    "TestK::TestInner::test_i1",
    "TestK::TestInner::test_i2",
    "test_f4",
    "test_p[1]",
    "test_p[2]",
    "test_p[3]",
    "TestL::test_l1",
    "TestL::test_l2",
]
FILE_ORDER_B = [f"test_b{i}" for i in range(1, 7)]
FILE_ORDER_OTHER = [f"test_o{i}" for i in range(1, 6)]


def tree(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "integration").mkdir()
    (tmp_path / "integration" / "test_a.py").write_text(FILE_A)
    (tmp_path / "integration" / "test_b.py").write_text(FILE_B)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "test_c.py").write_text(FILE_OTHER)
    return tmp_path


def pytest_run(root: Path, order: str | None, *args: str, **more_env: str) -> subprocess.CompletedProcess:
    # (the outer run's PYTEST_ADDOPTS, such as -v, would change the inner runs' output)
    env = {k: v for k, v in os.environ.items() if k not in ("GPUHUB_TEST_ORDER", "PYTEST_ADDOPTS")} | more_env
    if order is not None:
        env["GPUHUB_TEST_ORDER"] = order
    env["ORDER_LOG"] = str(root / "log.txt")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(root), "-c", str(root / "pytest.ini"), *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def collected(root: Path, order: str | None, *paths: str) -> list[str]:
    r = pytest_run(root, order, "--collect-only", "-q", *(paths or ("integration", "other")))
    assert r.returncode == 0, r.stdout + r.stderr
    return [line for line in r.stdout.splitlines() if "::" in line]


def of_file(ids: list[str], name: str) -> list[str]:
    return [i.split("::", 1)[1] for i in ids if i.startswith(name + "::")]


def files_in_runs(ids: list[str]) -> list[str]:
    runs = []
    for i in ids:
        f = i.split("::", 1)[0]
        if not runs or runs[-1] != f:
            runs.append(f)
    return runs


def together(order: list[str], prefix: str) -> bool:
    at = [n for n, t in enumerate(order) if t.startswith(prefix)]
    return at == list(range(at[0], at[0] + len(at)))


def test_a_seed_shuffles_within_each_file_keeps_classes_together_and_files_whole(tmp_path):
    root = tree(tmp_path)
    one = collected(root, "seed-one")
    assert files_in_runs(one) == ["integration/test_a.py", "integration/test_b.py", "other/test_c.py"]
    a, b = of_file(one, "integration/test_a.py"), of_file(one, "integration/test_b.py")
    assert sorted(a) == sorted(FILE_ORDER_A) and a != FILE_ORDER_A
    assert sorted(b) == sorted(FILE_ORDER_B) and b != FILE_ORDER_B
    assert of_file(one, "other/test_c.py") == FILE_ORDER_OTHER  # out of scope: as written
    for cls in ("TestK::", "TestK::TestInner::", "TestL::"):
        assert together(a, cls), (cls, a)

    assert collected(root, "seed-one") == one  # the same seed, the same order
    two = collected(root, "seed-two")
    assert of_file(two, "integration/test_a.py") != a or of_file(two, "integration/test_b.py") != b
    # a file alone, or part of one, keeps its tests' order
    assert of_file(collected(root, "seed-one", "integration/test_a.py"), "integration/test_a.py") == a
    part = collected(root, "seed-one", "integration/test_a.py", "-k", "test_f or test_l")
    assert of_file(part, "integration/test_a.py") == [t for t in a if "test_f" in t or "test_l" in t]


def test_file_keeps_the_written_order_and_reversed_runs_each_file_and_class_backwards(tmp_path):
    root = tree(tmp_path)
    ids = collected(root, "file")
    assert of_file(ids, "integration/test_a.py") == FILE_ORDER_A
    assert of_file(ids, "integration/test_b.py") == FILE_ORDER_B

    back = collected(root, "reversed")
    assert files_in_runs(back) == ["integration/test_a.py", "integration/test_b.py", "other/test_c.py"]
    assert of_file(back, "integration/test_b.py") == FILE_ORDER_B[::-1]
    assert of_file(back, "integration/test_a.py") == [
        "TestL::test_l2",
        "TestL::test_l1",
        "test_p[3]",
        "test_p[2]",
        "test_p[1]",
        "test_f4",
        "TestK::TestInner::test_i2",
        "TestK::TestInner::test_i1",
        "TestK::test_k3",
        "TestK::test_k2",
        "TestK::test_k1",
        "test_f3",
        "test_f2",
        "test_f1",
    ]
    assert of_file(back, "other/test_c.py") == FILE_ORDER_OTHER


def test_a_shuffled_run_sets_each_class_and_module_up_once_and_says_how_to_repeat_it(tmp_path):
    root = tree(tmp_path)
    r = pytest_run(root, "seed-one", "-v", "integration")
    assert r.returncode == 0, r.stdout + r.stderr
    log = (root / "log.txt").read_text().splitlines()
    setups = sorted(line for line in log if "setup" in line)
    assert setups == ["class-setup Inner", "class-setup K", "class-setup L", "module-setup a", "module-setup b"]
    ran = [line for line in log if "setup" not in line]
    assert ran == [i.replace("integration/test_", "").replace(".py", "") for i in collected(root, "seed-one", "integration")]
    header = r.stdout.split("collected", 1)[0]
    assert "seed seed-one" in header and "GPUHUB_TEST_ORDER=seed-one" in header
    tail = r.stdout.rsplit("test order", 1)[1]
    assert "GPUHUB_TEST_ORDER=seed-one" in tail


def test_a_file_kept_as_written_is_not_shuffled_and_the_header_says_why(tmp_path):
    root = tree(tmp_path)
    r = pytest_run(root, "seed-one", "--collect-only", "-q", "integration", KEEP_B="1")
    ids = [line for line in r.stdout.splitlines() if "::" in line]
    assert of_file(ids, "integration/test_b.py") == FILE_ORDER_B
    assert of_file(ids, "integration/test_a.py") == of_file(collected(root, "seed-one"), "integration/test_a.py")
    r = pytest_run(root, "seed-one", "--collect-only", "integration", KEEP_B="1")
    assert f"kept as written: {root.name}/integration/test_b.py (a reason)" in r.stdout, r.stdout


def test_the_default_seed_is_stable_and_every_xdist_worker_collects_the_same_order(tmp_path):
    root = tree(tmp_path)
    first = pytest_run(root, None, "--collect-only", "integration")
    seed = first.stdout.split(", seed ", 1)[1].split()[0]
    assert len(seed) == 8  # from the test files (no git in this tree)
    assert collected(root, None) == collected(root, seed)
    (root / "log.txt").unlink(missing_ok=True)
    # xdist fails a run whose workers collected different orders; whole files per worker
    r = pytest_run(root, None, "-n", "2", "--dist", "loadfile", "integration")
    assert r.returncode == 0 and "20 passed" in r.stdout, r.stdout + r.stderr
    assert f"seed {seed}" in r.stdout


def test_the_suite_takes_its_seed_from_the_git_tree_of_tests():
    """tests/conftest.py: the ordinary run's seed is `git rev-parse HEAD:tests`, and its
    `reversed` is this very file backwards."""
    tree_id = subprocess.run(["git", "rev-parse", "HEAD:./"], cwd=TESTS, capture_output=True, text=True)
    if tree_id.returncode != 0:
        pytest.skip("not a git checkout (the generated tree's test covers the content-hash seed)")
    env = {k: v for k, v in os.environ.items() if k not in ("GPUHUB_TEST_ORDER", "PYTEST_ADDOPTS")}
    run = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", str(Path(__file__))]
    out = subprocess.run(run, cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300).stdout
    assert f"seed {tree_id.stdout.strip()[:8]} (the git tree of tests/ at HEAD)" in out, out

    def ids(order):
        r = subprocess.run(
            run[:-1] + ["-q", run[-1]],
            cwd=TESTS.parent,
            env=dict(env, GPUHUB_TEST_ORDER=order),
            capture_output=True,
            text=True,
            timeout=300,
        )
        return [line for line in r.stdout.splitlines() if "::" in line]

    written = ids("file")
    assert written[0].endswith("::test_a_seed_shuffles_within_each_file_keeps_classes_together_and_files_whole")
    assert ids("reversed") == written[::-1]
