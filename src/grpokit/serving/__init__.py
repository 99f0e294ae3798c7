"""The policy served over OpenAI's API on localhost (docs/serving.md): :class:`PolicyServer` in Python,
``grpokit serve MODEL`` on the command line. Requests join the native sampler's running decode as rows and leave it
as they finish (:mod:`grpokit.serving.continuous`; other native engines: :mod:`grpokit.serving.batcher`), or go into
vLLM's continuously batched engine (:mod:`grpokit.serving.vllm_backend`); every request's tokens are recorded per
episode (:mod:`grpokit.serving.records`).
FastAPI and uvicorn are imported only when a server starts (``pip install 'grpokit[serve]'``)."""

from grpokit.serving.records import Turn
from grpokit.serving.server import PolicyServer

__all__ = ["PolicyServer", "Turn"]
