"""Where the private Keras code the patches use lives, per Keras release.

Keras 3.16 (its nightly builds from 3.16.0.dev, tested on
3.16.0.dev2026102704) moved the TensorFlow backend's ops into
`keras/src/backend/tensorflow/ops/` and renamed the trainer classes:
`TensorFlowTrainer` is now `Trainer` in `backend/tensorflow/trainer.py`,
and the backend-independent `trainers.trainer.Trainer` is `BaseTrainer`.
The code is the same; patches and pins name it through here.
TODO: delete the first branch when the oldest supported Keras is 3.16.
"""

from keras_replicator._src.core import versions

if versions.keras_before("3.16.0.dev0"):
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

__all__ = (
    "BASE_TRAINER",
    "TF_OPS",
    "TF_TRAINER",
    "BaseTrainer",
    "TensorFlowTrainer",
    "tf_core",
    "tf_numpy",
)
