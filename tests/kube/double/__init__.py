"""A test double of the Kubernetes API server, Kueue and a kubelet (see server.py)."""
