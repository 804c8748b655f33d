"""The door check on a request's tokens (request_checks.py); tests/test_reliability_server.py sends the
same requests to a live server."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_dflash.request_checks import check_input_ids

pytestmark = pytest.mark.unit


def test_in_vocabulary_ids_pass():
    check_input_ids([0, 5, 99], vocab_size=100)
    check_input_ids(list(np.array([1, 2], dtype=np.int64)), vocab_size=100)  # numpy ints from the Engine API


@pytest.mark.parametrize("ids, message", [
    ([], "input is empty"),
    ([1, 100], r"outside this model's vocabulary \[0, 100\): \[100\]"),
    ([-1, 2, -7], r"2 token id\(s\) outside .*\[-1, -7\]"),
    ([1, 2.5], "outside this model's vocabulary"),
    ([1, "3"], "outside this model's vocabulary"),
])
def test_bad_ids_are_refused_by_name(ids, message):
    with pytest.raises(ValueError, match=message):
        check_input_ids(ids, vocab_size=100)
