"""What :mod:`grpokit.agents.verifiers_v1` plugs into verifiers 0.4, so that its own rollout code runs an episode
against the ``openai.AsyncOpenAI`` client an agent is handed:

- a model client (verifiers' ``Client``) sending each model call through that ``openai`` client, so the call lands
  at the client's base URL (the episode's URL at grpokit's policy server) with the client's key and settings;
- the chat harnesses' program (``null``, ``bash``) run with this Python, whose packages are verifiers' own, rather
  than in an environment ``uv`` builds from the network for it;
- verifiers' serving resources (its interception server, shared tool servers) held open while episodes of one event
  loop run, as verifiers' own env server holds them, since concurrent episodes of one ``Env`` must share them.

verifiers is imported only when an episode runs (the module imports without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib.util
import re
import sys
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

# The openai clients of the episodes in flight, by the key their client config names. A config is recorded on the
# trace and keys verifiers' client cache, so it carries this key and never the client itself.
_CLIENTS: dict[str, Any] = {}


@functools.cache
def client_config_type() -> type:
    """verifiers' eval client config, naming the episode's ``openai`` client by key. An eval config (not a train
    one): verifiers then serves the harness's streamed requests from what the client returns (``relay``)."""
    from verifiers.v1.configs.client import EvalClientConfig

    class GrpokitClientConfig(EvalClientConfig):
        grpokit_client: str = ""
        """Key of the episode's ``openai.AsyncOpenAI`` client (in-process only)."""

    return GrpokitClientConfig


def client_config(client: Any) -> tuple[Any, str]:
    """A client config for ``client`` and its key; ``release(key)`` when the episode is over."""
    key = uuid.uuid4().hex
    _CLIENTS[key] = client
    # api_key_var names no variable: verifiers reads no key (the openai client has its own), and no Prime config
    config = client_config_type()(base_url=str(client.base_url), api_key_var="GRPOKIT_VERIFIERS_NO_KEY",
                                  grpokit_client=key)
    return config, key


def release(key: str) -> None:
    _CLIENTS.pop(key, None)


def _policy_client_type() -> type:
    from pydantic import ValidationError
    from pydantic_core import from_json
    from verifiers.v1.clients.base import join_url
    from verifiers.v1.clients.client import Client, RelayReply
    from verifiers.v1.errors import model_error

    class PolicyClient(Client):
        """One episode's model calls through its ``openai`` client. grpokit's server answers whole responses (no
        ``stream``): a streamed request is sent unstreamed and its response handed back as the dialect's own
        stream events, which verifiers reads as it reads a provider's stream."""

        def __init__(self, key: str) -> None:
            self.key = key

        async def _post(self, dialect: Any, body: dict) -> dict:
            import openai

            client = _CLIENTS.get(self.key)
            if client is None:  # the episode is over; a late call (a harness still running) has no model
                raise model_error("grpokit: this episode's model client is closed", status_code=409)
            body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            try:
                # join_url: a dialect path repeating the base URL's /v1 (Anthropic's /v1/messages) is not doubled
                raw = await client.post(join_url(str(client.base_url), dialect.upstream_path), body=body,
                                        cast_to=bytes)
            except openai.APIStatusError as e:  # as verifiers' own client reports an upstream refusal
                raise model_error(f"upstream {e.status_code}: {e.response.text}", status_code=e.status_code) from e
            except openai.APITimeoutError as e:
                raise model_error(str(e), status_code=504) from e
            except openai.APIConnectionError as e:
                raise model_error(str(e), status_code=503) from e
            return from_json(raw)

        async def get_response(self, dialect: Any, body: dict, sampling: Any, session_id: str | None = None,
                               turn: Any = None, headers: Mapping[str, str] | None = None) -> Any:
            raw = await self._post(dialect, body)
            try:
                response = dialect.parse_response(dialect.validate_response(raw))
            except (ValueError, ValidationError) as e:
                raise model_error(f"malformed upstream response: {type(e).__name__}: {e}", status_code=502) from e
            response.raw = raw
            return response

        async def relay(self, dialect: Any, body: dict, session_id: str | None = None,
                        headers: Mapping[str, str] | None = None) -> Any:
            events = dialect.stream_events(await self._post(dialect, body))

            async def chunks() -> AsyncIterator[bytes]:
                for event in events:
                    yield event

            async def close() -> None:
                return None

            return RelayReply(content_type="text/event-stream", chunks=chunks(), close=close)

    return PolicyClient


def install_client() -> None:
    """Have verifiers' interception server build a ``PolicyClient`` for a grpokit client config (any other config
    as before). It builds its clients with ``resolve_client``, looked up in its own module: that name is wrapped,
    once; verifiers offers no other place to add a client."""
    from verifiers.v1.interception import server

    if getattr(server.resolve_client, "grpokit", False):
        return
    original, config_type, client_type = server.resolve_client, client_config_type(), _policy_client_type()

    def resolve_client(config: Any) -> Any:
        if isinstance(config, config_type):
            return client_type(config.grpokit_client)
        return original(config)

    resolve_client.grpokit = True  # type: ignore[attr-defined]
    server.resolve_client = resolve_client


def _script_modules(source: str) -> list[str]:
    """The importable names of a PEP 723 script's dependencies (``mcp==2.0.0`` -> ``mcp``)."""
    match = re.search(r"^# dependencies = \[(.*)\]$", source, re.MULTILINE)
    names = re.findall(r'"([A-Za-z0-9_.\-]+)', match.group(1)) if match else []
    return [name.replace("-", "_").lower() for name in names]


def use_local_python() -> bool:
    """Run the chat harnesses' program (verifiers' ``null`` and ``bash``) with this interpreter, where its
    dependencies import here (they are verifiers' own): verifiers would otherwise have ``uv`` build an environment
    for it from the network, per machine. Its subprocess runtime keeps the interpreter of each prepared script in a
    class-wide table, keyed by the script's path; the script is written there and this interpreter entered. Returns
    whether it was (False: verifiers prepares it with uv, as it would)."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    table = getattr(SubprocessRuntime, "_interpreters", None)
    needed = _script_modules(CHAT_PROGRAM_SOURCE)
    if not isinstance(table, dict) or not all(importlib.util.find_spec(module) for module in needed):
        return False
    data = CHAT_PROGRAM_SOURCE.encode()
    path = f"{SubprocessRuntime.scripts_dir}/{hashlib.sha256(data).hexdigest()}.py"  # as prepare_uv_script names it
    if not Path(path).is_file() or Path(path).read_bytes() != data:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: another process may run the same script
    table.setdefault(path, sys.executable)
    return True


class _Served:
    """One event loop's ``Env`` and how many of its episodes are running."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.running = 0
        self.lock = asyncio.Lock()
        self.stack: contextlib.AsyncExitStack | None = None


class Serving:
    """verifiers' ``Env.serving()`` (its interception server, shared tool servers), entered when the first episode
    of an event loop starts and left when the last one running ends. An ``Env`` keeps these on itself, so each event
    loop has an ``Env`` of its own (``make_env``)."""

    def __init__(self, make_env: Callable[[], Any]) -> None:
        self._make_env = make_env
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Served] = weakref.WeakKeyDictionary()

    @contextlib.asynccontextmanager
    async def env(self) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        served = self._loops.get(loop)
        if served is None:
            served = self._loops[loop] = _Served(self._make_env())
        async with served.lock:
            if served.running == 0:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(served.env.serving())
                served.stack = stack
            served.running += 1
        try:
            yield served.env
        finally:
            async with served.lock:
                served.running -= 1
                if served.running == 0 and served.stack is not None:
                    stack, served.stack = served.stack, None
                    await stack.aclose()
