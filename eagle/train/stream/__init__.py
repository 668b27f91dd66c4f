"""`train.mode=stream`: the trainer takes each conversation's target features from vLLM servers.

    transport  `StatesTransport` (fetch a sample's tensors by the server's handle, release them);
               `SharedFileTransport`, the connector's files in a shared folder, deleted once read
    client     one request: `/v1/completions` of the sample's token ids with max_tokens=1, the answer
               checked (tokens, rows, layers, finite) and mapped to eagle's features as
               capture.backend=vllm maps them; `StreamRecipe` and the start-up check of a server
    pool       `StatesPool`: bounded prefetch over the servers, failover, backoff, unservable samples
    split      `StreamSplit`: online mode's split (same batches for the same seed), features streamed
    launch     the vLLM server command of a recipe (`python -m eagle.cli.serve_target`)
    setup      `build_stream_splits`: the splits, every server checked first

Layout across machines and where Mooncake / NIXL would slot in: docs/scaling.md.
"""

from eagle.train.stream.pool import StreamStopped
from eagle.train.stream.setup import build_stream_splits
from eagle.train.stream.split import StreamSplit

__all__ = ["StreamSplit", "StreamStopped", "build_stream_splits"]
