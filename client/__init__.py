"""pagedkv client: continuous-batching generation over the memory service and workers."""

from client.errors import FailedPrecondition, InvalidArgument, NotFound, OutOfBlocks, ServiceError, Unavailable
from client.params import SamplingParams

__all__ = [
    "AsyncClient", "Client", "CompletionOutput", "RequestOutput", "SamplingParams",
    "ServiceError", "OutOfBlocks", "InvalidArgument", "NotFound", "FailedPrecondition", "Unavailable",
]


def __getattr__(name):  # the API module pulls in transformers; import it on first use
    if name in ("AsyncClient", "Client", "CompletionOutput", "RequestOutput"):
        from client import api

        return getattr(api, name)
    raise AttributeError(name)
