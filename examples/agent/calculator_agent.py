"""An agent written with the openai SDK, as one would write it for any OpenAI-compatible server: a multi-turn
episode in which the model may use a calculator tool before it answers. grpokit trains it (examples/agent/README.md):

    bash examples/agent/run.sh    # grpokit train examples/agent/grpo.yaml --model gguf:SMOLLM2

The tool protocol is the agent's own (SmolLM2's chat template has no tool-call format): the model writes
<calc>EXPRESSION</calc>, the agent computes it and sends the result back as the next user message. Nothing the model
writes is evaluated: the calculator reads numbers and + - * / with the ast module.
"""

from __future__ import annotations

import ast
import operator
import re

SYSTEM = ("Solve the problem. You have a calculator: write <calc>EXPRESSION</calc> (numbers and + - * /) and the "
          "result comes back as <result>VALUE</result>. Give the final answer as <answer>NUMBER</answer>. "
          "Example: What is 12 + 34? <calc>12 + 34</calc> <result>46</result> <answer>46</answer>")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_TURNS = 3


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error text; only numbers and + - * / (never eval)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers and + - * /")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as error:
        return f"error: {error}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def calculator_agent(client, model: str, question: str, answer: str) -> dict[str, float]:
    """One episode: up to MAX_TURNS model turns, each a calculator call (answered, then the model goes on), the final
    answer, or neither (then the agent asks for the answer). Rewards: ``correct`` (the answer, or else the last
    number of the last reply, equals the row's),
    ``answered`` (0.2 for an answer in <answer>NUMBER</answer>) and ``used_calculator`` (0.1 once it called the
    calculator with an expression that computes)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    used = 0.0
    text = ""
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=32,
                                                     stop=["</calc>"])
        text = reply.choices[0].message.content or ""
        call = re.search(r"<calc>(.*)$", text, re.S)  # the stop string ends the call: the reply stops before it
        if call is not None and reply.choices[0].finish_reason == "stop":
            result = calculate(call.group(1))
            used = max(used, 0.0 if result.startswith("error") else 0.1)
            messages += [{"role": "assistant", "content": text + "</calc>"},
                         {"role": "user", "content": f"<result>{result}</result>"}]
        elif "<answer>" not in text:  # no call, no answer yet: the agent asks for one
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "Now reply with only the final answer: <answer>NUMBER</answer>"}]
        else:
            break
    tagged = re.search(r"<answer>\s*(-?\d+)\s*</answer>", text)
    numbers = re.findall(r"-?\d+", text)  # read leniently: the answer tag's number, else the last number written
    final = tagged.group(1) if tagged else numbers[-1] if numbers else None
    return {"correct": float(final == answer), "answered": 0.2 * (tagged is not None), "used_calculator": used}
