"""``gpuhub install-service``: the systemd unit that runs the one-machine hub on a GPU server.

What the unit guarantees, and why:

- runs ``gpuhub run`` as root (servers need their own accounts, cgroups and a private
  ``/dev``; the hub drops nothing of its own into them);
- logs to the journal (``journalctl -u gpuhub``), ``UMask=0077`` so everything the hub
  writes is private, data in ``--data-dir`` (default ``/var/lib/gpuhub``);
- ``Restart=on-failure``; a stop is SIGTERM to the hub alone (``KillMode=mixed``),
  then SIGKILL for whatever of the unit is left. Single-user servers live in their own cgroups (``gpuhub/...``),
  outside the unit, so ``systemctl restart gpuhub`` and upgrades keep them running;
  the restarted hub re-adopts them from its database (identity: pid + start time).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

UNIT = """\
[Unit]
Description=gpuhub: a JupyterHub for teams sharing GPUs
Documentation=file://{docs}
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
User=root
WorkingDirectory=/
ExecStart={exec_start}
Environment=PYTHONUNBUFFERED=1
UMask=0077
Restart=on-failure
RestartSec=5
# SIGTERM goes to the hub alone, which stops its services itself (measured: ~2.5 s);
# SIGTERM to every process of the unit (control-group) made it wait ~30 s on the culler.
# What is left after the hub exits (the proxy) gets SIGKILL. Users' servers run in their
# own cgroups outside the unit and are re-adopted when the hub comes back.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec=30
StandardOutput=journal
StandardError=journal
SyslogIdentifier=gpuhub
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
"""


def render_unit(*, config: str, policy: str, data_dir: str, port: int, site: str | None) -> str:
    gpuhub = str(Path(sys.prefix) / "bin" / "gpuhub")
    args = [gpuhub, "run", "--config", config, "--policy", policy, "--data-dir", data_dir, "--port", str(port)]
    if site:
        args += ["--site", site]
    docs = Path(config).resolve().parents[1] / "docs" / "install-one-machine.md"
    return UNIT.format(exec_start=" ".join(shlex.quote(a) for a in args), docs=docs)


def install_service(args) -> int:
    """Write the unit (or print it with ``--print``); say what to run next."""
    config = str(Path(args.config).resolve())
    policy = str(Path(args.policy or Path(config).parent / "profiles.yaml").resolve())
    site = str(Path(args.site).resolve()) if args.site else None
    for what, path in (("config", config), ("policy", policy), ("site file", site)):
        if path and not Path(path).is_file():
            print(f"gpuhub install-service: the {what} {path} does not exist", file=sys.stderr)
            return 2
    unit = render_unit(config=config, policy=policy, data_dir=str(Path(args.data_dir).resolve()), port=args.port, site=site)
    if args.print:
        sys.stdout.write(unit)
        return 0
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(unit)
    tmp.replace(out)
    print(
        f"Wrote {out}. Next:\n"
        f"  systemctl daemon-reload && systemctl enable --now {out.stem}\n"
        f"  journalctl -u {out.stem} -f      # the hub's log\n"
        f"Data (database, secrets, homes): {Path(args.data_dir).resolve()} - back it up (docs/install-one-machine.md)."
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("install-service", help="write a systemd unit that runs this hub (journal logs, restarts)")
    p.add_argument("--config", default="jupyterhub_config/jupyterhub_config.py")
    p.add_argument("--policy", default=None, help="policy file (default: profiles.yaml beside the config)")
    p.add_argument("--site", default=None, help="site file: login, HTTPS, accounts (docs/authentication.md)")
    p.add_argument("--data-dir", default="/var/lib/gpuhub")
    p.add_argument("--port", type=int, default=443)
    p.add_argument("--output", default="/etc/systemd/system/gpuhub.service")
    p.add_argument("--print", action="store_true", help="print the unit instead of writing it")
    p.set_defaults(func=install_service)
