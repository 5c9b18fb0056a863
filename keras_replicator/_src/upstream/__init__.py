"""The one door to Keras' and TensorFlow's private code outside `patches/`.

Every module of the package that is not a patch reaches `keras.src.*` and
`tensorflow.python.*` through the names here (a patch imports what it
replaces itself, beside its pins). `PINS` names, for each private module,
the attributes the package reads: `patches/upstream_pins.py` registers
them as the pins of a patch with no targets, so the registry checks them
exactly as it checks the patches' (at import on the installed release,
which `make test-compat` runs on every supported pair; and, on a release
newer than the supported range, before it is accepted).
`tests/test_architecture.py` fails when any other module imports them.

Keras 3.16 (its nightly builds from 3.16.0.dev, tested on
3.16.0.dev2026102704) moved the TensorFlow backend's ops into
`keras/src/backend/tensorflow/ops/` and renamed the trainer classes:
`TensorFlowTrainer` is now `Trainer` in `backend/tensorflow/trainer.py`,
and the backend-independent `trainers.trainer.Trainer` is `BaseTrainer`.
The code is the same; patches and pins name it through here.
TODO: delete the first branch when the oldest supported Keras is 3.16.

A leaf: it imports nothing of this package.
"""

import keras
from keras.src import callbacks as callbacks_module
from keras.src.backend.common import global_state
from keras.src.backend.common import remat as keras_remat
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.distribution import distribution_lib
from keras.src.initializers import constant_initializers
from keras.src.initializers import random_initializers
from keras.src.utils.python_utils import pythonify_logs
from packaging import version as _version
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.data.experimental.ops import (
    distribute as tf_data_distribute,
)
from tensorflow.python.distribute import collective_all_reduce_strategy as cars
from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import sharded_variable
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.distribute.coordinator import values as ps_values
from tensorflow.python.eager import context
from tensorflow.python.eager import record
from tensorflow.python.ops import collective_ops
from tensorflow.python.ops import gen_stateless_random_ops_v2 as gen_random

if _version.Version(keras.version()) < _version.Version("3.16.0.dev0"):
    # Keras 3.10 to 3.15.
    from keras.src.backend.tensorflow import core as tf_core
    from keras.src.backend.tensorflow import numpy as tf_numpy
    from keras.src.backend.tensorflow.trainer import (
        TensorFlowTrainer as TensorFlowTrainer,
    )
    from keras.src.trainers.trainer import Trainer as BaseTrainer

    # The module of the TensorFlow backend's ops (`core`, `numpy`, ...).
    TF_OPS = "keras.src.backend.tensorflow"
    # The TensorFlow trainer's and the base trainer's names in their modules.
    TF_TRAINER = "TensorFlowTrainer"
    BASE_TRAINER = "Trainer"
else:
    from keras.src.backend.tensorflow.ops import core as tf_core
    from keras.src.backend.tensorflow.ops import numpy as tf_numpy
    from keras.src.backend.tensorflow.trainer import (
        Trainer as TensorFlowTrainer,
    )
    from keras.src.trainers.trainer import BaseTrainer as BaseTrainer

    TF_OPS = "keras.src.backend.tensorflow.ops"
    TF_TRAINER = "Trainer"
    BASE_TRAINER = "BaseTrainer"

# {private module: the attributes the package reads in it}, every name
# above included (a module imported whole is pinned by what is read of it).
PINS = {
    "keras.src.callbacks": ("CallbackList",),
    "keras.src.backend.common.global_state": ("get_global_attribute",),
    "keras.src.backend.common.remat": ("RematScope",),
    "keras.src.backend.common.symbolic_scope": ("in_symbolic_scope",),
    "keras.src.distribution.distribution_lib": (
        "DataParallel",
        "ModelParallel",
        "list_devices",
    ),
    "keras.src.initializers.constant_initializers": (
        "Constant",
        "Ones",
        "Zeros",
    ),
    "keras.src.initializers.random_initializers": (
        "GlorotNormal",
        "GlorotUniform",
        "HeNormal",
        "HeUniform",
        "LecunNormal",
        "LecunUniform",
        "RandomNormal",
        "RandomUniform",
        "TruncatedNormal",
        "VarianceScaling",
    ),
    "keras.src.utils.python_utils": ("pythonify_logs",),
    "keras.src.trainers.trainer": (BASE_TRAINER,),
    "keras.src.backend.tensorflow.trainer": (TF_TRAINER,),
    TF_OPS + ".core": (),
    TF_OPS + ".numpy": (),
    "tensorflow.python.autograph.core.ag_ctx": ("control_status_ctx",),
    "tensorflow.python.autograph.impl.api": ("tf_convert",),
    "tensorflow.python.data.experimental.ops.distribute": (
        "_AutoShardDataset",
        "_LegacyRebatchDataset",
    ),
    "tensorflow.python.distribute.collective_all_reduce_strategy": (
        "CollectiveAllReduceExtended",
        "CollectiveAllReduceExtended._distribute_datasets_from_function",
        "CollectiveAllReduceExtended._experimental_distribute_dataset",
        "CollectiveAllReduceExtended._make_input_context",
    ),
    "tensorflow.python.distribute.cross_device_ops": ("CollectiveAllReduce",),
    "tensorflow.python.distribute.input_util": (
        "get_distributed_dataset",
        "get_distributed_datasets_from_function",
    ),
    "tensorflow.python.distribute.mirrored_strategy": (
        "MirroredExtended",
        "MirroredExtended._distribute_datasets_from_function",
        "MirroredExtended._experimental_distribute_dataset",
    ),
    "tensorflow.python.distribute.sharded_variable": ("ShardedVariable",),
    "tensorflow.python.distribute.values": ("PerReplica",),
    "tensorflow.python.distribute.coordinator.values": (
        "deserialize_dataset_from_graph",
        "serialize_dataset_to_graph",
    ),
    "tensorflow.python.eager.context": ("context",),
    "tensorflow.python.eager.record": (
        "could_possibly_record",
        "should_record_backprop",
    ),
    "tensorflow.python.ops.collective_ops": ("all_to_all_v2",),
    "tensorflow.python.ops.gen_stateless_random_ops_v2": (
        "stateless_random_get_alg",
        "stateless_random_get_key_counter",
        "stateless_random_normal_v2",
        "stateless_random_uniform_v2",
        "stateless_truncated_normal_v2",
    ),
}

__all__ = (
    "BASE_TRAINER",
    "PINS",
    "TF_OPS",
    "TF_TRAINER",
    "BaseTrainer",
    "TensorFlowTrainer",
    "ag_ctx",
    "autograph",
    "callbacks_module",
    "cars",
    "collective_ops",
    "constant_initializers",
    "context",
    "cross_device_ops",
    "distribution_lib",
    "gen_random",
    "global_state",
    "in_symbolic_scope",
    "input_util",
    "keras_remat",
    "mirrored_strategy",
    "ps_values",
    "pythonify_logs",
    "random_initializers",
    "record",
    "sharded_variable",
    "tf_core",
    "tf_data_distribute",
    "tf_numpy",
    "tf_values",
)
