"""vf-v1-dialog: a multi-turn, infinite taskset whose own Env drives the conversation: the task has no prompt, a
scripted user opens it and follows each reply with the next of its turns (verifiers' `interaction`). Two rewards:
the replies that echo the word each user turn asked for, and (weighing against) their length."""

import itertools

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "amber", "maple"]


class DialogData(vf.TaskData):
    words: list[str]


class DialogTask(vf.Task[DialogData]):
    @vf.reward(weight=2.0)
    async def echoed(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum(w in r for w, r in zip(self.data.words, replies)) / len(self.data.words)

    @vf.reward(weight=-0.25)
    async def verbosity(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        return sum(len(r) for r in replies) / 10


class DialogConfig(vf.TasksetConfig):
    turns: int = 2


class DialogTaskset(vf.Taskset[DialogTask, DialogConfig]):
    INFINITE = True

    def load(self):
        for i in itertools.count():
            words = [WORDS[(i + t) % len(WORDS)] for t in range(self.config.turns)]
            yield DialogTask(DialogData(words=words), self.config.task)


class DialogEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            for word in task.data.words:
                if (await interaction.turn(f"Say the word {word}.")).terminated:
                    break


__all__ = ["DialogEnv", "DialogTaskset"]
