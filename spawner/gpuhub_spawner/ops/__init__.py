"""Tools for the people who operate a gpuhub: ``gpuhub loadtest`` (docs/loadtest.md).

Clients of a running hub's REST API, like ``jobs.cli``: they import nothing of the hub's
internals, so they work against a hub on one machine or on Kubernetes alike.
"""
