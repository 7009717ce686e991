"""Settings: env < CLI < API, and every malformed value names its source."""
import pytest

from engine import config
from engine.errors import ConfigError


def test_defaults():
    s = config.from_env({})
    assert s.backend == "cpu" and s.snapkv_budget is None and s.snapkv_window == 32
    assert s.snapkv_sinks == 4 and s.snapkv_kernel == 31 and s.snapkv_pool == "avg"
    assert s.snapkv_granularity == "head" and s.snapkv_min_tokens == 128 and s.snapkv_auto_mib == 256


def test_env_then_cli_then_api():
    env = {"SHARPI_SNAPKV_BUDGET": "512", "SHARPI_SNAPKV_WINDOW": "16", "SHARPI_BACKEND": "reference"}
    s = config.resolve(env=env)
    assert (s.snapkv_budget, s.snapkv_window, s.backend) == (512, 16, "reference")
    s = config.resolve(cli={"snapkv_budget": "1024"}, env=env)
    assert (s.snapkv_budget, s.snapkv_window) == (1024, 16)
    s = config.resolve(cli={"snapkv_budget": "1024"}, api={"snapkv_budget": 2048, "snapkv_window": 8}, env=env)
    assert (s.snapkv_budget, s.snapkv_window) == (2048, 8)


def test_budget_zero_is_explicit_off():
    assert config.from_env({"SHARPI_SNAPKV_BUDGET": "0"}).snapkv_budget == 0
    assert config.from_env({"SHARPI_SNAPKV_BUDGET": ""}).snapkv_budget is None


@pytest.mark.parametrize("var,value", [
    ("SHARPI_SNAPKV_BUDGET", "lots"), ("SHARPI_SNAPKV_BUDGET", "-1"), ("SHARPI_SNAPKV_WINDOW", "0"),
    ("SHARPI_SNAPKV_WINDOW", "1.5"), ("SHARPI_SNAPKV_SINKS", "-2"), ("SHARPI_SNAPKV_KERNEL", "x"),
    ("SHARPI_SNAPKV_POOL", "median"), ("SHARPI_SNAPKV_GRANULARITY", "token"), ("SHARPI_BACKEND", "tpu"),
    ("SHARPI_SNAPKV_RECENCY", "0"), ("SHARPI_SNAPKV_MIN_TOKENS", "many"), ("SHARPI_SNAPKV_AUTO_MIB", "big"),
    ("SHARPI_THREADS", "0"), ("SHARPI_CTX", "abc"), ("SHARPI_SNAPKV_MERGE", "-1"),
    ("SHARPI_SNAPKV_ALLOCATION", "ragged"), ("SHARPI_SNAPKV_PYRAMID_BETA", "0"),
])
def test_malformed_env_names_variable(var, value):
    with pytest.raises(ConfigError) as e:
        config.from_env({var: value})
    assert var in str(e.value) and "\n" not in str(e.value)


def test_malformed_flag_names_flag():
    with pytest.raises(ConfigError, match="--kv-budget"):
        config.resolve(cli={"snapkv_budget": "x"}, env={})
    with pytest.raises(ConfigError, match="--kv-pool"):
        config.resolve(cli={"snapkv_pool": "sum"}, env={})


def test_malformed_argument_names_argument():
    with pytest.raises(ConfigError, match="snapkv_window"):
        config.resolve(api={"snapkv_window": "wide"}, env={})
    with pytest.raises(ConfigError, match="unknown setting"):
        config.resolve(api={"snapkv_bugdet": 3}, env={})


def test_every_setting_has_doc_and_env_or_flag():
    for spec in config.SETTINGS:
        assert spec.doc and (spec.env or spec.flag)


def test_env_setting_reads_one_variable():
    assert config.env_setting("cpu_kernels", env={}) == "auto"
    assert config.env_setting("cpu_kernels", env={"SHARPI_CPU_KERNELS": " Portable "}) == "portable"
    with pytest.raises(ConfigError, match="SHARPI_CPU_KERNELS"):
        config.env_setting("cpu_kernels", env={"SHARPI_CPU_KERNELS": "fast"})


def test_kv_dtype_setting():
    assert config.resolve(env={}).kv_dtype == "bf16"
    assert config.resolve(env={"SHARPI_KV_DTYPE": " TQ4 "}).kv_dtype == "tq4"
    assert config.resolve(cli={"kv_dtype": "q8_0/tq4"}, env={"SHARPI_KV_DTYPE": "tq4"}).kv_dtype == "q8_0/tq4"
    assert config.resolve(api={"kv_dtype": "tq3/tq3"}, cli={"kv_dtype": "q8_0"}, env={}).kv_dtype == "tq3"
    with pytest.raises(ConfigError, match="--kv-dtype must be one of bf16, q8_0, q4_0, tq4, tq3"):
        config.resolve(cli={"kv_dtype": "fp8"}, env={})
    with pytest.raises(ConfigError, match="SHARPI_KV_DTYPE"):
        config.resolve(env={"SHARPI_KV_DTYPE": "q8_0/tq4/bf16"})
    assert config.resolve(cli={"kv_dtype": "RQ4_0:0-0=q8_0/rq4_0"}, env={}).kv_dtype == "rq4_0:0=q8_0/rq4_0"
    with pytest.raises(ConfigError, match="--kv-dtype: layer 1 is named twice"):
        config.resolve(cli={"kv_dtype": "tq4:0-1=q8_0:1=bf16"}, env={})


def test_settings_read_from_the_environment_only_are_refused_as_load_keywords():
    """engine.load(cuda_executor="cpu-harness") had no effect (the backend reads the
    environment): one line naming the variable instead."""
    import engine
    from engine.errors import ConfigError
    with pytest.raises(ConfigError, match="cuda_executor is read from the environment only .* set SHARPI_CUDA_EXECUTOR"):
        engine.load("no-such.gguf", cuda_executor="cpu-harness")
