"""The HTTP layer: OpenAI's request bodies (pydantic: a bad parameter is a 400 that names it), the routes, and
errors in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``). It parses and answers; sampling is
:class:`~grpokit.serving.server.PolicyServer`'s. Imported only when a server starts: FastAPI is an optional extra.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, each also under
``/episodes/{episode_id}/v1/...``, which attributes the request to that episode. Under plain ``/v1`` an API key
``episode:ID`` does the same; any other key (the SDK insists on one) means no episode.
"""

from __future__ import annotations

from typing import Any

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field
except ImportError as missing:  # pragma: no cover - the message is the point
    raise ImportError(f"serving the policy needs FastAPI and uvicorn ({missing}): pip install 'grpokit[serve]'") \
        from missing

from grpokit.serving.chat import RequestError

KEY_PREFIX = "episode:"


class SamplingBody(BaseModel):
    """The sampling parameters both endpoints take. Fields OpenAI has that are not listed are accepted and ignored
    (``user``, ``metadata``, ...), except those refused in :func:`refuse_unsupported`."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class CompletionBody(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)  # the sampled tokens' log-probs (no alternatives are given)
    echo: bool = False


class ChatBody(SamplingBody):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def refuse_unsupported(body: SamplingBody) -> None:
    """Parameters whose meaning this server does not give: refused by name rather than silently ignored."""
    if body.stream:
        raise RequestError("stream is not supported by grpokit's policy server: send stream=false", param="stream")
    if getattr(body, "echo", False):
        raise RequestError("echo is not supported by grpokit's policy server", param="echo")
    if getattr(body, "top_logprobs", None):
        raise RequestError("top_logprobs is not supported: logprobs gives the sampled tokens' own log-probs",
                           param="top_logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if (body.model_extra or {}).get(name):
            raise RequestError(f"{name} is not supported by grpokit's policy server: leave it at 0", param=name)


def error_response(message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _episode(request: Request) -> str | None:
    """The episode a request belongs to: its URL's, else its API key's (``episode:ID``), else None."""
    if "episode_id" in request.path_params:
        return request.path_params["episode_id"]
    key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return key[len(KEY_PREFIX):] or None if key.startswith(KEY_PREFIX) else None


def build_app(server: Any) -> FastAPI:
    """The FastAPI application serving ``server``'s policy (a :class:`~grpokit.serving.server.PolicyServer`)."""
    app = FastAPI(title="grpokit policy server", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return error_response(f"{param or 'body'}: {first.get('msg', 'invalid request')}", param=param)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        return error_response(str(error), status=error.status, param=error.param, code=error.code)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception) -> JSONResponse:
        return error_response(f"the server failed: {type(error).__name__}: {error}", status=500, kind="server_error")

    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "grpokit"}]}

    # The answers are plain JSON already: returned as responses, FastAPI does not walk them again.
    async def completions(body: CompletionBody, request: Request) -> JSONResponse:
        refuse_unsupported(body)
        return JSONResponse(await server.complete(body, _episode(request)))

    async def chat(body: ChatBody, request: Request) -> JSONResponse:
        refuse_unsupported(body)
        return JSONResponse(await server.chat(body, _episode(request)))

    for prefix in ("/v1", "/episodes/{episode_id}/v1"):
        app.add_api_route(f"{prefix}/models", models, methods=["GET"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
    return app
