"""Implementation of keras_replicator. Private: import from the package root.

Importing it first checks that TensorFlow and Keras are versions the
patches were written for (`core/versions.py`): an unsupported version
raises an `ImportError` here, before any module reads their internals.
"""

from keras_replicator._src.core import versions as _versions

_versions.check()
