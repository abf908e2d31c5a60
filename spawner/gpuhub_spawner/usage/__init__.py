"""Usage you can see: history in the hub's database (``history``, ``recorder``), the audit
trail (``audit``), per-team metrics (``metrics``), charts and the ``gpuhub usage`` client
(``cli``). The pages and API that show them are ``hub.usage_api``; roles from the
policy's groups ``hub.roles``; ``wiring.usage`` wires them into a hub."""
