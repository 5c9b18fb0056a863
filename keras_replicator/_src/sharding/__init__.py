"""Variables stored in blocks: layouts, block-wise draws, gather/reduce, remat.

The mechanics of `keras.distribution`'s sharded variables, called by Keras
hooks in `patches/` (`sharded_variables.py`, `trainer_loops.py`); nothing
here imports a patch, a replicator or the `distribution/` front door.
"""
