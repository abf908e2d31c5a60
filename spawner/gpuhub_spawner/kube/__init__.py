"""The Kubernetes backend: KubeSpawner on Kueue, Kueue objects rendered from the policy.

* ``spawner`` - KueueSpawner (the policy mixin + KubeSpawner; queue wait, launch limit, eviction)
* ``state``   - shared, bounded reads of Kueue's state (Workload watch, visibility poller)
* ``messages``- Kueue's and the kubelet's state in plain words
* ``render``  - ``gpuhub render kueue``: ResourceFlavors, ClusterQueues, LocalQueues, priorities
* ``ledger``  - KueueLedger: Kueue's Workloads mirrored into the admission view (``admission.view``)
* ``job_manager``, ``job_manifest`` - batch jobs as suspended ``batch/v1`` Jobs for Kueue
* ``kueue``   - API groups, labels and condition names shared by all of the above

Never imports ``local/`` (tests/unit/test_architecture.py).
"""
