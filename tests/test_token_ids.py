"""llmpy.token_ids: the checks both models run on the token ids they are handed."""
import numpy as np
import pytest

from llmpy.errors import LlmpyError
from llmpy.token_ids import check_vocabulary


@pytest.mark.parametrize("dtype, bad", [(np.int8, -1), (np.int16, -20000), (np.int16, -1), (np.int32, -1)])
def test_a_negative_id_in_a_narrow_signed_array_is_refused(dtype, bad):
    # read as unsigned, int8's -1 is 255 and int16's -20000 is 45536: inside GPT-2's 50257 tokens
    ids = np.array([[3, bad, 7]], dtype=dtype)
    with pytest.raises(LlmpyError, match=rf"token id {bad} at \[0, 1\], outside the model's vocabulary"):
        check_vocabulary(ids, 50257, "inputs")
    check_vocabulary(np.array([[3, 100, 7]], dtype=dtype), 50257, "inputs")  # in range: accepted
