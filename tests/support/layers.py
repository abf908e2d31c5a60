"""One layer's tests (docs/architecture.md), for ``./run-tests.sh --layer NAME``.

Each list runs in well under a minute on 2 cores: unit tests and the Kubernetes manifest
builders, no hub. ``tests/unit/test_architecture.py`` checks that every file of
``tests/unit`` is in one of them, so a new unit test cannot fall out of every layer.
"""

LAYER_TESTS = {
    "architecture": ["unit/test_architecture.py", "unit/test_test_order.py", "unit/test_test_ports.py"],
    "policy": [
        "unit/test_policy_validation.py",
        "unit/test_policy_reload.py",
        "unit/test_policy_checks.py",
        "unit/test_idle_rule_validation.py",
        "unit/test_bounded_input.py",
        "unit/test_mig.py",
        "unit/test_ray_policy.py",
        "unit/test_validate_large_policy.py",
    ],
    "admission": [
        "unit/test_admission.py",
        "unit/test_queue_persistence.py",
        "unit/test_reclaim_plan.py",
        "unit/test_reclaim_holddown.py",
        "unit/test_concurrency.py",
        "unit/test_policy_impact.py",
        "unit/test_gpu_health.py",
    ],
    "services": [
        "unit/test_cull_rules.py",
        "unit/test_cull_board.py",
        "unit/test_culler_service.py",
        "unit/test_dcgm_reader.py",
        "unit/test_reclaimer.py",
        "unit/test_usage_units.py",
        "unit/test_usage_csv_injection.py",
        "unit/test_job_spec.py",
        "unit/test_job_records.py",
        "unit/test_profile_form.py",
        "unit/test_trace_replay.py",
        "unit/test_mlflow_graphql_rule.py",
    ],
    "backends": [
        "unit/test_job_reclaim.py",
        "unit/test_waiting_messages.py",
        "unit/test_progress_events.py",
        "unit/test_isolation_units.py",
        "unit/test_unix_users.py",
        "unit/test_device_nodes.py",
        "unit/test_listen_watcher.py",
        "unit/test_cancel_reaches_the_launch.py",
        "unit/test_sandbox_launcher.py",
        "unit/test_process_limits_and_prefix_lock.py",
        "unit/test_kube_ledger.py",
        "unit/test_kube_waiting_words.py",
        "unit/test_kube_capacity.py",
        "unit/test_kube_rbac.py",
        "unit/test_cuda_driver.py",
        "unit/test_ray_manager_units.py",
        "kube/test_job_manifest.py",
        "kube/test_render.py",
        "kube/test_render_mig.py",
        "kube/test_webhook_exclusion.py",
        "kube/test_kueue_diff.py",
        "kube/test_ray_manifest.py",
    ],
    "hub": [
        "unit/test_policy_roles.py",
        "unit/test_hub_config.py",
        "unit/test_cli_top.py",
        "unit/test_service_unit.py",
        "unit/test_loadtest_jobs.py",
    ],
}
