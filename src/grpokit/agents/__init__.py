"""Agents as the rollout: an ``async def agent(client, model, **row)`` written against the ``openai`` SDK drives its
own episodes against grpokit's policy server (:mod:`grpokit.serving`), and what the server recorded becomes the
training samples (:mod:`grpokit.rollout.served_samples`). Environments that call the model themselves (verifiers 0.4)
come in here as agents."""
