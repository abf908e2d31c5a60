"""gpuhub's notebook-side package: runs inside every single-user server.

Modules:
  identity        who/where this server is (the GPUHUB_* variables the hub sets)
  gitinfo         commit and dirty flag of the repository a notebook lives in
  mlflow_context  MLflow run-context provider: tags every run (entry point
                  ``mlflow.run_context_provider``), turns on system metrics on GPU servers
  mlflow_auth     MLflow request-header provider: sends this server's hub token to
                  the hub's MLflow service only (entry point ``mlflow.request_header_provider``)

The culler's GPU-activity reporter will live beside these (e.g. ``activity``).
Nothing here imports MLflow at package import time.
"""

__version__ = "0.1.0"
