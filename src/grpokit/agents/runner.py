"""Running a round's agent episodes against the policy server: ``group`` episodes per row, at most ``concurrency`` at
once, each with an ``openai`` client whose base URL attributes its requests to the episode, each bounded by
``timeout``. The first episode to fail stops the round (the others are cancelled) with an :class:`AgentError` naming
the agent, the row and the episode.

The episodes run on an event loop of their own, in a thread of its own: a caller inside a running loop (a notebook)
is not in the way, and the server's batcher, in its own thread, decodes while they wait.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpokit.agents.calling import AgentError, agent_name, episode_rewards
from grpokit.runtime.threads import DaemonPool
from grpokit.serving import PolicyServer, Turn


@dataclass
class Episode:
    """One finished episode: the round's row it ran (``row``, its index in the round), its place in the row's group,
    the rewards it returned, the turns the server recorded for it (in order of arrival) and its wall seconds."""

    id: str
    row: int
    generation: int
    rewards: dict[str, float]
    turns: list[Turn]
    seconds: float


def run_episodes(agent: Callable, rows: Sequence[dict[str, Any]], group: int, server: PolicyServer, *,
                 columns: Sequence[str], labels: Sequence[str], concurrency: int = 16,
                 timeout: float | None = None) -> list[Episode]:
    """``group`` episodes of ``agent`` for each of ``rows`` (given the ``columns`` by keyword), row by row, each row's
    episodes together; ``labels``: how messages name each row (e.g. "row 7 of data.jsonl")."""
    outcome: dict[str, Any] = {}

    def main() -> None:
        try:
            outcome["episodes"] = asyncio.run(_run(agent, rows, group, server, columns, labels, concurrency, timeout))
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=main, name="grpokit-agents", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["episodes"]


async def _run(agent: Callable, rows: Sequence[dict[str, Any]], group: int, server: PolicyServer,
               columns: Sequence[str], labels: Sequence[str], concurrency: int,
               timeout: float | None) -> list[Episode]:
    import httpx
    import openai

    name = agent_name(agent)
    is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__)  # or an object's
    round_id = uuid.uuid4().hex[:8]  # episode ids never repeat across rounds
    gate = asyncio.Semaphore(concurrency)
    # One connection pool for every episode's client; a plain-def agent's calls run in daemon threads, which a
    # failed run's exit abandons (a hung agent does not keep it alive).
    http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=2 * concurrency))
    threads = None if is_async else DaemonPool(concurrency, "grpokit-agent")

    async def episode(row: int, generation: int) -> Episode:
        async with gate:
            episode_id = f"{round_id}-{row}-{generation}"
            where = f"{labels[row]}, episode {episode_id}"
            arguments = {column: rows[row][column] for column in columns}
            start = time.perf_counter()
            try:
                if is_async:
                    client = openai.AsyncOpenAI(base_url=server.episode_url(episode_id), api_key="grpokit",
                                                http_client=http, max_retries=0)
                    call = agent(client=client, model=server.model_name, **arguments)
                else:
                    client = openai.OpenAI(base_url=server.episode_url(episode_id), api_key="grpokit", max_retries=0)
                    call = asyncio.get_running_loop().run_in_executor(
                        threads, lambda: agent(client=client, model=server.model_name, **arguments))
                value = await asyncio.wait_for(call, timeout)
            except TimeoutError:
                raise AgentError(f"agent {name!r} did not finish within agent_timeout={timeout} s ({where})") from None
            except Exception as error:
                raise AgentError(f"agent {name!r} raised {type(error).__name__}: {error} ({where})") from error
            rewards = episode_rewards(value, agent, where)
            turns = server.pop_episode(episode_id)
            if not turns:
                raise AgentError(f"agent {name!r} made no request to the policy ({where}), so the episode has no "
                                 "tokens to train; call the model through the client it is given, at "
                                 f"{client.base_url}")
            return Episode(episode_id, row, generation, rewards, turns, time.perf_counter() - start)

    tasks = [asyncio.create_task(episode(row, g)) for row in range(len(rows)) for g in range(group)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await http.aclose()
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)  # a hung plain-def agent is abandoned, not awaited
