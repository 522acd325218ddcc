"""Embedded CPU inference engine speaking SGLang's native HTTP API.

SGLang cannot run on CPU-only machines, so development, CI and small experiments use
this engine instead: same endpoints and JSON shapes, backed by a Hugging Face
transformers model on CPU. A client cannot tell the two apart except by speed.

    python -m megatron_tg.rollout.engine --model DIR --port N [--host 127.0.0.1]

Modules: ``protocol`` (wire format), ``sampling`` (sampling + log-prob convention),
``model_runner`` (batched KV-cache forward), ``scheduler`` (generation loop thread),
``weights`` (weight updates: loading, checksums, receiving; the transport shared with the
trainer side is :mod:`megatron_tg.rollout.transport`), ``errors`` (the 400 error),
``server`` (aiohttp routes).
Heavy imports (torch, transformers) happen only when the server is built.
"""

__all__ = ["EngineServer", "main"]


def __getattr__(name):
    if name == "EngineServer":
        from .server import EngineServer

        return EngineServer
    if name == "main":
        from .__main__ import main

        return main
    raise AttributeError(name)
