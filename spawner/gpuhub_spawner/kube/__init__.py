"""The Kubernetes backend: KubeSpawner on Kueue, Kueue objects rendered from the policy.

* ``spawner`` - KueueSpawner (the policy mixin + KubeSpawner; queue wait, launch limit, eviction)
* ``state``   - shared, bounded reads of Kueue's state (Workload watch, visibility poller)
* ``messages``- Kueue's and the kubelet's state in plain words
* ``render``  - ``gpuhub render kueue``: ResourceFlavors, ClusterQueues, LocalQueues, priorities
* ``kueue``   - API groups, labels and condition names shared by all of the above
"""
