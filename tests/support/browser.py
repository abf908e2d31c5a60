"""The real Chromium every browser test drives (Debian's, through Playwright; never a
downloaded one): where it is and the flags that keep it quiet and local.

Headless, no sandbox (the tests run as root), no GPU, no QUIC, and none of the background
traffic a browser makes on its own (component updates, sync, safe-browsing lists): nothing
leaves the machine.
"""

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
