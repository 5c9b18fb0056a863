"""TpuReplicator without a TPU: resolver arguments, errors, auto() order."""

import pytest
import tensorflow as tf

import keras_replicator as kr
from keras_replicator._src.core import devices as devices_lib
from keras_replicator._src.replicators import auto as auto_lib
from keras_replicator._src.replicators import tpu as tpu_lib

_TPU_ENV = ("TPU_NAME", "COLAB_TPU_ADDR")


@pytest.fixture
def no_tpu_env(monkeypatch):
    for name in _TPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(devices_lib.glob, "glob", lambda pattern: [])
    return monkeypatch


def test_no_tpu_error_names_what_was_looked_for(no_tpu_env):
    with pytest.raises(RuntimeError, match="No TPU found") as info:
        kr.TpuReplicator()
    message = str(info.value)
    for looked_for in ("TPU_NAME", "COLAB_TPU_ADDR", "/dev/accel", "tpu="):
        assert looked_for in message


def test_find_tpu_order(no_tpu_env):
    assert tpu_lib.find_tpu() is None
    no_tpu_env.setattr(devices_lib.glob, "glob", lambda p: ["/dev/accel0"])
    assert tpu_lib.find_tpu() == "local"
    no_tpu_env.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    assert tpu_lib.find_tpu() == "grpc://10.0.0.2:8470"
    no_tpu_env.setenv("TPU_NAME", "my-pod")
    assert tpu_lib.find_tpu() == "my-pod"


def test_resolver_for_grpc_address_and_resolver(no_tpu_env):
    resolver = tpu_lib.resolver_for("grpc://10.0.0.2:8470")
    assert isinstance(
        resolver, tf.distribute.cluster_resolver.TPUClusterResolver
    )
    assert resolver.master() == "grpc://10.0.0.2:8470"
    assert tpu_lib.resolver_for(resolver) is resolver
    no_tpu_env.setenv("COLAB_TPU_ADDR", "10.0.0.3:8470")
    assert tpu_lib.resolver_for(None).master() == "grpc://10.0.0.3:8470"


def test_resolver_rejects_bad_type():
    with pytest.raises(TypeError, match="Received: tpu=8"):
        kr.TpuReplicator(tpu=8)


def test_auto_prefers_a_tpu(no_tpu_env):
    assert auto_lib.choose().backend != "TpuReplicator"
    no_tpu_env.setenv(
        "TF_CONFIG",
        '{"cluster": {"worker": ["a:1", "b:2"]},'
        ' "task": {"type": "worker", "index": 0}}',
    )
    no_tpu_env.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    choice = auto_lib.choose()
    assert choice.backend == "TpuReplicator"
    assert choice.kwargs == {"tpu": "grpc://10.0.0.2:8470"}


def test_static_shapes_default_on_under_tpu_strategy_only():
    source = tf.data.Dataset.range(8)
    assert kr.data.shard(source, 4).static_shapes is False
    with kr.LocalReplicator(2).scope():
        assert kr.data.shard(source, 4).static_shapes is False
