"""``environment: verifiers:NAME`` where verifiers is not installed: the error says how to install it. In the default
suite (verifiers' own tests need its environment: bash scripts/test_verifiers.sh)."""

import sys

import pytest

from grpokit.tasks.environments import load_environment_task


def test_verifiers_not_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if absent, where it is installed
    with pytest.raises(ValueError, match=r"verifiers is not installed: pip install 'grpokit\[verifiers\]' \(or bash "
                                         r"scripts/test_verifiers.sh"):
        load_environment_task("verifiers:wordle", {"num_train_examples": 4})
