"""The job file is validated like the policy: every mistake with its line:column."""

import pytest

from gpuhub_spawner.jobs.spec import parse_job
from gpuhub_spawner.policy import PolicyError, parse_policy


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as e:
        parse_job(text, "job.yaml")
    return [i.format("job.yaml") for i in e.value.issues]


def test_a_complete_job_file():
    spec = parse_job(
        "profile: gpu-1\nname: mnist\ncommand: [python, train.py, --epochs, 3]\nworkingDir: proj\n"
        "env: {EPOCHS: 3, DEBUG: true}\nretries: {limit: 2, reasons: [preempted, failed, 75]}\n"
        "checkpointDir: ckpt/mnist\nexperiment: mnist\ntimeLimit: 1h30m\nimage: ghcr.io/x/y@sha256:abc\n"
    )
    assert spec.argv == ["python", "train.py", "--epochs", "3"]
    assert spec.env == {"EPOCHS": "3", "DEBUG": "true"}
    assert spec.time_limit == 5400 and spec.retries.limit == 2
    assert spec.retries.retries("failed", 1) and spec.retries.retries("preempted", None)
    assert not spec.retries.retries("oom", None)


def test_shorthands_and_defaults():
    spec = parse_job("profile: cpu\ncommand: python train.py --lr 0.1\nretries: 3\n")
    assert spec.argv == ["/bin/sh", "-c", "python train.py --lr 0.1"]
    assert spec.retries.limit == 3 and spec.retries.reasons == ["preempted", "interrupted"]
    # A non-zero exit is retried only when asked: by word or by exit code.
    assert not spec.retries.retries("failed", 3)
    assert parse_job("profile: cpu\ncommand: [x]\nretries: {limit: 1, reasons: [75]}\n").retries.retries("failed", 75)


def test_every_mistake_is_located():
    out = errors(
        "profile: gpu-1\n"
        "comand: python x\n"
        "retries: {limit: -1, reasons: [preemptd, 300]}\n"
        "timeLimit: soon\n"
        "workingDir: ../elsewhere\n"
    )
    assert out == [
        "job.yaml:1:1: command: is required (or 'notebook': a notebook to execute)",
        "job.yaml:2:1: comand: unknown key 'comand' (did you mean 'command'?)",
        "job.yaml:3:18: retries.limit: must be at least 0 (got -1)",
        "job.yaml:3:32: retries.reasons[0]: must be one of preempted, interrupted, failed, oom or an exit code 1-255 (got 'preemptd')",
        "job.yaml:3:42: retries.reasons[1]: must be one of preempted, interrupted, failed, oom or an exit code 1-255 (got 300)",
        "job.yaml:4:12: timeLimit: 'soon' is not a duration (examples: 90s, 15m, 1h30m, 2d)",
        "job.yaml:5:13: workingDir: must stay inside your home directory (no '..')",
    ]


def test_identity_and_devices_cannot_be_overridden_through_env():
    for name in ("GPUHUB_ATTEMPT", "CUDA_VISIBLE_DEVICES", "JUPYTERHUB_API_TOKEN", "MLFLOW_RUN_CONTEXT"):
        assert errors(f"profile: cpu\ncommand: [x]\nenv: {{{name}: '1'}}\n") == [
            f"job.yaml:3:6: env: {name!r} is set by gpuhub for every attempt and cannot be overridden"
        ]


def test_yaml_pitfalls_are_explained():
    assert errors("profile: cpu\ncommand: [x]\nretries: {limit: 1, on: [oom]}\n") == [
        "job.yaml:3:10: retries: YAML reads the key 'on' (or yes/no) as a boolean; list retryable reasons under 'reasons'"
    ]
    assert errors("profile: cpu\ncommand: 5\n") == [
        "job.yaml:2:10: command: must be a list of strings or one shell command string"
    ]
    assert errors("profile: cpu\ncommand: []\n")[0].endswith("command: must not be empty (give the program and its arguments)")
    assert errors("profile: cpu\nprofile: gpu\ncommand: [x]\n") == [
        "job.yaml:2:1: profile: key 'profile' appears twice; the second would silently win"
    ]
    assert errors("profile: [\n")[0].startswith("job.yaml:2:1: (top level): YAML syntax error")


def test_a_teams_job_priority_must_be_a_priority_class():
    base = "priorityClasses: [{name: batch, value: 1}]\nteams:\n  - {name: a, groups: [g], jobPriority: %s}\nprofiles:\n  - {slug: cpu, displayName: C, teams: '*'}\n"
    assert parse_policy(base % "batch").teams[0].job_priority == "batch"
    with pytest.raises(PolicyError) as e:
        parse_policy(base % "bach", "p.yaml")
    assert str(e.value) == "p.yaml:3:41: teams[0].jobPriority: unknown priority class 'bach' (did you mean 'batch'?)"


def test_several_workers_are_a_count_for_a_command_and_their_rendezvous_names_are_gpuhubs():
    assert parse_job("profile: gpu-1\nworkers: 4\ncommand: [python, train.py]\n").workers == 4
    assert parse_job("profile: gpu-1\ncommand: [python, train.py]\n").workers == 1
    assert errors("profile: gpu-1\nworkers: 0\ncommand: [x]\n") == ["job.yaml:2:10: workers: must be at least 1 (got 0)"]
    assert "job.yaml:2:10: workers: must be at most 64 (got 65)" in errors("profile: gpu-1\nworkers: 65\ncommand: [x]\n")
    assert any("a notebook runs as one worker" in e for e in errors("profile: gpu-1\nworkers: 2\nnotebook: a.ipynb\n"))
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK"):
        assert any(
            "is set by gpuhub for every attempt" in e for e in errors(f"profile: cpu\ncommand: [x]\nenv: {{{name}: '1'}}\n")
        )


def test_each_worker_gets_its_share_of_the_devices_and_the_job_asks_for_all_of_them_at_once():
    from gpuhub_spawner.local.job_manager import _times, _worker_devices

    assert _times({"cpu": 500, "memory": 2**30, "gpu/a100": 1}, 3) == {"cpu": 1500, "memory": 3 * 2**30, "gpu/a100": 3}
    assert [_worker_devices(["0", "1", "2", "3"], 2, r) for r in (0, 1)] == [["0", "1"], ["2", "3"]]
    assert _worker_devices(["0"], 1, 0) == ["0"] and _worker_devices([], 2, 1) == []


def test_a_ray_job_names_its_entrypoint_and_rays_runtime_env():
    spec = parse_job(
        "kind: ray\nprofile: gpu-1\nentrypoint: python train.py --epochs 3\n"
        "runtimeEnv:\n  env_vars: {EPOCHS: 3}\n  working_dir: proj\n  pip: [einops]\n"
        "retries: {limit: 1, reasons: [preempted, failed]}\n"
    )
    assert spec.kind == "ray" and spec.ray_entrypoint == "python train.py --epochs 3"
    # Ray's own spelling inside (as Ray's docs and KubeRay's runtimeEnvYAML write it)
    assert spec.runtime_env is not None
    assert spec.runtime_env.for_ray() == {"env_vars": {"EPOCHS": "3"}, "working_dir": "proj", "pip": ["einops"]}
    # a list is quoted into Ray's one shell command
    listed = parse_job("kind: ray\nprofile: p\nentrypoint: [python, -c, 'print(1)']\n")
    assert listed.ray_entrypoint == "python -c 'print(1)'" and listed.runtime_env is None
    # the record keeps the kind as written
    assert spec.model_dump(by_alias=True)["kind"] == "ray"
    # a job file without 'kind' is what it was: a command or a notebook
    assert parse_job("profile: p\ncommand: [x]\n").kind == "command"
    with pytest.raises(ValueError):
        spec.argv  # noqa: B018 - a Ray job's command is the backend's launcher, never the entrypoint


def test_ray_job_mistakes_are_located_at_the_key_they_are_about():
    assert errors("kind: rya\nprofile: p\nentrypoint: x\n") == [
        "job.yaml:1:7: kind: must be one of command, notebook, ray (got 'rya') (did you mean 'ray'?)"
    ]
    assert errors("profile: p\nkind: ray\n") == [
        "job.yaml:2:7: entrypoint: is required for kind: ray (the shell command Ray runs on the job's cluster)"
    ]
    assert errors("kind: ray\nprofile: p\ncommand: [python]\nentrypoint: x\nparameters: {a: 1}\n") == [
        "job.yaml:3:1: command: is not for kind: ray (a Ray job runs its 'entrypoint' on its own cluster)",
        "job.yaml:5:1: parameters: are for a notebook job ('notebook: train.ipynb'), not for kind: ray",
    ]
    assert errors("profile: p\ncommand: [x]\nentrypoint: python x.py\n") == [
        "job.yaml:3:1: entrypoint: is for kind: ray (add 'kind: ray' to run it on a Ray cluster of its own)"
    ]
    assert errors("kind: notebook\nprofile: p\ncommand: x\n") == [
        "job.yaml:3:1: command: is not for kind: notebook (use kind: command, or leave 'kind' out)"
    ]
    assert errors("kind: ray\nprofile: p\nentrypoint: ''\n") == ["job.yaml:3:13: entrypoint: must not be empty"]
    # Ray runs the entrypoint with /bin/sh -c: a leading '-' would be the shell's option, not a command.
    leading = (
        "entrypoint: starts with '-': Ray runs the entrypoint as a shell command (/bin/sh -c), which would read it as "
        "the shell's own option; begin with the program, e.g. 'python -m mymodule'"
    )
    assert errors("kind: ray\nprofile: p\nentrypoint: -m mymodule\n") == [f"job.yaml:3:13: {leading}"]
    assert errors("kind: ray\nprofile: p\nentrypoint: [--version]\n") == [f"job.yaml:3:13: {leading}"]


def test_a_ray_jobs_runtime_env_offers_only_what_runs_inside_the_users_sandbox():
    out = errors("kind: ray\nprofile: p\nentrypoint: x\nruntimeEnv:\n  conda: env\n  pipp: [a]\n")
    assert out == [
        "job.yaml:5:3: runtimeEnv.conda: Ray's 'conda' is not offered here: a Ray job's runtime environment may have "
        "env_vars, working_dir, py_modules, pip, excludes",
        "job.yaml:6:3: runtimeEnv.pipp: Ray's 'pipp' is not offered here (did you mean 'pip'?): a Ray job's runtime "
        "environment may have env_vars, working_dir, py_modules, pip, excludes",
    ]
    # the cluster's token and address are gpuhub's, in the runtime env and in env alike
    assert errors("kind: ray\nprofile: p\nentrypoint: x\nruntimeEnv:\n  env_vars: {RAY_AUTH_MODE: disabled}\n") == [
        "job.yaml:5:13: runtimeEnv.env_vars: 'RAY_AUTH_MODE' is set by gpuhub for a Ray job (its cluster's address and token)"
    ]
    assert errors("kind: ray\nprofile: p\nentrypoint: x\nenv: {RAY_ADDRESS: elsewhere}\n") == [
        "job.yaml:4:7: env.RAY_ADDRESS: is set by gpuhub for a Ray job (its cluster's address and token)"
    ]
    # the dynamic loader's names are refused there as in env
    assert "LD_PRELOAD" in errors("kind: ray\nprofile: p\nentrypoint: x\nruntimeEnv: {env_vars: {LD_PRELOAD: /x.so}}\n")[0]
    assert errors("kind: ray\nprofile: p\nentrypoint: x\nruntimeEnv: {working_dir: /etc, py_modules: [../x]}\n") == [
        "job.yaml:4:27: runtimeEnv.working_dir: must be a relative path, inside your home directory (no leading '/')",
        "job.yaml:4:45: runtimeEnv.py_modules: must stay inside your home directory (no '..')",
    ]


def test_a_ray_jobs_code_comes_from_the_users_files_never_a_uri():
    """Ray fetches a working_dir or py_modules URI (https, s3, gs, file, a cluster's gcs: package)."""

    def refused(value: str) -> str:
        return (
            f"{value!r} is a URI ({value.split(':')[0].lower()}:), which Ray would fetch instead of reading your files: "
            "give a path inside your home directory (a relative path whose first part has a ':' reads as a URI: "
            "write './' before it)"
        )

    text = "kind: ray\nprofile: p\nentrypoint: python x.py\nruntimeEnv:\n  working_dir: {w}\n  py_modules: [lib, {m}]\n"
    for w, m in (("https://evil.example/x.zip", "s3://b/m.zip"), ("gcs:_ray_pkg_0a1b.zip", "file:///etc/x.zip")):
        assert errors(text.format(w=w, m=m)) == [
            f"job.yaml:5:16: runtimeEnv.working_dir: {refused(w)}",
            f"job.yaml:6:15: runtimeEnv.py_modules: {refused(m)}",
        ]
    ok = parse_job(text.format(w="./proj:v2", m="pkgs/m.whl"))
    assert ok.runtime_env is not None and ok.runtime_env.for_ray()["py_modules"] == ["lib", "pkgs/m.whl"]
