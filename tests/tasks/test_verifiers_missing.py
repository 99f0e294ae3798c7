"""``environment: verifiers:NAME`` where verifiers is not installed, or names a v1 taskset: the error says how to
install it, or what the adapter speaks. In the default suite, with verifiers absent or faked (verifiers' own tests
need its environment: bash scripts/test_verifiers.sh)."""

import sys
import types

import pytest

from grpokit.tasks.environments import load_environment_task


def test_verifiers_not_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # as if absent, where it is installed
    with pytest.raises(ValueError, match=r"verifiers is not installed: pip install 'grpokit\[verifiers\]' \(or bash "
                                         r"scripts/test_verifiers.sh"):
        load_environment_task("verifiers:wordle", {"num_train_examples": 4})


def fake_module(monkeypatch, name, **attributes):
    module = types.ModuleType(name)
    module.__dict__.update(attributes, __path__=[])
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_a_v1_taskset_is_named_as_one(monkeypatch):
    """verifiers 0.3 holds a preview of its v1 API (verifiers.v1): a v1 environment package exports a Taskset
    subclass, not load_environment(). The fakes stand where verifiers 0.3.1 and such a package would."""
    def module_name(env_id):
        return env_id.replace("-", "_").split("/")[-1]

    fake_module(monkeypatch, "verifiers", __version__="0.3.1")
    fake_module(monkeypatch, "verifiers.utils")
    fake_module(monkeypatch, "verifiers.utils.env_utils", env_module_name=module_name,
                import_env_module=lambda env_id: sys.modules[module_name(env_id)])
    taskset = type("Taskset", (), {"__module__": "verifiers.v1.taskset"})
    fake_module(monkeypatch, "reverse_text_v1", ReverseTextTaskset=type("ReverseTextTaskset", (taskset,), {}),
                Taskset=taskset)
    with pytest.raises(ValueError, match=r"verifiers environment 'reverse-text-v1' is a verifiers v1 taskset "
                                         r"\(ReverseTextTaskset: a verifiers.v1.Taskset\).*verifiers 0.3.x serves"):
        load_environment_task("verifiers:reverse-text-v1", {})
    fake_module(monkeypatch, "no_loader")
    with pytest.raises(ValueError, match=r"'no-loader': its module 'no_loader' has no load_environment\(\)"):
        load_environment_task("verifiers:no-loader", {})
