"""One rollout's tool calls and environment turns (:class:`ToolSession`), run between decode steps.

A completion that closes a tool call, or that ends a turn (a stop token) with an environment that replies
(``reply(turn)``, docs/environments.md), hands the call to the box's thread pool and *waits*: while the call runs,
its decode steps are holes (a key and value written to the cache but masked, its position not advanced, nothing
recorded) and every other completion keeps decoding. When the result is in, its tokens replace the completion's next
picks, one per step, through the same KV cache: nothing is re-encoded, the model's own tokens are never
re-tokenized. Holes leave no trace in the rollout, and each completion samples its k-th token with its own k-th
uniform draw (:meth:`ToolSession.uniforms`), so the tokens do not depend on how long a call took.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpokit.rollout.tool_calls import ToolCall, run_tool
from grpokit.rollout.tool_use import ToolUse, environment_tools, tool_messages
from grpokit.user_code import Overran, call_with_timeout

TOOL_COUNTS = ("tool_rate", "tool_calls", "tool_errors")  # per completion (:meth:`ToolSession.counts`)


class EnvironmentFailure(RuntimeError):
    """An environment's ``reset``, ``reply`` or ``end`` raised: named with its class, the call and the row."""


@dataclass
class _Turn:
    """An environment's reply to a completion's turn, in flight or done."""

    tokens: int = 0  # inserted
    seconds: float = 0.0


def environment_call(environment: Any, method: str, row: int, *args: Any, **kwargs: Any) -> Any:
    """``environment.method(...)``, an exception re-raised as :class:`EnvironmentFailure` naming what failed."""
    try:
        return getattr(environment, method)(*args, **kwargs)
    except EnvironmentFailure:
        raise
    except Exception as error:
        raise EnvironmentFailure(f"environment {type(environment).__name__}.{method} raised {type(error).__name__}: "
                                 f"{error} (completion {row})") from error


class ToolSession:
    """Runs the calls of one rollout of N completions between decode steps: :meth:`intervene` sees each step's
    picks and returns them with queued result tokens in place of sampled ones, and the rows that wait marked as
    holes. ``can_hold`` False (a sharded model, whose processes must run the same steps, or fixed-shape decoding):
    a step's calls still run concurrently, and the step waits for them instead of leaving holes."""

    def __init__(self, box: Any, n: int, max_new_tokens: int, environments: list[Any] | None):
        self.box, self.n, self.max_new_tokens, self.environments = box, n, max_new_tokens, environments
        # Where environments' resets gave observations (:meth:`ToolBox.session`): each completion's observation (or
        # None), and the N rendered prompts to sample from.
        self.observations: list[str | None] | None = None
        self.prompts: list[str] | None = None
        self.can_hold = True
        self.tokens = torch.zeros(n, max_new_tokens, dtype=torch.long)  # what each completion holds so far
        self.segment_start = [0] * n  # where the text after the last call begins
        self.turn_start = [0] * n  # where the completion's current turn begins
        self.pending: dict[int, list[int]] = {}  # row → result tokens still to insert
        # row → the call in flight, what makes its result's tokens, and the column they go in at
        self.waiting: dict[int, tuple[Future, Callable[[Any], list[int] | None], int]] = {}
        self.ending: set[int] = set()  # rows whose environment ended the episode: they leave at their next step
        self.inserted: list[tuple[int, int]] = []  # (row, column) of every inserted token
        self.calls: list[list[ToolUse]] = [[] for _ in range(n)]
        self.turns: list[list[_Turn]] = [[] for _ in range(n)]
        self.seen = [0] * n  # tokens through which the environment's reply has seen the completion
        self.holes = 0

    def __bool__(self) -> bool:
        return True

    def sample_prompts(self, prompts: list[str], group_size: int) -> tuple[list[str], int]:
        """What to sample from: ``(prompts, group_size)``, or, where environments' resets changed them, each
        completion's own prompt and 1."""
        return (prompts, group_size) if self.prompts is None else (self.prompts, 1)

    def uniforms(self, generator: torch.Generator | None, device: torch.device) -> Tensor:
        """(N, max_new_tokens) uniform draws: completion i's token k is sampled with draw [i, k], whatever the
        steps it waited."""
        return torch.rand(self.n, self.max_new_tokens, generator=generator, device=device)

    def tools_of(self, row: int) -> Mapping[str, Callable]:
        if self.environments is None:
            return self.box.tools
        return {**self.box.tools, **environment_tools(self.environments[row])}

    # ---- between decode steps ------------------------------------------------------------------------------------

    def intervene(self, columns: Tensor, rows: Tensor, chosen: Tensor, stopped: Tensor, logp: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The picks of the running ``rows`` (each at its own ``columns``: tokens it holds so far) → ``(chosen,
        stopped, logp, hold)``: queued tokens in place of sampled ones (never stopping; log-prob 0: not the
        policy's), stop tokens that an environment answers not stopping, and ``hold`` on the rows that wait for a
        call (their pick is a hole; a row whose episode its environment ended holds and stops)."""
        rows_list, columns_list = rows.tolist(), columns.tolist()
        if self.waiting and all(row in self.waiting and not self.waiting[row][0].done() for row in rows_list):
            # Nothing would decode this step: wait for the first call to finish instead of spinning.
            wait([self.waiting[row][0] for row in rows_list], return_when=FIRST_COMPLETED)
        hold = torch.zeros(len(rows_list), dtype=torch.bool)
        forced: dict[int, int] = {}
        # Only the rows with a call in flight, a result to insert or an episode ending are looked at one by one.
        special = self.waiting.keys() | self.pending.keys() | self.ending
        at = {row: k for k, row in enumerate(rows_list)} if special else {}
        for row in sorted(special & at.keys()):
            k = at[row]
            if row in self.waiting and self.waiting[row][0].done():
                self._harvest(row)
            if row in self.ending:
                hold[k] = True
            elif row in self.waiting:
                hold[k] = True
            elif row in self.pending:
                queue = self.pending[row]
                forced[k] = queue.pop(0)
                if not queue:
                    del self.pending[row]
                self.inserted.append((row, columns_list[k]))
        stop = stopped.cpu().clone()
        if forced or hold.any():
            chosen, logp = chosen.clone(), logp.clone()
            if forced:
                index = torch.tensor(list(forced), device=chosen.device)
                chosen[index] = torch.tensor(list(forced.values()), device=chosen.device)
                logp[index] = 0.0
                stop[list(forced)] = False
            ends = [at[row] for row in self.ending if row in at]
            stop[hold] = False
            stop[ends] = True
            for k in ends:
                self.ending.discard(rows_list[k])
        cpu, kept = chosen.cpu(), ~hold
        self.tokens[rows.cpu()[kept], columns.cpu()[kept]] = cpu[kept]
        own = kept.clone()
        own[list(forced)] = False
        # The policy's own picks that may end a turn (a stop token) or close a call (a token that can end the
        # protocol's close tag): only these are decoded and looked at.
        candidates = own & (stop | self.box.closing_tokens(cpu))
        for k in candidates.nonzero().squeeze(1).tolist():
            row, column = rows_list[k], columns_list[k]
            if stop[k]:
                if self._reply_to_turn(row, column):
                    stop[k] = False
            else:
                self._maybe_call(row, column)
        self.holes += int((hold & ~stop).sum())  # rows waiting (not those whose episode ended here)
        if not self.can_hold and self.waiting:  # every call this step started, all at once: wait for them
            wait([future for future, _, _ in self.waiting.values()])
            for row in list(self.waiting):
                self._harvest(row)
        return chosen, stop.to(stopped.device), logp, hold.to(stopped.device)

    def _submit(self, row: int, fn: Callable[[], Any], tokens: Callable[[Any], list[int] | None], start: int
                ) -> None:
        self.waiting[row] = (self.box.pool().submit(fn), tokens, start)

    def _harvest(self, row: int) -> None:
        """A finished call's result → the row's queued tokens (cut to its budget), or the end of its episode.
        The row has waited in holes since its call: the result goes in at the column after the call."""
        future, tokens, column = self.waiting.pop(row)
        ids = tokens(future.result())  # an environment's failure is raised here, in the decoding thread
        if ids is None:
            self.ending.add(row)
            return
        ids = ids[: self.max_new_tokens - column]  # what fits before the completion's budget ends
        if ids:
            self.pending[row] = ids
        else:  # nothing fits: the completion ends here (it cannot sample after a hole)
            self.ending.add(row)
        # The next call is searched for after the result: a result's own text (an error quoting the close tag, a
        # tool returning a call) is never read as a call. A reply starts the next turn.
        self.segment_start[row] = column + len(ids)
        return

    def _maybe_call(self, row: int, column: int) -> None:
        box = self.box
        close = box.protocol.close
        text = box.tokenizer.decode(self.tokens[row, self.segment_start[row]: column + 1].tolist(),
                                    skip_special_tokens=True)
        end = text.find(close)
        if end < 0:
            return
        if len(self.calls[row]) >= box.max_calls:
            call = ToolCall(error=f"at most {box.max_calls} tool calls per completion")
        else:
            call = box.protocol.parse(text[: end + len(close)])
        tools = self.tools_of(row)
        use = ToolUse(call.name, call.arguments, "", False, column + 1, 0, 0.0)
        self.calls[row].append(use)
        self.segment_start[row] = self.max_new_tokens  # no second call until the result is in

        def run() -> tuple[str, bool, float]:
            started = time.perf_counter()
            result, failed = run_tool(call, tools, box.timeout, box.max_reply_chars)
            return result, failed, time.perf_counter() - started

        def tokens(outcome: tuple[str, bool, float]) -> list[int]:
            use.result, use.failed, use.seconds = outcome
            ids = box.encode(box.protocol.result_pieces(use.result, call))
            use.tokens = min(len(ids), self.max_new_tokens - column - 1)
            return ids

        self._submit(row, run, tokens, column + 1)

    def _reply_to_turn(self, row: int, column: int) -> bool:
        """A stop token at ``column``: if the row's environment replies and turns are left, ask it (the row
        waits; True: the completion goes on), else the episode ends there (False)."""
        environment = None if self.environments is None else self.environments[row]
        if environment is None or not callable(getattr(environment, "reply", None)):
            return False
        if len(self.turns[row]) + 1 >= self.box.max_turns or column + 1 >= self.max_new_tokens:
            return False  # the episode ends with a turn the environment has not seen: end(turn) gets it
        text = self.box.tokenizer.decode(self.tokens[row, self.turn_start[row]: column + 1].tolist(),
                                         skip_special_tokens=True)
        turn = _Turn()
        self.turns[row].append(turn)
        self.seen[row] = column + 1
        box = self.box

        def run() -> tuple[str | None, float]:
            started = time.perf_counter()
            try:
                reply = call_with_timeout(lambda: environment_call(environment, "reply", row, text), {}, box.timeout,
                                          "reply")
            except Overran as error:
                raise EnvironmentFailure(f"environment {type(environment).__name__}.reply took longer than "
                                         f"tool_timeout ({box.timeout} s) (completion {row})") from error
            return reply, time.perf_counter() - started

        def tokens(outcome: tuple[str | None, float]) -> list[int] | None:
            reply, turn.seconds = outcome
            if reply is None:
                return None
            if not isinstance(reply, str):
                raise EnvironmentFailure(f"environment {type(environment).__name__}.reply returned "
                                         f"{type(reply).__name__}, not a text or None (completion {row})")
            ids = box.encode(box.turn_pieces(reply if box.max_reply_chars is None else reply[: box.max_reply_chars]))
            turn.tokens = min(len(ids), self.max_new_tokens - column - 1)
            self.turn_start[row] = column + 1 + turn.tokens
            return ids

        self._submit(row, run, tokens, column + 1)
        return True

    def finish(self, lengths: Sequence[int]) -> None:
        """After the rollout: calls still running finished, and each environment with ``end`` told of the turn that
        no reply saw (the text since its last reply, where the completion ran out of tokens or turns), all at once.
        ``lengths``: each completion's tokens."""
        for row in list(self.waiting):
            future, tokens, _ = self.waiting.pop(row)
            tokens(future.result())  # a call begun on the last token: recorded, nothing inserted
        if self.environments is None:
            return
        jobs = []
        for row, (environment, n) in enumerate(zip(self.environments, lengths)):
            if not callable(getattr(environment, "end", None)):
                continue
            last = None if self.seen[row] >= n or self.turn_start[row] >= n else self.box.tokenizer.decode(
                self.tokens[row, self.turn_start[row]: n].tolist(), skip_special_tokens=True)
            jobs.append(self.box.pool().submit(environment_call, environment, "end", row, last))
        for job in jobs:
            job.result()

    # ---- what the rollout hands on -------------------------------------------------------------------------------

    def tool_mask(self, width: int, device: torch.device | str) -> Tensor:
        """(N, width) long: 1 on every inserted token."""
        mask = torch.zeros(self.n, self.max_new_tokens, dtype=torch.long)
        if self.inserted:
            rows, columns = zip(*self.inserted)
            mask[list(rows), list(columns)] = 1
        return mask[:, :width].to(device)

    def reward_inputs(self, rollout: Any, prompts: Sequence[Any], columns: dict[str, list]
                      ) -> list[list[dict[str, Any]]] | None:
        """What reward functions get from this session's rollout (a :class:`~grpokit.rollout.generate.Rollout`)
        beyond its text: each completion's environment, added to ``columns`` as ``environments``, and, where a
        prompt is conversational, each trajectory as messages (the assistant's turns and the tool results;
        returned, else None), as TRL passes them."""
        if self.environments is not None:
            columns["environments"] = self.environments
        if not any(isinstance(prompt, list) for prompt in prompts):
            return None
        return [tool_messages(self.box.tokenizer, rollout.completion_ids[i, : int(n)].tolist(), self.calls[i])
                for i, n in enumerate(rollout.lengths.tolist())]

    def own_steps(self, steps: list[list[tuple[int, float]]], rollout: Any) -> list[list[tuple[int, float]]]:
        """Each completion's reward steps, those ending on an inserted token moved (:func:`own_token_steps`)."""
        return [own_token_steps(s, mask) for s, mask in zip(steps, rollout.model_mask.tolist())]

    def metrics(self) -> dict[str, float]:
        """The rollout's calls, failed calls and seconds spent in tools; with replying environments their
        replies and seconds; the decode steps completions spent waiting (docs/metrics.md)."""
        calls = [call for row in self.calls for call in row]
        stats = {"tool_calls": len(calls), "tool_errors": sum(c.failed for c in calls),
                 "time_tools": sum(c.seconds for c in calls), "wait_steps": self.holes}
        turns = [turn for row in self.turns for turn in row]
        if turns:
            stats.update(env_replies=len(turns), time_environment=sum(t.seconds for t in turns))
        return stats

    def counts(self) -> dict[str, Tensor]:
        """(N,) float per completion, under :data:`TOOL_COUNTS`'s names: whether it called a tool, its calls, its
        failed calls."""
        calls = torch.tensor([[len(c), sum(u.failed for u in c)] for c in self.calls], dtype=torch.float)
        return dict(zip(TOOL_COUNTS, ((calls[:, 0] > 0).float(), calls[:, 0], calls[:, 1])))


class InertSession:
    """The session of the empty box (a run without tools), :data:`INERT`: falsy, so ``generate`` never hands it
    a decode step (it costs nothing per step); it inserts nothing (``tool_mask`` None), gives reward functions
    nothing more, moves no step, and has no calls (``calls`` None: the rollout had no tools) nor metrics."""

    calls = environments = prompts = observations = None

    def __bool__(self) -> bool:
        return False

    def tool_mask(self, width: int, device: torch.device | str) -> None:
        return None

    def sample_prompts(self, prompts: list[str], group_size: int) -> tuple[list[str], int]:
        return prompts, group_size

    def finish(self, lengths: Sequence[int]) -> None:
        return None

    def reward_inputs(self, rollout: Any, prompts: Sequence[Any], columns: dict[str, list]) -> None:
        return None

    def own_steps(self, steps: list[list[tuple[int, float]]], rollout: Any) -> list[list[tuple[int, float]]]:
        return steps

    def metrics(self) -> dict[str, float]:
        return {}

    def counts(self) -> dict[str, Tensor]:
        return {}


INERT = InertSession()


def own_token_steps(steps: list[tuple[int, float]], model_mask: list[int]) -> list[tuple[int, float]]:
    """Steps that end on an inserted tool token (a completion cut off inside a tool's result) moved to the
    policy's last token before it: rewards sit on the policy's actions (PPO's GAE reads them there)."""
    own = [i for i, m in enumerate(model_mask) if m]
    if not own:
        return steps
    moved: dict[int, float] = {}
    for end, reward in steps:
        if not model_mask[end]:
            end = max([i for i in own if i <= end], default=own[0])
        moved[end] = moved.get(end, 0.0) + reward
    return sorted(moved.items())
