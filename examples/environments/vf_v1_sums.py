"""vf-v1-sums: a verifiers 0.4 (v1) taskset written as for verifiers itself: sums of two numbers from 1 to 20, one
turn, rewards `correct` (1.0) and `bare` (0.2: the reply is the number alone). grpokit runs its episodes as an agent
against the served policy (docs/environments.md, "verifiers 0.4"); run.sh puts this folder on the Python path, where
verifiers finds it by name (`environment: verifiers:vf-v1-sums`)."""

import random

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.stop
    async def one_reply(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = [word.strip(".,!") for word in (trace.last_reply or "").split()]
        numbers = [word for word in numbers if word.lstrip("-").isdigit()]
        return 1.0 if numbers and numbers[-1] == self.data.answer else 0.0

    @vf.reward(weight=0.2)
    async def bare(self, trace: vf.Trace) -> float:
        return 1.0 if (trace.last_reply or "").strip() == self.data.answer else 0.0


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 64
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        rng = random.Random(self.config.seed)
        pairs = [(rng.randint(1, 20), rng.randint(1, 20)) for _ in range(self.config.num_tasks)]
        return [SumTask(SumData(prompt=f"What is {a} + {b}?", system_prompt="Answer with the number only.",
                                answer=str(a + b)), self.config.task) for a, b in pairs]


__all__ = ["SumTaskset"]
