"""vf-v1-arith: a single-turn arithmetic taskset (no network, no judge). Two weighted rewards, one of them keyed
(a mapping of named scores), and a metric; a `train` and an `eval` split. A task marked `broken` fails its setup."""

from typing import Literal

import verifiers.v1 as vf

QUESTIONS = {"train": [("2+2", "4"), ("3+4", "7"), ("5+1", "6"), ("9-3", "6"), ("8/2", "4"), ("1+1", "2")],
             "eval": [("6+1", "7"), ("2*3", "6")]}


class ArithData(vf.TaskData):
    answer: str
    broken: bool = False
    """The task's setup raises: a failed episode."""


class ArithTask(vf.Task[ArithData]):
    async def setup(self, trace: vf.Trace, runtime) -> None:
        if self.data.broken:
            raise RuntimeError("the board broke")

    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return 1.0 if (trace.last_reply or "").strip() == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def shape(self, trace: vf.Trace) -> dict[str, float]:
        reply = trace.last_reply or ""
        return {"brevity": 1.0 / (1 + len(reply)), "digits": sum(c.isdigit() for c in reply) / max(1, len(reply))}

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class ArithConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    num_tasks: int = -1


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        rows = QUESTIONS[self.config.split]
        rows = rows if self.config.num_tasks < 0 else rows[: self.config.num_tasks]
        return [ArithTask(ArithData(prompt=f"What is {q}?", system_prompt="Answer with the number only.",
                                    answer=a), self.config.task) for q, a in rows]


__all__ = ["ArithTaskset"]
