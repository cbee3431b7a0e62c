"""``pagedkv serve``: the client library hosted as one long-running OpenAI-compatible HTTP server.

config (flags), backends (attach or embed), protocol (request bodies, errors), outputs
(response bodies), metrics (Prometheus), app (routes), main (the command).
"""
