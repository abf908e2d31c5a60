"""The Python configurable-http-proxy, with streamed responses.

The PyPI ``configurable-http-proxy`` buffers each proxied response and gives up after
tornado's default 20 s. The spawn page's progress is a server-sent event stream that
stays open while a server waits in the queue, so buffering would hide every queue
message. This entry point streams headers and body chunks as they arrive and lets a
stream stay open; everything else is the upstream proxy unchanged.

It is the fallback where Node.js is missing (the hub prefers the Node proxy z2jh ships,
see ``hub.origins.node_proxy_command``). Upstream forwards with tornado's shared
``AsyncHTTPClient()``, whose ``max_clients`` is 10: every open spawn page holds one
client for as long as it waits, so ten waiting users made every other request queue and
fail with 503. Here the client has no practical cap (``GPUHUB_PROXY_MAX_CLIENTS``,
default 10,000; each costs only a socket), so long streams and ordinary requests never
wait for each other.
"""

from __future__ import annotations

import os

from configurable_http_proxy import cli, handlers
from tornado.httpclient import AsyncHTTPClient
from tornado.httputil import HTTPHeaders, parse_response_start_line

_SKIP = {"content-length", "transfer-encoding", "content-encoding", "connection"}


async def _streaming_call_proxy(self, path=None):
    url = await self.get_target_url(path)
    if url is None:
        return
    req = self._get_proxy_request(url)
    req.request_timeout = self.proxy.proxy_timeout or 0  # 0: no limit for long streams
    state = {"headers": HTTPHeaders(), "sent": False}

    def on_header(line: str) -> None:
        if line.startswith("HTTP/"):
            state["start"] = parse_response_start_line(line.strip())
            state["headers"] = HTTPHeaders()
        elif line.strip():
            state["headers"].parse_line(line)
        elif "start" in state and state["start"].code not in (100,):
            self.set_status(state["start"].code, state["start"].reason)
            for key, val in state["headers"].get_all():
                if key.lower() not in _SKIP:
                    self.add_header(key, val) if key.lower() == "set-cookie" else self.set_header(key, val)

    def on_chunk(chunk: bytes) -> None:
        state["sent"] = True
        self.write(chunk)
        self.flush()

    req.header_callback = on_header
    req.streaming_callback = on_chunk
    try:
        response = await AsyncHTTPClient().fetch(req, raise_error=False)
    except Exception as err:
        if not state["sent"]:
            await self.handle_proxy_error(503, err)
        return
    if response.code == 599 and not state["sent"]:
        await self.handle_proxy_error(503, response.error)
        return
    self.finish()


MAX_CLIENTS = int(os.environ.get("GPUHUB_PROXY_MAX_CLIENTS", 10_000))


def main():
    # Before the first AsyncHTTPClient() is made: every later one shares this limit.
    AsyncHTTPClient.configure(None, max_clients=MAX_CLIENTS)
    handlers.ProxyHandler.call_proxy = _streaming_call_proxy
    return cli.main()


if __name__ == "__main__":
    main()
