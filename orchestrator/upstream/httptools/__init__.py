"""The default client, on asyncio protocols and httptools' C parser: the pool (``pool``) of connections
(``connection``) to one worker, and an answer streamed from one (``stream``)."""
