"""Our replicators' distributed iterators run without tf.data autotuning.

The stall this prevents (deleting an iterator waits out the autotune thread's
sleep, up to tens of seconds) is a race, so it is not asserted here: these
tests pin the mechanism. benchmarks/multi_worker_scaling.py measures it.
"""

import copy

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.data.ops import multi_device_iterator_ops as mdi

import keras_replicator as kr
from keras_replicator._src.patches import iterator_teardown
from keras_replicator._src.patches import registry


def _dataset():
    return tf.data.Dataset.from_tensor_slices(
        np.arange(32, dtype=np.float32)
    ).batch(8)


def _device_stages_autotune(iterator):
    """`autotune.enabled` of each per-device stage of a distributed iterator.

    None is TensorFlow's default, which autotunes.
    """
    (worker,) = iterator._iterators  # one input worker in-process
    return [
        it._dataset.options().autotune.enabled
        for it in worker._iterator._device_iterators
    ]


def test_without_autotune_thread_respects_an_explicit_choice():
    quiet = iterator_teardown.without_autotune_thread(_dataset())
    assert quiet.options().autotune.enabled is False
    options = tf.data.Options()
    options.autotune.enabled = True
    chosen = _dataset().with_options(options)
    assert iterator_teardown.without_autotune_thread(chosen) is chosen
    assert iterator_teardown.without_autotune_thread([1, 2]) == [1, 2]
    # A budget is a choice to tune too.
    budget = tf.data.Options()
    budget.autotune.ram_budget = 1 << 30
    tuned = _dataset().with_options(budget)
    assert iterator_teardown.without_autotune_thread(tuned) is tuned


def test_the_input_fn_wrapper_forwards_attributes_and_copies():
    def input_fn(ctx):
        return _dataset()

    input_fn.padded_eval = True
    wrapped = iterator_teardown.without_autotune_thread_fn(input_fn)
    assert wrapped.padded_eval is True
    assert wrapped.__name__ == "input_fn"
    copied = copy.copy(wrapped)
    assert copied(None).options().autotune.enabled is False


@pytest.mark.parametrize("how", ["dataset", "function"])
def test_local_replicator_iterators_do_not_autotune(how):
    replicator = kr.LocalReplicator(2)
    # Input options keep the MultiDeviceIterator that CPU replicas skip
    # (`patches/plain_iterator.py`); their plain iterator's pipeline is the
    # host's, quiet too.
    if how == "dataset":
        plain = replicator.experimental_distribute_dataset(_dataset())
        dist = replicator.experimental_distribute_dataset(
            _dataset(), tf.distribute.InputOptions()
        )
    else:
        fn = lambda ctx: _dataset().unbatch().batch(4)  # noqa: E731
        plain = replicator.distribute_datasets_from_function(fn)
        dist = replicator.distribute_datasets_from_function(
            fn, tf.distribute.InputOptions()
        )
    (worker,) = iter(plain)._iterators
    assert worker._dataset.options().autotune.enabled is False
    iterator = iter(dist)
    devices = _device_stages_autotune(iterator)
    assert devices == [False, False]
    # Same batches as without the change: replica 0 gets the first half.
    first = replicator.experimental_local_results(next(iterator))
    np.testing.assert_array_equal(first[0], [0, 1, 2, 3])
    np.testing.assert_array_equal(first[1], [4, 5, 6, 7])


def test_an_explicit_autotune_choice_keeps_tf_data_autotuning():
    replicator = kr.LocalReplicator(2)
    options = tf.data.Options()
    options.autotune.enabled = True
    iterator = iter(
        replicator.experimental_distribute_dataset(
            _dataset().with_options(options), tf.distribute.InputOptions()
        )
    )
    devices = _device_stages_autotune(iterator)
    assert devices == [None, None]


def test_plain_tf_distribute_is_untouched():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    kr.LocalReplicator(2)  # installs the patch
    assert registry.installed("iterator_teardown")
    iterator = iter(strategy.experimental_distribute_dataset(_dataset()))
    devices = _device_stages_autotune(iterator)
    assert devices == [None, None]


def test_install_is_reversible(restore_patches):
    registry = restore_patches
    registry.uninstall_all()
    stock = (mdi._create_device_dataset, mdi.OwnedMultiDeviceIterator.__init__)
    kr.LocalReplicator(2)
    assert registry.installed("iterator_teardown")
    assert mdi._create_device_dataset is not stock[0]
    registry.uninstall(["iterator_teardown"])
    assert mdi._create_device_dataset is stock[0]
    assert mdi.OwnedMultiDeviceIterator.__init__ is stock[1]
