"""punica_x/api.py: every public name resolves to the object its module defines, and a name
that is not public is refused by name."""

import importlib

import pytest

import punica_x.api as api


def test_every_public_name_is_its_modules_object():
    for name in api.__all__:
        module = importlib.import_module(api._WHERE[name])
        assert getattr(api, name) is getattr(module, api._RENAMED.get(name, name)), name
    assert set(dir(api)) == set(api.__all__)


def test_an_internal_name_is_not_public():
    with pytest.raises(AttributeError, match="the public names"):
        api.Batch  # noqa: B018 (an engine-internal type of punica_x.core)
    with pytest.raises(ImportError):
        exec("from punica_x.api import Request")
