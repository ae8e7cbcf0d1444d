import random

import numpy as np

from services.instance.engine.fake import fake_next_token, fake_next_token_array


def test_vectorised_fake_model_is_identical_to_the_reference():
    rng = random.Random(0)
    for n in (1, 7, 8, 9, 100, 5000, 16000):
        ctx = [rng.randrange(0, 2**24) for _ in range(n)]
        assert fake_next_token_array(np.array(ctx, dtype=np.int64)) == fake_next_token(ctx), n
