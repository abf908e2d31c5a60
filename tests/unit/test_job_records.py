"""Job records: private, atomic, complete after a reload; nothing a job reports is taken on trust."""

import stat

from gpuhub_spawner.jobs import records as R
from gpuhub_spawner.local.job_manager import _git_evidence


def make(job_id="job-0123456789"):
    rec = R.JobRecord(
        id=job_id,
        user="bob",
        team="vision",
        profile={"slug": "gpu-1"},
        priority_class="batch",
        priority=100,
        policy_sha256="ab" * 32,
        image="img@sha256:x",
        image_digest="sha256:x",
        command=["python", "t.py"],
        working_dir="proj",
        checkpoint_dir=".gpuhub/checkpoints/x",
        env_names=["SECRET"],
        experiment=None,
        time_limit=60.0,
        retries={"limit": 1, "reasons": ["preempted"]},
        spec={"env": ["SECRET"]},
    )
    rec.attempts.append(R.Attempt(number=1, queued=1.0, admitted=2.0, started=3.0, finished=4.0, exit_code=0, reason="succeeded"))
    return rec


def test_records_round_trip_private_and_without_env_values(tmp_path):
    store = R.JobStore(tmp_path / "jobs")
    rec = make()
    store.save(rec)
    store.save_env(rec.id, {"SECRET": "s3cret"})
    path = store.path(rec.id)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "jobs").stat().st_mode) == 0o700
    assert "s3cret" not in path.read_text()
    assert stat.S_IMODE((tmp_path / "jobs" / rec.id / "env.json").stat().st_mode) == 0o600
    [back] = R.JobStore(tmp_path / "jobs").load_all()
    assert back.to_dict() == rec.to_dict() and back.current.reason == "succeeded"
    assert store.load_env(rec.id) == {"SECRET": "s3cret"}
    assert not list((tmp_path / "jobs").glob("*.tmp"))


def test_an_unreadable_record_is_skipped_not_fatal(tmp_path):
    store = R.JobStore(tmp_path / "jobs")
    store.save(make("job-000000000a"))
    (tmp_path / "jobs" / "job-000000000b.json").write_text("{torn")
    assert [r.id for r in store.load_all()] == ["job-000000000a"]


def test_job_ids_cannot_name_other_files(tmp_path):
    store = R.JobStore(tmp_path / "jobs")
    for bad in ("../x", "job-../../etc", "job-ZZZZZZZZZZ", "job-0123456789/../a"):
        try:
            store.path(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_git_evidence_keeps_only_the_expected_shape():
    good = {"commit": "a" * 40, "dirty": 1, "branch": "main", "extra": "x" * 10}
    assert _git_evidence(good) == {"commit": "a" * 40, "dirty": True, "branch": "main"}
    for bad in (None, "x", {"commit": "not-hex"}, {"commit": "a" * 39}, {"commit": ["a"]}):
        assert _git_evidence(bad) is None


def test_a_ray_jobs_record_keeps_what_was_submitted_and_runs_one_launcher_with_every_gpu(tmp_path):
    import json

    from gpuhub_spawner.local.job_manager import _processes, _worker_devices, ray_node_argv

    argv = ray_node_argv(
        gpus=2, workers=2, cpus=4, name="job-0123456789", virtual=True, entrypoint="python t.py", runtime_env={"pip": ["x"]}
    )
    assert argv[1:4] == ["-I", "-m", "gpuhub_spawner.rayclusters.node"]  # gpuhub's Ray launcher, as `gpuhub ray up`'s
    assert argv[-2:] == ["--", "python t.py"]  # last, after '--': never one of the launcher's options
    assert json.loads(argv[argv.index("--runtime-env") + 1]) == {"pip": ["x"]}
    assert "--" not in ray_node_argv(gpus=1, workers=0, cpus=1, name="ray-a", virtual=False)
    rec = make()
    rec.kind, rec.workers, rec.command = "ray", 2, argv
    rec.ray = {"entrypoint": "python t.py", "runtime_env": {"pip": ["x"]}, "workers": 2}
    store = R.JobStore(tmp_path / "jobs")
    store.save(rec)
    [back] = R.JobStore(tmp_path / "jobs").load_all()
    assert back.ray == rec.ray and back.kind == "ray"
    # Two workers' worth of GPUs, one process tree: the launcher gets all of them (its nodes split them).
    assert _processes(back) == 1 and _worker_devices(["0", "1"], _processes(back), 0) == ["0", "1"]
    rec.kind = "command"
    assert _processes(rec) == 2


def test_the_ray_launcher_takes_any_entrypoint_verbatim():
    """The entrypoint is the user's text: one that looks like an option reaches Ray as given."""
    from gpuhub_spawner.local.job_manager import ray_node_argv
    from gpuhub_spawner.rayclusters.node import parse_args

    for entrypoint in ("--version", "-x", "--gpus", "--", "python -m m --workers 3"):
        argv = ray_node_argv(gpus=1, workers=0, cpus=1, name="job-0123456789", virtual=True, entrypoint=entrypoint)
        args = parse_args(argv[4:])
        assert (args.entrypoint, args.gpus, args.workers, args.runtime_env) == (entrypoint, 1, 0, "{}"), entrypoint
    assert parse_args(["--gpus", "1"]).entrypoint is None  # a `gpuhub ray up` cluster
    # A job recorded before (its command is re-run on a retry): still read.
    assert parse_args(["--entrypoint", "python t.py", "--runtime-env", "{}"]).entrypoint == "python t.py"
