"""flashvlm replicas on Ray Serve (`flashvlm serve --ray`, docs/distributed.md).

The flow: Serve's HTTP proxy -> `Ingress` (deployments.py: reads the body, derives routing keys, keys.py) ->
`CacheAffinityRouter` (router.py, the choice itself in affinity.py) -> one `EngineReplica`, which runs the very
app `flashvlm serve` runs (flashvlm/server/app.py) over its own engine, fed the forwarded request (asgi_bridge.py).

Only deployments.py, router.py and launch.py import ray; options.py, keys.py, affinity.py, asgi_bridge.py and
metrics_merge.py are plain Python, so `flashvlm serve --help` and the unit tests work without the [ray] extra.
"""
