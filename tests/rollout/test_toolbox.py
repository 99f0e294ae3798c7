"""grpokit.rollout.tools piece by piece, without a model: the checks a ToolBox makes when it is built, what an
environment offers and how it scores, and a session's bookkeeping (its tool mask, counts, metrics, and the reward
steps it moves off inserted tokens). The rollout tests reach these lines only through whole decodes, where a
one-line fault can hide (the mutation audit, docs/reliability.md)."""

import pytest
import torch

from grpokit.rollout.tool_calls import PlainProtocol
from grpokit.rollout.tools import (
    ToolBox,
    ToolSession,
    ToolUse,
    add_environment_reward,
    calculator,
    environment_reward,
    environment_tools,
    own_token_steps,
    reward_keywords,
    tool_functions,
    tool_messages,
)
from grpokit.tasks.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(tool_tags=True)


def shout(text: str) -> str:
    """Upper case.

    Args:
        text: what to shout
    """
    return text.upper()


class Shop:
    """An environment: its public methods are tools; ``reset`` and its reward are not; a property is never read."""

    def reset(self, item, **row):
        self.item, self.bought = item, []

    def buy(self, what: str) -> str:
        """Buy something.

        Args:
            what: the item
        """
        self.bought.append(what)
        return "ok"

    def get_reward(self) -> float:
        return float(self.item in self.bought)

    def reward(self) -> float:
        raise AssertionError("get_reward comes first")

    def _restock(self):
        raise AssertionError("private: no tool")

    @property
    def stock(self):
        raise AssertionError("a property is never evaluated")


class Judged:
    """Scores itself by ``reward()`` (the name TRL does not use)."""

    def reset(self, **row):
        pass

    def reward(self) -> float:
        return 0.5


class Silent:
    """No score of its own."""

    def reset(self, **row):
        pass

    def look(self) -> str:
        """Look."""
        return "nothing"


def use(failed=False, seconds=0.0):
    return ToolUse("calculator", {}, "error: x" if failed else "1", failed, 0, 1, seconds)


def test_tools_are_called_by_their_names_each_name_once():
    class Tool:
        def __call__(self):
            return "x"

    tool = Tool()
    assert tool_functions([calculator, shout, tool]) == {"calculator": calculator, "shout": shout, "Tool": tool}
    assert tool_functions({"calc": calculator}) == {"calc": calculator}  # a mapping names them itself
    with pytest.raises(ValueError, match="tools: 'calculator' is not callable"):
        tool_functions(["calculator"])
    with pytest.raises(ValueError, match="tools: two tools are named 'calculator'; a tool is called by its name"):
        tool_functions([calculator, shout, calculator])


def test_an_environment_offers_its_public_methods_and_scores_itself():
    shop, judged, silent = Shop(), Judged(), Silent()
    shop.reset("pen")
    assert sorted(environment_tools(shop)) == ["buy"] and environment_tools(judged) == {}
    assert environment_reward([shop, judged, silent]) == [0.0, 0.5, None]
    assert environment_tools(shop)["buy"]("pen") == "ok" and shop.bought == ["pen"]  # bound to the instance
    assert environment_reward([shop]) == [1.0]


@pytest.mark.parametrize("factory, name", [(Shop, "Shop"), (lambda: Judged(), "Judged")])
def test_environments_that_score_themselves_add_a_reward_of_weight_one(factory, name):
    funcs, weights = [calculator], [2.0]
    add_environment_reward(funcs, weights, factory)
    assert weights == [2.0, 1.0] and funcs[1].__name__ == name
    environment = factory()
    environment.reset(item="pen")
    assert funcs[1](environments=[environment], completions=["c"]) == environment_reward([environment])
    assert reward_keywords(factory) == ["environments"]


def test_nothing_is_added_without_a_factory_or_a_score():
    funcs, weights = [], []
    add_environment_reward(funcs, weights, None)
    add_environment_reward(funcs, weights, Silent)
    add_environment_reward(funcs, weights, lambda: Silent())
    assert funcs == [] and weights == [] and reward_keywords(None) == []


def test_a_toolbox_refuses_what_it_cannot_run(tok):
    with pytest.raises(ValueError, match=r"environment_factory: object has no reset\(\*\*row\) method"):
        ToolBox(tok, environment_factory=object)

    class Clash(Silent):
        def calculator(self, expression: str) -> str:
            return expression

    with pytest.raises(ValueError, match=r"Clash's methods \['calculator'\] have the names of tools"):
        ToolBox(tok, [calculator], environment_factory=Clash)
    with pytest.raises(ValueError, match="ToolBox: tools need the tokenizer"):
        ToolBox(None, [calculator])
    with pytest.raises(ValueError, match="ToolBox: tools need the tokenizer"):
        ToolBox(None, environment_factory=Silent)


def test_only_tokens_that_can_end_a_call_are_scanned(tok):
    box = ToolBox(tok, [calculator])
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    assert box.closing.tolist() == [">" in piece for piece in pieces]
    assert box.closing[tok.convert_tokens_to_ids("</tool>")] and not box.closing[tok.convert_tokens_to_ids("l")]


def test_a_box_is_active_with_tools_or_an_environment(tok):
    assert ToolBox(tok, [calculator]) and ToolBox(tok, environment_factory=Silent) and not ToolBox(tok)
    plain = ToolBox(tok, [calculator])
    assert plain.prompt_tools() is None  # the plain-text protocol: prompts say nothing of the tools
    listed = ToolBox(tok, [calculator], environment_factory=Shop, protocol=PlainProtocol())
    assert [fn.__name__ for fn in listed.schema_tools()] == ["calculator", "buy"]
    assert listed.prompt_tools() == listed.schema_tools()
    assert ToolBox(tok, protocol=PlainProtocol()).prompt_tools() is None  # no tools: none to list


def test_each_completion_gets_its_own_environment_reset_with_its_row(tok):
    box = ToolBox(tok, [calculator], environment_factory=Shop)
    session = box.session([{"item": "pen"}, {"item": "ink"}], 2, 10)
    assert [e.item for e in session.environments] == ["pen", "pen", "ink", "ink"]
    assert len({id(e) for e in session.environments}) == 4
    assert sorted(session.tools_of(2)) == ["buy", "calculator"]
    session.tools_of(2)["buy"]("ink")
    assert [e.bought for e in session.environments] == [[], [], ["ink"], []]
    columns = {}
    session.reward_inputs(None, ["q"] * 4, columns)
    assert columns == {"environments": session.environments}
    plain = ToolBox(tok, [calculator]).session([{}], 3, 10)
    assert plain.environments is None and plain.tools_of(1) is plain.box.tools and len(plain.calls) == 3


def test_a_sessions_mask_counts_and_metrics(tok):
    session = ToolSession(ToolBox(tok, [calculator]), 3, 6, None)
    session.calls = [[use(seconds=0.25), use(failed=True, seconds=0.5)], [], [use(seconds=1.0)]]
    session.inserted = [(0, 1), (0, 2), (2, 5)]
    assert session.metrics() == {"tool_calls": 3, "tool_errors": 1, "time_tools": 1.75, "wait_steps": 0}
    counts = session.counts()
    assert list(counts) == ["tool_rate", "tool_calls", "tool_errors"]
    assert [counts[key].tolist() for key in counts] == [[1.0, 0.0, 1.0], [2.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    assert all(value.dtype == torch.float for value in counts.values())  # averaged into rates downstream
    mask = session.tool_mask(6, "cpu")
    assert mask.dtype == torch.long and mask.tolist() == [[0, 1, 1, 0, 0, 0], [0] * 6, [0, 0, 0, 0, 0, 1]]
    assert session.tool_mask(3, "cpu").tolist() == [[0, 1, 1], [0, 0, 0], [0, 0, 0]]  # cut to the rollout's width
    assert ToolSession(ToolBox(tok, [calculator]), 2, 4, None).tool_mask(4, "cpu").tolist() == [[0] * 4] * 2


def test_steps_on_inserted_tokens_move_to_the_policys_last_token_before_them():
    mask = [0, 1, 1, 0, 0, 1, 0]  # 0: a prompt-side hole at the start, 3-4 inserted, 6 inserted at the end
    assert own_token_steps([(5, 1.0)], mask) == [(5, 1.0)]  # on the policy's own token: stays
    assert own_token_steps([(4, 1.0), (3, 0.5), (2, 0.25)], mask) == [(2, 1.75)]  # moved and summed there
    assert own_token_steps([(6, 1.0), (1, 2.0)], mask) == [(1, 2.0), (5, 1.0)]  # sorted by where they end
    assert own_token_steps([(0, 1.0)], mask) == [(1, 1.0)]  # nothing of the policy's before: its first token
    steps = [(0, 1.0)]
    assert own_token_steps(steps, [0, 0]) is steps  # no token of the policy's: nothing to move to


def test_tool_messages_drop_special_tokens_from_the_assistants_text(tok):
    ids = tok("<pad>ab<tool>x</tool>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    call = ToolUse("f", {"a": 1}, "out", False, start=len(ids) - 1, tokens=0, seconds=0.0)
    assert tool_messages(tok, ids, [call]) == [
        {"role": "assistant", "content": "ab<tool>x</tool>",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "name": "f", "content": "out"}, {"role": "assistant", "content": ""}]
