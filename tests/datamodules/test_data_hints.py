"""``recipes.api.method_args_from_data``: method args left null take the DataModule's hints; set values stay."""

from __future__ import annotations

from recipes.api import method_args_from_data


class _Data:
    def method_hints(self):
        return {"in_chans": 7, "img_size": [11, 20], "not_an_arg": 1}


def test_nulls_take_the_hints_and_set_values_stay():
    args = {"in_chans": None, "img_size": [8, 16], "depth": 2}
    out = method_args_from_data(args, _Data())
    assert out == {"in_chans": 7, "img_size": [8, 16], "depth": 2}  # a hint for an unknown arg is not added
    assert args["in_chans"] is None  # the config's args are not changed in place


def test_a_datamodule_without_hints_changes_nothing():
    args = {"in_chans": None}
    assert method_args_from_data(args, object()) == args
