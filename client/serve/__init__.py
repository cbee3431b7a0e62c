"""``pagedkv serve``: the client library hosted as one long-running OpenAI-compatible HTTP server.

config (flags), backends (attach or embed), protocol (request bodies, errors), outputs
(response bodies), metrics (Prometheus), app (routes), generation (one request over the engine),
main (the command); the dashboard's feed: dashboard_feed (one poller for every viewer),
dashboard_snapshot (a snapshot's JSON), block_states (per-block states and their encoding),
kv_follower (cached blocks from the KV events), rates (tokens/s and hit rate over minutes),
dashboard_auth and dashboard_routes (login, cookie, routes).
"""
