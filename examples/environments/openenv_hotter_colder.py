"""A small OpenEnv environment: find a number from 1 to 20 in up to four guesses, told "warmer" or "colder" after each;
each step is rewarded by how close the guess is, a right guess ends the episode with 1. Runs in process
(``environment: openenv:examples/environments/openenv_hotter_colder.py:HotterColder``) or behind OpenEnv's server
(``python examples/environments/openenv_hotter_colder.py --port 8000``, then ``environment: openenv:http://127.0.0.1:8000``)."""

import random
import re
from typing import Any

from openenv.core import Action, Environment, Observation, State


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str = ""


class HotterColder(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, tries: int = 4):
        super().__init__()
        self.tries, self._state, self.secret, self.last = tries, State(), 1, None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret, self.last = random.Random(seed).randint(1, 20), None
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="I am thinking of a number from 1 to 20. Guess it: answer with the number.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"\d+", action.guess)
        done = self._state.step_count >= self.tries
        if not numbers:
            return GuessObservation(message="Answer with a number from 1 to 20.", reward=0.0, done=done)
        guess = int(numbers[-1])
        if guess == self.secret:
            return GuessObservation(message="Right!", reward=1.0, done=True)
        distance = abs(guess - self.secret)
        trend = "" if self.last is None else (" Warmer." if distance < self.last else " Colder.")
        self.last = distance
        reward = max(0.0, 0.5 - distance / 40)
        return GuessObservation(message=f"Not {guess}.{trend} Guess again.", reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


if __name__ == "__main__":
    import argparse

    import uvicorn
    from openenv.core import create_app

    parser = argparse.ArgumentParser(description="serve HotterColder with OpenEnv's server app")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    app = create_app(HotterColder, GuessAction, GuessObservation, max_concurrent_envs=256)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
