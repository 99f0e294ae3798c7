"""grpokit.agents.verifiers_v1 where verifiers 0.4 is not what is installed: verifiers absent, or 0.3 (whose
environments go through grpokit.tasks.verifiers), is named with the fix; verifiers_major_minor reads the installed
version without importing verifiers. In the default suite (verifiers 0.4's own tests need its environment: bash
scripts/test_verifiers_v1.sh)."""

from importlib.metadata import PackageNotFoundError

import pytest

from grpokit.agents import verifiers_v1
from grpokit.agents.verifiers_v1 import VerifiersV1Error, verifiers_v1_task
from grpokit.runtime import versions


def test_verifiers_absent_or_another_version_is_named(monkeypatch):
    monkeypatch.setattr(verifiers_v1, "verifiers_major_minor", lambda: None)
    with pytest.raises(VerifiersV1Error, match=r"verifiers is not installed: pip install 'grpokit\[verifiers_v1\]' "
                                               r"\(verifiers>=0\.4,<0\.5; or bash scripts/test_verifiers_v1\.sh"):
        verifiers_v1_task("reverse-text")
    monkeypatch.setattr(verifiers_v1, "verifiers_major_minor", lambda: (0, 3))
    with pytest.raises(ValueError, match=r"verifiers 0\.3 is installed; grpokit\.agents\.verifiers_v1 speaks "
                                         r"verifiers 0\.4's v1 API.*pip install 'verifiers>=0\.4,<0\.5'.*"
                                         r"grpokit\.tasks\.verifiers instead"):
        verifiers_v1_task("reverse-text", {"taskset": {"dataset_split": "train"}})


@pytest.mark.parametrize("installed, expected", [("0.4.0", (0, 4)), ("0.3.1", (0, 3)), ("0.4.1.dev3", (0, 4)),
                                                 ("1.0rc1", (1, 0)), (None, None)])
def test_verifiers_major_minor_reads_the_installed_version(monkeypatch, installed, expected):
    def version(package):
        assert package == "verifiers"
        if installed is None:
            raise PackageNotFoundError(package)
        return installed

    monkeypatch.setattr(versions, "version", version)
    assert versions.verifiers_major_minor() == expected
