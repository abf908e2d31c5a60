"""Secrets per profile/team and team data in the policy (``secrets:``, ``data:``; issue 42).

Validation explains each mistake at its place; the one-machine reader of the admin's secret
file refuses what a user could have planted (a link, a file of theirs, a writable one) and
never repeats a byte of the file in its words.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from gpuhub_spawner.policy import PolicyError, parse_policy
from gpuhub_spawner.policy.grants import GrantUnavailable, check_data_dir, local_delivery, read_secret_file

BASE = """\
teams:
  - {name: vision, groups: [vision-lab]}
  - {name: nlp, groups: [nlp-group]}
profiles:
  - {slug: cpu, displayName: CPU, teams: "*", default: true}
  - {slug: big, displayName: Big, teams: [vision, nlp]}
"""
VALUE = "s3cr3t-VALUE-never-shown"


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        parse_policy(text, "p.yaml")
    return [i.format("p.yaml") for i in e.value.issues]


def test_grants_resolve_by_team_and_profile():
    policy = parse_policy(
        BASE
        + """\
secrets:
  - {name: wandb, local: {file: /etc/gpuhub/s.yaml, key: wandb}, teams: [vision], profiles: [big]}
  - {name: hf, local: {file: /etc/gpuhub/s.yaml, key: hf}, teams: [vision], env: HF_TOKEN}
  - {name: shared, kubernetes: {secret: shared, key: k}, profiles: "*"}
data:
  - {name: imagenet, teams: [vision], local: {path: /srv/d/imagenet}}
  - {name: corpora, teams: [nlp], readOnly: false, local: {path: /srv/d/corpora}}
""",
        "p.yaml",
    )
    names = lambda items: [i.name for i in items]  # noqa: E731
    assert names(policy.secrets_for("vision", "big")) == ["wandb", "hf", "shared"]
    assert names(policy.secrets_for("vision", "cpu")) == ["hf", "shared"]
    assert names(policy.secrets_for("nlp", "big")) == ["shared"]
    assert names(policy.data_for("vision", "cpu")) == ["imagenet"]
    assert names(policy.data_for("nlp", "big")) == ["corpora"] and not policy.data_for("nlp", "big")[0].read_only


@pytest.mark.parametrize(
    "section, expected",
    [
        (
            "secrets:\n  - {name: a, local: {file: /x, key: k}, teams: [vison]}\n",
            "secrets[0].teams[0]: unknown team 'vison' (did you mean 'vision'?)",
        ),
        (
            "secrets:\n  - {name: a, local: {file: /x, key: k}, profiles: [bigg]}\n",
            "secrets[0].profiles[0]: unknown profile 'bigg'",
        ),
        ("secrets:\n  - {name: a, local: {file: relative.yaml, key: k}, teams: [vision]}\n", "secrets[0].local.file"),
        ("secrets:\n  - {name: a, local: {file: /x, key: 'a/b'}, teams: [vision]}\n", "secrets[0].local.key"),
        ("secrets:\n  - {name: a, teams: [vision]}\n", "a secret needs a source"),
        ("secrets:\n  - {name: a, local: {file: /x, key: k}}\n", "grant it to profiles, teams or both"),
        ("secrets:\n  - {name: a, local: {file: /x, key: k}, teams: [vision], env: LD_PRELOAD}\n", "secrets[0].env"),
        ("secrets:\n  - {name: a, local: {file: /x, key: k}, teams: [vision], env: JUPYTERHUB_API_TOKEN}\n", "set by gpuhub"),
        (
            "secrets:\n  - {name: a, local: {file: /x, key: k}, teams: [vision], env: T}\n"
            "  - {name: b, local: {file: /x, key: j}, profiles: [big], env: T}\n",
            "secrets[1].env",
        ),
        (
            "secrets:\n  - {name: a, local: {file: /x, key: k}, teams: [vision]}\n  - {name: a, local: {file: /x, key: j}, teams: [nlp]}\n",
            "secrets[1].name",
        ),
        ("data:\n  - {name: d, teams: [vision], local: {path: /srv/../etc}}\n", "data[0].local.path"),
        ("data:\n  - {name: d, teams: [nlpp], local: {path: /srv/d}}\n", "data[0].teams[0]: unknown team 'nlpp'"),
        ("data:\n  - {name: d, teams: [vision]}\n", "a dataset needs a source"),
        (
            "data:\n  - {name: d, teams: [vision], kernel: Vision, readOnly: false, local: {path: /srv/d}}\n",
            "a team environment (kernel) is mounted read-only",
        ),
        ('data:\n  - {name: d, teams: [vision], kernel: "a\\nb", local: {path: /srv/d}}\n', "data[0].kernel"),
    ],
)
def test_mistakes_are_located(section, expected):
    found = errors(BASE + section)
    assert any(expected in e for e in found), found


def test_two_env_secrets_for_disjoint_servers_may_share_a_name():
    parse_policy(
        BASE + "secrets:\n  - {name: a, local: {file: /x, key: k}, teams: [vision], env: T}\n"
        "  - {name: b, local: {file: /x, key: j}, teams: [nlp], env: T}\n",
        "p.yaml",
    )


@pytest.fixture
def secret_file(tmp_path):
    d = tmp_path / "etc"
    d.mkdir(mode=0o700)
    f = d / "secrets.yaml"
    f.write_text(f"wandb: {VALUE}\nnumber: 12345\n")
    f.chmod(0o600)
    return f


def test_the_value_is_read_and_a_rewrite_is_a_rotation(secret_file):
    assert read_secret_file(str(secret_file), "wandb", "secrets[0]") == VALUE
    assert read_secret_file(str(secret_file), "number", "secrets[0]") == "12345"
    secret_file.write_text("wandb: rotated\n")
    assert read_secret_file(str(secret_file), "wandb", "secrets[0]") == "rotated"


def test_refusals_are_located_and_never_show_the_value(secret_file, tmp_path):
    def refused(path, key="wandb") -> str:
        with pytest.raises(GrantUnavailable) as e:
            read_secret_file(str(path), key, "secrets[2] (wandb)")
        assert VALUE not in str(e.value)
        return str(e.value)

    assert "has no key 'wandbb'" in refused(secret_file, "wandbb") and refused(secret_file, "wandbb").startswith(
        "secrets[2] (wandb).local.key"
    )
    assert "does not exist" in refused(tmp_path / "etc" / "missing.yaml")
    link = tmp_path / "etc" / "link.yaml"
    link.symlink_to(secret_file)
    assert "symbolic link" in refused(link)
    secret_file.chmod(0o666)
    assert "writable by others" in refused(secret_file)
    secret_file.chmod(0o600)
    bad = tmp_path / "etc" / "bad.yaml"
    bad.write_text(f"- {VALUE}\n")
    bad.chmod(0o600)
    assert "not a YAML mapping" in refused(bad)
    bad.write_text(f"wandb: [{VALUE}\n")
    assert "not a YAML mapping" in refused(bad)
    (tmp_path / "etc").chmod(0o777)
    assert "its directory" in refused(secret_file)
    (tmp_path / "etc").chmod(0o700)
    (tmp_path / "via").symlink_to(tmp_path / "etc")  # a link anywhere on the way is refused too
    assert "is a symbolic link; give the real path" in refused(tmp_path / "via" / "secrets.yaml")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_file_owned_by_a_user_is_refused(secret_file):
    os.chown(secret_file, 65534, 65534)
    with pytest.raises(GrantUnavailable, match="owned by uid 65534"):
        read_secret_file(str(secret_file), "wandb", "secrets[0]")


def test_team_data_must_be_behind_a_root_only_directory(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "imagenet").mkdir()
    check_data_dir(str(private / "imagenet"), "data[0]")
    open_dir = tempfile.mkdtemp(prefix="gpuhub-test-data-", dir="/tmp")  # /, /tmp and it: every account enters
    try:
        os.chmod(open_dir, 0o755)
        os.mkdir(os.path.join(open_dir, "d"))
        with pytest.raises(GrantUnavailable, match="reachable by every account"):
            check_data_dir(os.path.join(open_dir, "d"), "data[0]")
    finally:
        shutil.rmtree(open_dir)
    with pytest.raises(GrantUnavailable, match="does not exist"):
        check_data_dir(str(private / "missing"), "data[0]")
    (private / "link").symlink_to(private / "imagenet")
    with pytest.raises(GrantUnavailable, match="symbolic link"):
        check_data_dir(str(private / "link"), "data[0]")


def test_local_delivery_splits_files_env_and_data(secret_file, tmp_path):
    private = tmp_path / "data"
    private.mkdir(mode=0o700)
    (private / "imagenet").mkdir()
    policy = parse_policy(
        BASE
        + f"""\
secrets:
  - {{name: wandb, local: {{file: {secret_file}, key: wandb}}, teams: [vision]}}
  - {{name: num, local: {{file: {secret_file}, key: number}}, teams: [vision], env: NUM}}
data:
  - {{name: imagenet, teams: [vision], local: {{path: {private / "imagenet"}}}}}
""",
        "p.yaml",
    )
    d = local_delivery(policy, "vision", "cpu")
    assert d.files == {"wandb": VALUE} and d.env == {"NUM": "12345"}
    assert d.data == [{"name": "imagenet", "source": str(private / "imagenet"), "read_only": True}]
    assert d.delivered_as == {"wandb": "file", "num": "env NUM"}
    assert not local_delivery(policy, "nlp", "cpu")


def test_validate_warns_of_a_grant_this_machine_cannot_deliver(secret_file, tmp_path):
    from gpuhub_spawner.policy.grants import grant_warnings

    text = (
        BASE
        + f"""\
secrets:
  - {{name: ok, local: {{file: {secret_file}, key: wandb}}, teams: [vision]}}
  - {{name: typo, local: {{file: {secret_file}, key: wandbb}}, teams: [vision]}}
  - {{name: cluster-only, kubernetes: {{secret: s, key: k}}, teams: [vision]}}
data:
  - {{name: nowhere, teams: [vision], local: {{path: {tmp_path / "missing"}}}}}
"""
    )
    policy_file = tmp_path / "p.yaml"
    policy_file.write_text(text)
    warnings = grant_warnings(parse_policy(text, "p.yaml"))
    assert warnings == [
        f"secrets[1] (typo).local.key: {secret_file} has no key 'wandbb' (did you mean 'wandb'?)",
        f"data[0] (nowhere).local.path {tmp_path / 'missing'} does not exist",
    ]
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "gpuhub_spawner.cli", "validate", str(policy_file)], capture_output=True, text=True)
    assert r.returncode == 0 and "warning: secrets[1] (typo).local.key" in r.stderr and VALUE not in r.stderr + r.stdout, r


def test_a_team_environment_is_a_dataset_with_a_kernel_and_validate_warns_without_its_python(tmp_path):
    from gpuhub_spawner.policy.grants import grant_warnings

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "vision-env" / "bin").mkdir(parents=True)
    text = (
        BASE
        + f"""\
data:
  - {{name: vision-env, teams: [vision], kernel: "Vision Lab (2026-12)", local: {{path: {private / "vision-env"}}}}}
"""
    )
    policy = parse_policy(text, "p.yaml")
    d = local_delivery(policy, "vision", "cpu")
    assert d.kernels == {"vision-env": "Vision Lab (2026-12)"} and d.data[0]["read_only"] is True
    assert d.sandbox_spec()["data"][0]["kernel"] == "Vision Lab (2026-12)"  # what the sandbox writes a kernelspec for
    assert not local_delivery(policy, "nlp", "cpu").kernels
    assert grant_warnings(policy) == [
        f"data[0] (vision-env).kernel: {private / 'vision-env' / 'bin' / 'python'} does not exist, so the kernel "
        "'Vision Lab (2026-12)' cannot start; build the environment there (docs/own-packages.md)"
    ]
    (private / "vision-env" / "bin" / "python").symlink_to("/usr/bin/python3")
    assert grant_warnings(policy) == []
