"""The KV event log published in vLLM's ZMQ/msgpack format (``pagedkv memory --kv-events-endpoint``):
the wire schema (:mod:`.wire`), the endpoints and who may read token ids (:mod:`.endpoints`), and
the publisher that follows the log (:mod:`.publisher`)."""
