"""The built-in tasks, which the demo and the tests train on without downloading anything: two-digit addition
(:mod:`.arithmetic`) and products with a calculator (:mod:`.tool_task`), the tiny model and its character tokenizer
(:mod:`.tiny_model`), the supervised warm start on a flawed corpus and its cache (:mod:`.warm_start`), and the
packaged recipes (``recipes/*.yaml``). Library code reaches them only through :mod:`grpokit.resolve`."""
