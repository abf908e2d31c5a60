"""GPU-aware idle culling: rules from the policy, warnings, snoozes.

``rules.decide`` is the pure decision shared by the hub's culler service (run by
jupyterhub-idle-culler 2.0 through its ``cull_arbiter_hook``) and the trace-replay
benchmark, so what is measured is what runs.
"""
