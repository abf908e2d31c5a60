"""The composition root (layer 6, docs/architecture.md): wires a backend into a hub.

``config`` (one machine: ``configure_local``; both: ``configure_culler``,
``bound_what_users_send``), ``kube`` (``configure_ledger``), ``usage``, ``jobs``,
``backend`` (which backend provides the admission view), ``startup`` (``when_started``).
Nothing in the package imports it; hub configs and the chart's extraConfig do.
"""
