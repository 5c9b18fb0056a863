"""Implementation of keras_replicator. Private: import from the package root.

Importing it first checks that TensorFlow and Keras are versions the
patches were written for (`core/versions.py`): an unsupported version
raises an `ImportError` here, before any module reads their internals.
In the `keras-replicator` command's own process, whose `--help`, `launch`
and `tf-config` import no TensorFlow (`cluster/lazy_package.py`), the
check runs when the package loads in full instead.
"""

from keras_replicator._src.cluster import lazy_package as _lazy_package
from keras_replicator._src.cluster import tf_logs as _tf_logs
from keras_replicator._src.core import versions as _versions

if not _lazy_package.defer():
    # One of mpiexec's, srun's or a TF_CONFIG job's processes: as quiet as
    # under `keras-replicator launch` (no TensorFlow C++ start-up logs),
    # before anything imports TensorFlow.
    _tf_logs.quiet_launched_process()
    _versions.check()
