"""gpuhub on one machine: the embedded default started by `gpuhub run`.

Environment knobs (all optional):
  GPUHUB_POLICY      the policy YAML (default: profiles.yaml beside this file)
  GPUHUB_DATA_DIR    database, cookie secret, homes, demo password (default: ./data)
  GPUHUB_PORT        public port (default 8000); GPUHUB_HUB_PORT, GPUHUB_PROXY_API_PORT
  GPUHUB_DEMO_PASSWORD  fixed demo password instead of a generated one
"""

import os
from pathlib import Path

from gpuhub_spawner.wiring.config import configure_local

c = get_config()  # noqa: F821

here = Path(__file__).resolve().parent
data_dir = os.environ.get("GPUHUB_DATA_DIR", "data")

configure_local(
    c,
    data_dir=data_dir,
    policy_file=os.environ.get("GPUHUB_POLICY", str(here / "profiles.yaml")),
    port=int(os.environ.get("GPUHUB_PORT", 8000)),
)
