import asyncio, pytest, aiohttp
pytestmark = pytest.mark.asyncio(loop_scope="function")

async def test_smoke(make_spawner, kube):
    sp = make_spawner(profile="a100-1")
    fut = sp.start()
    msgs = []
    async def prog():
        async for m in sp.progress():
            msgs.append(m)
    t = asyncio.ensure_future(prog())
    url = await asyncio.wait_for(fut, 60)
    await t
    print(url, msgs)
    async with aiohttp.ClientSession() as s:
        for i in range(100):
            try:
                async with s.get(url.rstrip("/") + "/api") as r:
                    print(r.status, await r.text()); break
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.2)
    await sp.stop()
    print(kube.calls)
