"""A small multi-turn verifiers environment (verifiers 0.3.x): guess a number from 1 to 20 in up to four turns; after
each guess the environment says "higher" or "lower". Loaded by name (``environment: verifiers:vf_count_down``) once
this folder is on the Python path, as an installed verifiers environment is."""

import random

import verifiers as vf
from datasets import Dataset


class CountDown(vf.MultiTurnEnv):
    async def setup_state(self, state):
        state["guesses"] = []
        return state

    async def env_response(self, messages, state, **kwargs):
        words = messages[-1].content.replace("<", " ").replace(">", " ").split()
        numbers = [int(w) for w in words if w.isdigit()]
        guess = numbers[-1] if numbers else None
        state["guesses"].append(guess)
        if guess is None:
            return [vf.UserMessage(content="Answer with a number from 1 to 20.")]
        if guess == int(state["answer"]):
            state["final_env_response"] = [vf.UserMessage(content="Right!")]
            return state["final_env_response"]
        return [vf.UserMessage(content=f"{guess} is too {'low' if guess < int(state['answer']) else 'high'}. "
                                       "Guess again.")]


def load_environment(num_examples: int = 64, seed: int = 0, max_turns: int = 4):
    draw = random.Random(seed)
    rows = [{"question": "I am thinking of a number from 1 to 20. Guess it: answer with the number alone.",
             "answer": str(draw.randint(1, 20))} for _ in range(num_examples)]

    def solved(state) -> float:
        return 1.0 if state["guesses"] and state["guesses"][-1] == int(state["answer"]) else 0.0

    def closeness(state) -> float:
        # the best guess's distance, so that an unsolved game still has a gradient
        made = [g for g in state["guesses"] if g is not None]
        return max(0.0, 1.0 - min(abs(g - int(state["answer"])) for g in made) / 20) if made else 0.0

    def answered_with_numbers(state) -> float:
        return sum(g is not None for g in state["guesses"]) / max(1, len(state["guesses"]))

    rubric = vf.Rubric(funcs=[solved, closeness, answered_with_numbers], weights=[1.0, 0.5, 0.5])
    return CountDown(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=max_turns,
                     system_prompt="You play a guessing game. Each reply is one number.")
