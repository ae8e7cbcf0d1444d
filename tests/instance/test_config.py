"""Instance options reach the engine they configure."""

from services.instance.service import InstanceConfig


def test_torch_threads_reaches_the_native_engine_config():
    assert InstanceConfig(engine="native", torch_threads=1).engine_config().extra == {"num_threads": 1}
    assert "num_threads" not in InstanceConfig(engine="native").engine_config().extra


def test_engine_options_are_passed_through():
    e = InstanceConfig(engine="sim", num_blocks=77, block_size=8, max_model_len=512, seed=3).engine_config()
    assert (e.engine, e.num_blocks, e.block_size, e.max_model_len, e.seed) == ("sim", 77, 8, 512, 3)
